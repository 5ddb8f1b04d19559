"""Compiled programs do not change when the compiler is made faster: every step, slot,
meta, plan and cost, and every bound run, of a set of graphs that exercise each part of
the compiler (promotion casts, constants, `expr`, `grad`, `jvp`, loops inside loops,
upstream gradients, the recording forward, no_grad), printed and hashed, against the
digests recorded before the compiler's rewrite.

A digest that changes means a program that changed: diff `fingerprint(...)` of the graph
on both sides of the change to see which step."""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Mapping
from typing import Any

import pytest

import gradserve.engine.graph.autodiff as autodiff
import gradserve.engine.graph.builder as builder
import gradserve.engine.graph.executor as executor
from gradserve.engine.graph import BodySpec, GraphSpec, NodeSpec, Program, TensorSpec, compile_graph
from gradserve.engine.graph.executor import LOOP, Run
from gradserve.engine.graph.ir import Lit, Step
from gradserve.engine.graph.scan import Body


def _fn(fn: Any) -> str:
    """A kernel by what it is (not where it lives)."""
    if fn is None:
        return "-"
    if isinstance(fn, functools.partial):
        return f"partial({_fn(fn.func)}, {len(fn.args)}, {sorted(fn.keywords)})"
    if isinstance(fn, types.FunctionType):
        # by the module names the digests were recorded under (before `gradserve.`)
        return f"{fn.__module__.removeprefix('gradserve.')}.{fn.__qualname__}"
    return type(fn).__name__ + ("" if not hasattr(fn, "__name__") else f":{fn.__name__}")


def _arg(a: Any) -> str:
    return f"{a.value!r}:{type(a.value).__name__}" if type(a) is Lit else str(a)


def _step(s: Step, out: list[str]) -> str:
    attrs = ",".join(
        f"{k}=<{_body(v, out)}>" if k == "body" else f"{k}={v!r}" for k, v in s.attrs.items()
    )
    return (
        f"{s.op.name}({','.join(_arg(a) for a in s.args)})[{attrs}]->{s.out}+{s.more} "
        f"{s.kind} {s.origin!r}"
    )


def _body(body: Body, out: list[str]) -> str:
    lines: list[str] = []
    if body.program is not None:
        _program(body.program, lines)
    # (what loops gained since the digests were recorded, where a loop has it)
    since = "".join(
        f" {name}={getattr(body, name)}"
        for name in ("shifted", "every", "replayed")
        if getattr(body, name)
    )
    if body.replay is not None:
        since += f" replay={body.replay.replayed}"
    return (
        f"carries={body.carries} xs={body.xs} closures={body.closures} "
        f"nexts={body.nexts} ys={body.ys} length={body.length} reverse={body.reverse} "
        f"wanted={body.wanted}{since} "
        f"steps=[{';'.join(_step(s, out) for s in body.steps)}] "
        f"program=<{'|'.join(lines)}>"
    )


def _run(r: Run) -> str:
    code, fn, out, a0, a1, rest, frees = r
    if code == LOOP:
        loop, body, inner = rest, rest.body, rest.inner
        # (the loop's results as they were written when the digests were recorded: a carry
        # by its number, a stack by -1 - its number among those written)
        nc = len(body.carries)
        stacks = [k for k, _ in loop.ys]
        results = [
            (slot, k if k < nc else -1 - stacks.index(k))
            for slot, k in loop.results
            if k < nc or k in stacks
        ]
        rest = (
            f"loop args={loop.args} carries={nc} xs={len(body.xs)} "
            f"nexts={body.nexts} ys={[(k - nc, y) for k, y in loop.ys]} "
            f"results={results} sources={inner.sources} sizes={inner.sizes} "
            f"given={inner.given} distinct={inner.distinct} "
            f"runs=[{';'.join(_run(r) for r in inner.bound)}]"
        )
        if loop.replay is not None or any(loop.kept):
            rest += (
                f" kept={loop.kept} all results={loop.results} replay runs="
                f"[{';'.join(_run(r) for r in loop.replay.bound) if loop.replay else ''}]"
            )
    return f"{code} {_fn(fn)} {out} {a0} {a1} {rest!r} {frees}"


def _program(p: Program, out: list[str]) -> None:
    out.append(f"metas={[(m.shape, m.dtype, m.literal) for m in p.metas]}")
    out.extend(_step(s, out) for s in p.steps)
    out.append(
        f"inputs={p.inputs} grad_inputs={p.grad_inputs} outputs={p.outputs} gradients={p.gradients}"
    )
    out.append(
        f"requires_grad={p.requires_grad} grad_fn={p.grad_fn} no_grad={p.no_grad} "
        f"backward={p.backward} held={sorted(p.held)}"
    )
    out.append(
        f"frees={p.frees} reuse={p.reuse} ufunc={p.ufunc} nodes={p.nodes} "
        f"peak={p.planned_peak_bytes} flops={p.flops} moved={p.bytes_moved}"
    )
    out.append(f"cost_by_node={sorted(p.cost_by_node.items())} step_costs={p.step_costs}")
    if p.run is not None:
        out.append(f"given={p.run.given}")
        out.extend("F " + _run(r) for r in p.run.forward)
        out.extend("B " + _run(r) for r in p.run.backward)


def fingerprint(program: Program) -> str:
    lines: list[str] = []
    _program(program, lines)
    return "\n".join(lines)


def _op(id_: str, op: str, *args: Any, **attrs: Any) -> NodeSpec:
    return NodeSpec(id_, op=op, args=list(args), attrs=attrs)


def _chain(steps: int) -> GraphSpec:
    nodes, h = [], "h0"
    for t in range(steps):
        nodes += [
            _op(f"p{t}", "mul", h, "w"),
            _op(f"q{t}", "add", f"p{t}", "x"),
            _op(f"h{t + 1}", "tanh", f"q{t}"),
        ]
        h = f"h{t + 1}"
    return GraphSpec([*nodes, _op("unused", "mul", "x", 3.0), _op("loss", "sum", h)], ["loss"])


def _cell(steps: int) -> GraphSpec:
    nodes, h = [], "h0"
    for t in range(steps):
        nodes += [
            _op(f"xw{t}", "matmul", f"x{t}", "w"),
            _op(f"hu{t}", "matmul", h, "u"),
            _op(f"s{t}", "add", f"xw{t}", f"hu{t}"),
            _op(f"a{t}", "add", f"s{t}", "b"),
            _op(f"a1_{t}", "add", f"a{t}", 1.0),
            _op(f"f{t}", "sigmoid", f"a1_{t}"),
            _op(f"fh{t}", "mul", f"f{t}", h),
            _op(f"g{t}", "sigmoid", f"a{t}"),
            _op(f"c{t}", "tanh", f"a{t}"),
            _op(f"gc{t}", "mul", f"g{t}", f"c{t}"),
            _op(f"h{t + 1}", "add", f"fh{t}", f"gc{t}"),
        ]
        h = f"h{t + 1}"
    return GraphSpec([*nodes, _op("hh", "mul", h, h), _op("loss", "sum", "hh")], ["loss"])


def _rnn() -> list[NodeSpec]:
    body = BodySpec(
        carry=["h"],
        xs=["x"],
        nodes=[NodeSpec("h2", expr="tanh(x @ w + h @ u + b)")],
        next={"h": "h2"},
    )
    return [
        NodeSpec(
            "rnn", op="scan", args=["h0", "xs"], body=body, results={"h_last": "h", "hs": "h2"}
        ),
        NodeSpec("loss", expr="sum(hs * hs) + sum(h_last)"),
    ]


def _nested() -> list[NodeSpec]:
    inner = BodySpec(
        carry=["c"], xs=["r"], nodes=[NodeSpec("c2", expr="sin(c * r + a)")], next={"c": "c2"}
    )
    outer = BodySpec(
        carry=["a"],
        xs=["row"],
        nodes=[
            NodeSpec("in", op="scan", args=["a", "row"], body=inner, results={"c_end": "c"}),
            NodeSpec("a2", expr="a * 0.5 + c_end"),
        ],
        next={"a": "a2"},
    )
    return [
        NodeSpec("out", op="scan", args=["a0", "m"], body=outer, results={"a_end": "a"}),
        NodeSpec("loss", expr="sum(a_end * a_end)"),
        NodeSpec("g", expr="grad(loss, m)"),
        NodeSpec("hv", expr="grad(sum(g * v), m)"),
    ]


def _f(*shape: int, grad: bool = True, dtype: str = "float64") -> TensorSpec:
    return TensorSpec(shape, dtype, grad)


RNN_INPUTS = {"xs": _f(5, 2, 3), "w": _f(3, 4), "u": _f(4, 4), "b": _f(4), "h0": _f(2, 4)}
MIXED = GraphSpec(
    [
        NodeSpec("k", expr="2 * 3 + 1"),  # literals alone: constants
        NodeSpec("y", expr="x * n + k"),  # int input: promotion casts
        NodeSpec("z", expr="sum(exp(y) / (1 + y ** 2), dim=0)"),
        NodeSpec(
            "m",
            expr="reshape(z, shape=[2, 2]) @ transpose(reshape(z, shape=[2, 2]), dim0=0, dim1=1)",
        ),
        NodeSpec("loss", expr="sum(m) + mean(where(y > 0, y, 0.5 * y))"),
        NodeSpec("g", expr="grad(loss, x)"),
        NodeSpec("j", expr="jvp(m, x, t)"),
        NodeSpec("d", expr="detach(y) * 2"),
    ],
    ["loss", "g", "j", "m"],
)
MIXED_INPUTS = {"x": _f(3, 4), "n": _f(3, 4, grad=False, dtype="int32"), "t": _f(3, 4, grad=False)}

# name -> (graph, inputs, compile options)
CASES: dict[str, tuple[GraphSpec, Mapping[str, TensorSpec], dict[str, Any]]] = {
    "chain": (_chain(30), {n: _f(8) for n in ("h0", "w", "x")}, {"backward": True}),
    "chain-wide": (_chain(4), {n: _f(8192) for n in ("h0", "w", "x")}, {"backward": True}),
    "chain-no-grad": (_chain(30), {n: _f(8) for n in ("h0", "w", "x")}, {"no_grad": True}),
    "cell": (
        _cell(3),
        {
            **{f"x{t}": _f(4, 16, dtype="float32") for t in range(3)},
            "w": _f(16, 16, dtype="float32"),
            "u": _f(16, 16, dtype="float32"),
            "b": _f(16, dtype="float32"),
            "h0": _f(4, 16, dtype="float32"),
        },
        {"backward": True},
    ),
    "cell-recorded": (
        _cell(3),
        {
            **{f"x{t}": _f(4, 16, dtype="float32") for t in range(3)},
            "w": _f(16, 16, dtype="float32"),
            "u": _f(16, 16, dtype="float32"),
            "b": _f(16, dtype="float32"),
            "h0": _f(4, 16, dtype="float32"),
        },
        {},
    ),
    "rnn": (
        GraphSpec(_rnn(), ["loss", "hs"]),
        RNN_INPUTS,
        {"backward": True, "grad_outputs": {"hs": _f(5, 2, 4, grad=False)}},
    ),
    "rnn-recorded": (GraphSpec(_rnn(), ["loss"]), RNN_INPUTS, {}),
    "rnn-unused": (
        GraphSpec([*_rnn(), NodeSpec("j", expr="jvp(hs, h0, h0)")], ["hs"]),
        RNN_INPUTS,
        {},
    ),  # (nodes no output needs: emitted last, in Kahn's order)
    "nested": (
        GraphSpec(_nested(), ["loss", "g", "hv"]),
        {"a0": _f(2, grad=False), "m": _f(3, 4, 2, grad=False), "v": _f(3, 4, 2, grad=False)},
        {},
    ),
    "mixed": (MIXED, MIXED_INPUTS, {}),
    "mixed-backward": (GraphSpec(MIXED.nodes, ["loss", "d"]), MIXED_INPUTS, {"backward": True}),
}

# Recorded from the compiler before its rewrite for speed; "rnn" since its backward reads
# the carry from the stack of its next value (the stack of the carry is gone).
DIGESTS = {
    "cell": "c4c8fd316934447b5cdf3e2b744332d7",
    "cell-recorded": "7cd23f163d7f19998683b69610b88a00",
    "chain": "5e57a4b95926e840034195b07d4356bc",
    "chain-no-grad": "d1f2870bcc9a5796e3b5939865cd69dc",
    "chain-wide": "0a28adf4c197ef639bce3aa42d6b6df0",
    "mixed": "20d1f4060121f0559bf122433c9e4e7f",
    "mixed-backward": "4e15438e97c279865768ad3b8650fd9e",
    "nested": "42ca6aa62feed750ec25d367eb84f00c",
    "rnn": "e099e687826fc06eafae09b49cef3229",
    "rnn-recorded": "849a2a280f18b746d015365d497f87de",
    "rnn-unused": "56f2877e4112c40e38dfda0aa6702bbe",
}


def _clear_memos() -> None:
    builder._DECISIONS.clear()
    autodiff._TEMPLATES.clear()
    executor._KERNELS.clear()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("memos", ["cleared", "warm"])
def test_programs_are_the_ones_recorded(name: str, memos: str) -> None:
    graph, inputs, options = CASES[name]
    if memos == "cleared":
        _clear_memos()
    else:  # what other graphs left in the memos must not change a program
        for other, (g, i, o) in CASES.items():
            if other != name:
                compile_graph(g, i, **o)
    text = fingerprint(compile_graph(graph, inputs, **options))
    assert hashlib.sha256(text.encode()).hexdigest()[:32] == DIGESTS[name]
