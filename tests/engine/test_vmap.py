"""`vmap`, `jacobian` and `hessian` nodes in the engine: every op sample mapped (in_axes 0,
1 and -1) against a loop of single calls; gradients through a vmap against the loop, central
finite differences in float64 and torch.func; per-sample gradients and their reductions
against torch.func and an Opacus-formula reference in NumPy; chunked runs bit-identical to
whole ones; Jacobians and Hessians against torch.autograd.functional; memory planned
against measured throughout; the problem each bad node gets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.autograd.functional as taf
import torch.func

from gradserve.engine.errors import MemoryBudgetError, ValidationErrors
from gradserve.engine.graph import (
    BodySpec,
    GraphSpec,
    Limits,
    MapBodySpec,
    NodeSpec,
    TensorSpec,
    compile_graph,
)
from gradserve.engine.graph.executor import execute
from gradserve.engine.graph.ir import Program
from gradserve.engine.graph.spec import ReductionSpec
from gradserve.engine.graph.xla import NotLowerable, lower
from gradserve.engine.ops import OPS
from tests.support.op_samples import TORCH, Sample
from tests.support.ops import op_cases

RNG = np.random.default_rng(28)
B = 3  # indices of the op samples' batches


def run(
    nodes: Sequence[NodeSpec],
    outputs: Sequence[str],
    arrays: Mapping[str, np.ndarray],
    *,
    requires: Sequence[str] = (),
    backward: bool = False,
    no_grad: bool = False,
    limits: Limits | None = None,
) -> tuple[Program, Any]:
    """Compile and run; every step's result checked against its shape rule, and the
    measured peak against the planned one."""
    program = compile_graph(
        GraphSpec(list(nodes), list(outputs)),
        {k: TensorSpec(a.shape, str(a.dtype), k in requires) for k, a in arrays.items()},
        backward=backward,
        no_grad=no_grad,
        limits=limits,
    )
    result = execute(program, dict(arrays), verify=True)
    assert result.peak_bytes == result.planned_peak_bytes
    return program, result


def errors_of(nodes: Sequence[NodeSpec], arrays: Mapping[str, np.ndarray]) -> list[Any]:
    with pytest.raises(ValidationErrors) as info:
        run(nodes, [nodes[-1].id if nodes[-1].op != "vmap" else "R"], arrays)
    return info.value.errors


def vmap(
    args: Sequence[str],
    ins: Sequence[str],
    nodes: Sequence[NodeSpec],
    results: Mapping[str, Any],
    *,
    in_axes: Sequence[int] | None = None,
    chunk_size: int | None = None,
    id: str = "v",
) -> NodeSpec:
    return NodeSpec(
        id,
        op="vmap",
        args=list(args),
        body=MapBodySpec(in_=list(ins), nodes=list(nodes)),
        results=dict(results),
        attrs={"in_axes": None if in_axes is None else list(in_axes), "chunk_size": chunk_size},
    )


# ------------------------------------------------------------------ every op sample


def _batch(a: np.ndarray) -> np.ndarray:
    """B variants of a sample's argument: floats moved a little per index (within the
    op's domain: 1% of the value), integers and bools the same (indices stay valid)."""
    if a.dtype.kind == "f":
        return np.stack([a * (1 + 0.01 * k) + 0.001 * k for k in range(B)])
    return np.stack([a] * B)


def _mapped_sample(
    name: str, s: Sample, axis: int, only_first: bool
) -> tuple[list[NodeSpec], dict[str, np.ndarray], list[int], list[np.ndarray]]:
    """A vmap of one op node over the sample's tensor arguments (all, or the first: the
    others read unmapped from outside), its inputs, and per argument its B batches."""
    tensors = [i for i, a in enumerate(s.args) if isinstance(a, np.ndarray)]
    mapped = tensors[:1] if only_first else tensors
    arrays: dict[str, np.ndarray] = {}
    args: list[Any] = []
    outer: list[str] = []
    ins: list[str] = []
    axes: list[int] = []
    batches: list[np.ndarray] = []
    for i, a in enumerate(s.args):
        if i in mapped:
            stacked = _batch(a)
            arrays[f"a{i}"] = np.moveaxis(stacked, 0, axis)
            outer.append(f"a{i}")
            ins.append(f"x{i}")
            axes.append(axis)
            args.append(f"x{i}")
            batches.append(stacked)
        elif isinstance(a, np.ndarray):
            arrays[f"a{i}"] = a
            args.append(f"a{i}")
        else:
            args.append(a)
    if not mapped:  # (a constant: the body maps a dummy it does not read)
        arrays["d"] = np.zeros((B, 2))
        outer, ins, axes = ["d"], ["dummy"], [0]
    node = vmap(
        outer,
        ins,
        [NodeSpec("r", op=name, args=args, attrs=dict(s.attrs))],
        {"R": "r"},
        in_axes=axes,
    )
    return [node], arrays, mapped, batches


def _loop(name: str, s: Sample, mapped: list[int], batches: list[np.ndarray]) -> np.ndarray:
    """The op once per index, on that index's arguments, stacked."""
    rows = []
    for k in range(B):
        args = list(s.args)
        for i, stacked in zip(mapped, batches, strict=True):
            args[i] = np.asarray(stacked[k])
        arrays = {f"a{i}": a for i, a in enumerate(args) if isinstance(a, np.ndarray)}
        node_args = [f"a{i}" if isinstance(a, np.ndarray) else a for i, a in enumerate(args)]
        _, result = run(
            [NodeSpec("r", op=name, args=node_args, attrs=dict(s.attrs))], ["r"], arrays
        )
        rows.append(result.outputs["r"])
    return np.stack(rows)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


def _differentiable(name: str, s: Sample) -> list[int]:
    """The sample's float arguments that the op differentiates."""
    op = OPS[name]
    return [
        i
        for i, a in enumerate(s.args)
        if isinstance(a, np.ndarray) and a.dtype.kind == "f" and op.arg_differentiable(i)
    ]


def _mapped_cases() -> list[Any]:
    """Every op sample, mapped over dims 0, 1 and -1 (1 where each mapped argument has a
    dim 1 once batched), all its tensor arguments or the first."""
    cases = []
    for case in op_cases():
        name, s = case.values
        for only_first in (False, True):
            tensors = [a for a in s.args if isinstance(a, np.ndarray)]
            mapped = tensors[:1] if only_first else tensors
            for axis in (0, 1, -1):
                if axis == 1 and any(a.ndim == 0 for a in mapped):
                    continue
                how = "first-mapped" if only_first else "all-mapped"
                cases.append(pytest.param(name, s, axis, only_first, id=f"{case.id}-{axis}-{how}"))
    return cases


@pytest.mark.parametrize(("name", "s", "axis", "only_first"), _mapped_cases())
def test_every_op_sample_under_vmap_is_a_loop_of_single_calls(
    name: str, s: Sample, axis: int, only_first: bool
) -> None:
    nodes, arrays, mapped, batches = _mapped_sample(name, s, axis, only_first)
    _, result = run(nodes, ["R"], arrays)
    if mapped:
        _close(result.outputs["R"], _loop(name, s, mapped, batches))
    else:
        _, one = run([NodeSpec("r", op=name, args=list(s.args), attrs=dict(s.attrs))], ["r"], {})
        _close(result.outputs["R"], np.stack([one.outputs["r"]] * B))


def _torch_reference(
    name: str, s: Sample, batches: dict[int, np.ndarray], weights: np.ndarray, wrt: list[int]
) -> dict[int, np.ndarray]:
    """∂ Σ weights · vmap(op) / ∂ each mapped argument, by PyTorch's autograd through
    the op's PyTorch form once per index, stacked (torch.func.vmap has no batching rule
    for some of the ops, and batches index_select with a 0-d index wrongly)."""
    order = sorted(batches)
    leaves = {i: torch.tensor(batches[i], requires_grad=i in wrt) for i in order}

    def single(*mapped: torch.Tensor) -> torch.Tensor:
        args = [
            torch.tensor(a) if isinstance(a, np.ndarray) else a for a in s.args
        ]  # (unmapped tensors: the same for each index)
        for i, t in zip(order, mapped, strict=True):
            args[i] = t
        return TORCH[name](torch, *args, **s.attrs)

    stacked = torch.stack([single(*(leaves[i][k] for i in order)) for k in range(B)])
    (stacked * torch.tensor(weights)).sum().backward()
    return {i: leaves[i].grad.numpy() for i in wrt}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "s"),
    [
        case
        for case in op_cases(only_grad=True, finite_differences=True)
        if _differentiable(*case.values)
    ],
)
def test_gradients_through_a_vmap_of_every_op_sample(name: str, s: Sample) -> None:
    """∂ Σ W · vmap(op)(X…) / ∂X, all arguments mapped (dim 0): against central finite
    differences in float64, and against PyTorch's autograd."""
    diff = _differentiable(name, s)
    nodes, arrays, mapped, batches = _mapped_sample(name, s, 0, only_first=False)
    _, forward = run(nodes, ["R"], arrays)
    weights = np.random.default_rng(len(name)).standard_normal(forward.outputs["R"].shape)
    arrays["W"] = weights
    graph = [*nodes, NodeSpec("T", expr="sum(R * W)")]
    wrt = [f"a{i}" for i in diff]
    _, result = run(graph, ["T"], arrays, requires=wrt, backward=True)

    def total(values: dict[str, np.ndarray]) -> float:
        _, r = run(graph, ["T"], values, no_grad=True)
        return float(r.outputs["T"])

    reference = _torch_reference(name, s, dict(zip(mapped, batches, strict=True)), weights, diff)
    for i, name_i in zip(diff, wrt, strict=True):
        got = result.gradients[name_i]
        fd = np.zeros_like(arrays[name_i])
        for idx in np.ndindex(fd.shape):
            eps = 1e-6 * max(1.0, abs(arrays[name_i][idx]))  # (relative: samples reach 1e4)
            plus, minus = dict(arrays), dict(arrays)
            plus[name_i] = arrays[name_i].copy()
            minus[name_i] = arrays[name_i].copy()
            plus[name_i][idx] += eps
            minus[name_i][idx] -= eps
            fd[idx] = (total(plus) - total(minus)) / (2 * eps)
        np.testing.assert_allclose(got, fd, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got, reference[i], rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ per-sample gradients


def mlp_case(dtype: str = "float64", batch: int = 8) -> dict[str, np.ndarray]:
    return {
        "X": RNG.standard_normal((batch, 5)).astype(dtype),
        "Y": RNG.standard_normal((batch, 3)).astype(dtype),
        "w1": (RNG.standard_normal((5, 7)) / 2).astype(dtype),
        "w2": (RNG.standard_normal((7, 3)) / 2).astype(dtype),
    }


MLP_BODY = [
    NodeSpec("l", expr="sum((tanh(x @ w1) @ w2 - y) ** 2)"),
    NodeSpec("g1", op="grad", args=["l", "w1"]),
    NodeSpec("g2", op="grad", args=["l", "w2"]),
]
MLP_RESULTS: dict[str, Any] = {
    "G1": "g1",
    "G2": "g2",
    "L": "l",
    "S1": ReductionSpec("g1", "sum"),
    "M2": ReductionSpec("g2", "mean"),
    "C1": ReductionSpec("g1", "clip_sum", 1.0, ["g1", "g2"]),
    "C2": ReductionSpec("g2", "clip_sum", 1.0, ["g1", "g2"]),
    "C2own": ReductionSpec("g2", "clip_sum", 0.5),
}


def per_sample(chunk_size: int | None = None) -> NodeSpec:
    return vmap(["X", "Y"], ["x", "y"], MLP_BODY, MLP_RESULTS, chunk_size=chunk_size, id="ps")


def torch_per_sample(arrays: Mapping[str, np.ndarray]) -> tuple[Any, Any, Any]:
    def loss(w1: Any, w2: Any, x: Any, y: Any) -> Any:
        return ((torch.tanh(x @ w1) @ w2 - y) ** 2).sum()

    t = {k: torch.tensor(v) for k, v in arrays.items()}
    g1, g2 = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(
        t["w1"], t["w2"], t["X"], t["Y"]
    )
    losses = torch.func.vmap(loss, in_dims=(None, None, 0, 0))(t["w1"], t["w2"], t["X"], t["Y"])
    return g1.numpy(), g2.numpy(), losses.numpy()


def opacus_clip_sum(grads: Sequence[np.ndarray], of: np.ndarray, max_norm: float) -> np.ndarray:
    """Opacus's clipping in NumPy: per-sample norms over the parameters, a factor
    min(1, max_norm / (norm + 1e-6)) per sample, the clipped gradients summed."""
    norms = np.sqrt(sum((g.reshape(len(g), -1) ** 2).sum(axis=1) for g in grads))
    factor = np.minimum(max_norm / (norms + 1e-6), 1.0)
    return np.einsum("i,i...->...", factor, of)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_per_sample_gradients_and_their_reductions(dtype: str) -> None:
    arrays = mlp_case(dtype)
    _, result = run([per_sample()], list(MLP_RESULTS), arrays, requires=["w1", "w2"])
    out = result.outputs
    g1, g2, losses = torch_per_sample(arrays)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == "float64" else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(out["G1"], g1, **tol)
    np.testing.assert_allclose(out["G2"], g2, **tol)
    np.testing.assert_allclose(out["L"], losses, **tol)
    np.testing.assert_allclose(out["S1"], g1.sum(0), **tol)
    np.testing.assert_allclose(out["M2"], g2.mean(0), **tol)
    np.testing.assert_allclose(out["C1"], opacus_clip_sum([g1, g2], g1, 1.0), **tol)
    np.testing.assert_allclose(out["C2"], opacus_clip_sum([g1, g2], g2, 1.0), **tol)
    np.testing.assert_allclose(out["C2own"], opacus_clip_sum([g2], g2, 0.5), **tol)
    assert all(out[k].dtype == np.dtype(dtype) for k in out)
    # some samples are clipped and some not: the factor is tested on both sides of 1
    norms = np.sqrt((g1.reshape(8, -1) ** 2).sum(1) + (g2.reshape(8, -1) ** 2).sum(1))
    assert (norms > 1.0).any() and out["C1"].shape == g1.shape[1:]


def test_a_sum_adds_in_index_order() -> None:
    """The sum of a vmap is Σ in index order, exactly: ((v0 + v1) + v2) + …"""
    arrays = {"X": RNG.standard_normal((40, 3)) * 10.0 ** RNG.integers(-8, 8, (40, 1))}
    node = vmap(["X"], ["x"], [NodeSpec("s", expr="x * 1.0")], {"S": ReductionSpec("s", "sum")})
    _, result = run([node], ["S"], arrays, no_grad=True)
    total = np.zeros(3)
    for row in arrays["X"]:
        total = total + row
    np.testing.assert_array_equal(result.outputs["S"], total)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 8, 100])
def test_chunked_runs_are_bit_identical_to_the_whole_batch(chunk_size: int, backward: bool) -> None:
    arrays = mlp_case(batch=8)
    outputs = ["T"] if backward else list(MLP_RESULTS)
    tail = [NodeSpec("T", expr="sum(C1) + sum(M2 * M2) + sum(L) + sum(G1 * G1)")]
    kw: dict[str, Any] = {"requires": ["w1", "w2", "X"], "backward": backward}
    whole_program, whole = run([per_sample(), *tail], outputs, arrays, **kw)
    program, chunked = run([per_sample(chunk_size), *tail], outputs, arrays, **kw)
    assert whole_program.vmap_chunks == {"ps": 8}
    assert program.vmap_chunks == {"ps": min(chunk_size, 8)}
    for name in outputs:
        np.testing.assert_array_equal(chunked.outputs[name], whole.outputs[name])
    if backward:
        # A mapped input's gradient is its indices' own: the same bits. An unmapped one's
        # adds every index's share, per chunk and across them (BLAS sums a chunk in an
        # order of its own): the same to rounding.
        np.testing.assert_array_equal(chunked.gradients["X"], whole.gradients["X"])
        for name in ("w1", "w2"):
            np.testing.assert_allclose(
                chunked.gradients[name], whole.gradients[name], rtol=1e-13, atol=1e-13
            )


def test_a_vmap_that_only_reduces_never_holds_the_stack() -> None:
    """By default, a vmap whose results are all reductions stacks at most 1 MiB of what it
    reduces per chunk (one index at least), with the whole batch's bits."""
    arrays = mlp_case(batch=64)
    arrays["X"] = RNG.standard_normal((64, 2000))
    arrays["w1"] = RNG.standard_normal((2000, 7)) / 40
    reduced = {k: MLP_RESULTS[k] for k in ("S1", "C1", "C2")}
    per_index = (2000 * 7 + 7 * 3) * 8  # g1 and g2, float64: 112 KB
    node = vmap(["X", "Y"], ["x", "y"], MLP_BODY, reduced, id="ps")
    program, chunked = run([node], list(reduced), arrays, no_grad=True)
    assert program.vmap_chunks == {"ps": (1 << 20) // per_index}  # 9 of 64
    whole = vmap(["X", "Y"], ["x", "y"], MLP_BODY, reduced, chunk_size=64, id="ps")
    whole_program, result = run([whole], list(reduced), arrays, no_grad=True)
    assert whole_program.planned_peak_bytes > 2 * 64 * per_index > 2 * program.planned_peak_bytes
    for name in reduced:
        np.testing.assert_array_equal(chunked.outputs[name], result.outputs[name])
    # With one stacked result, the whole batch (it is held anyway).
    node = vmap(["X", "Y"], ["x", "y"], MLP_BODY, {**reduced, "L": "l"}, id="ps")
    program, _ = run([node], [*reduced, "L"], arrays, no_grad=True)
    assert program.vmap_chunks == {"ps": 64}


def test_a_reduction_keeps_the_program_off_xla() -> None:
    """XLA's sums keep no order: a program whose vmap reduces stays interpreted (a plain
    vmap does not, and neither is refused for it)."""
    arrays = mlp_case()
    reduced, _ = run([per_sample()], ["S1"], arrays, no_grad=True)
    assert reduced.index_ordered
    with pytest.raises(NotLowerable, match="add index after index"):
        lower(reduced)
    node = vmap(["X", "Y"], ["x", "y"], MLP_BODY, {"G1": "g1"})
    stacked, _ = run([node], ["G1"], arrays, no_grad=True)
    assert not stacked.index_ordered


def test_a_budget_chunks_a_vmap_to_the_largest_chunk_that_fits() -> None:
    """A whole-batch plan 10x the budget runs chunked, within it, with the same bits; a
    budget too small for one index is refused before anything runs."""
    arrays = mlp_case(batch=128)
    arrays["X"] = RNG.standard_normal((128, 300))
    arrays["w1"] = RNG.standard_normal((300, 7)) / 20
    outputs = ["S1", "C1", "M2"]
    whole_program, whole = run([per_sample()], outputs, arrays, no_grad=True)
    budget = whole_program.planned_peak_bytes // 10
    program, chunked = run(
        [per_sample()], outputs, arrays, no_grad=True, limits=Limits(memory_budget_bytes=budget)
    )
    chunk = program.vmap_chunks["ps"]
    assert 1 < chunk < 128 and program.planned_peak_bytes <= budget
    for name in outputs:
        np.testing.assert_array_equal(chunked.outputs[name], whole.outputs[name])
    with pytest.raises(MemoryBudgetError):  # one more index does not fit
        run(
            [per_sample(chunk + 1)],
            outputs,
            arrays,
            no_grad=True,
            limits=Limits(memory_budget_bytes=budget),
        )
    with pytest.raises(MemoryBudgetError, match="one index at a time"):
        run([per_sample()], outputs, arrays, no_grad=True, limits=Limits(memory_budget_bytes=4096))


def test_gradients_of_vmap_results_against_torch_func_and_finite_differences() -> None:
    """/backward through the per-sample gradients and their clipped sum (a DP-SGD step's
    gradient, differentiated again)."""
    arrays = mlp_case(batch=4)
    graph = [per_sample(), NodeSpec("T", expr="sum(C1 * C1) + sum(L) + sum(G2 * w2)")]
    _, result = run(graph, ["T"], arrays, requires=["w1", "w2", "X"], backward=True)

    def objective(w1: Any, w2: Any, X: Any) -> Any:
        def loss(w1: Any, w2: Any, x: Any, y: Any) -> Any:
            return ((torch.tanh(x @ w1) @ w2 - y) ** 2).sum()

        y = torch.tensor(arrays["Y"])
        g1, g2 = torch.func.vmap(torch.func.grad(loss, (0, 1)), (None, None, 0, 0))(w1, w2, X, y)
        losses = torch.func.vmap(loss, (None, None, 0, 0))(w1, w2, X, y)
        norms = torch.sqrt((g1**2).sum((1, 2)) + (g2**2).sum((1, 2)))
        c1 = (g1 * (1.0 / (norms + 1e-6)).clamp(max=1.0)[:, None, None]).sum(0)
        return (c1 * c1).sum() + losses.sum() + (g2 * w2).sum()

    leaves = [torch.tensor(arrays[k], requires_grad=True) for k in ("w1", "w2", "X")]
    objective(*leaves).backward()
    for name, leaf in zip(("w1", "w2", "X"), leaves, strict=True):
        np.testing.assert_allclose(result.gradients[name], leaf.grad.numpy(), rtol=1e-9)

    def total(values: dict[str, np.ndarray]) -> float:
        _, r = run(graph, ["T"], values, no_grad=True)
        return float(r.outputs["T"])

    for name in ("w2", "X"):
        fd = np.zeros_like(arrays[name])
        for idx in np.ndindex(fd.shape):
            plus, minus = dict(arrays), dict(arrays)
            plus[name], minus[name] = arrays[name].copy(), arrays[name].copy()
            plus[name][idx] += 1e-6
            minus[name][idx] -= 1e-6
            fd[idx] = (total(plus) - total(minus)) / 2e-6
        np.testing.assert_allclose(result.gradients[name], fd, rtol=1e-5, atol=1e-7)


def test_nested_vmaps_a_scan_and_a_jvp_in_a_body() -> None:
    """A vmap of a vmap (pairwise values), a scan in a body (a recurrence per sequence),
    a jvp in a body: each against its loop."""
    A, Bm = RNG.standard_normal((4, 3)), RNG.standard_normal((5, 3))
    inner = vmap(["B"], ["b"], [NodeSpec("d", expr="sum((a - b) ** 2)")], {"D": "d"}, id="in")
    outer = vmap(["A"], ["a"], [inner], {"P": "D"}, id="out")
    _, result = run([outer], ["P"], {"A": A, "B": Bm})
    np.testing.assert_allclose(result.outputs["P"], ((A[:, None] - Bm[None]) ** 2).sum(-1))

    xs, w = RNG.standard_normal((3, 6, 2)), RNG.standard_normal((2, 2)) / 2
    rnn = NodeSpec(
        "rnn",
        op="scan",
        args=["h0", "x"],
        body=BodySpec(
            carry=["h"],
            xs=["xt"],
            nodes=[NodeSpec("h2", expr="tanh(h @ w + xt)")],
            next={"h": "h2"},
        ),
        results={"H": "h"},
    )
    node = vmap(
        ["XS"], ["x"], [NodeSpec("h0", expr="zeros(shape=[2], dtype='float64')"), rnn], {"F": "H"}
    )
    _, result = run([node], ["F"], {"XS": xs, "w": w})
    for k in range(3):
        h = np.zeros(2)
        for t in range(6):
            h = np.tanh(h @ w + xs[k, t])
        np.testing.assert_allclose(result.outputs["F"][k], h, rtol=1e-12)

    X, T = RNG.standard_normal((4, 3)), RNG.standard_normal((4, 3))
    node = vmap(
        ["X", "T"],
        ["x", "t"],
        [NodeSpec("y", expr="sin(x) * x"), NodeSpec("j", op="jvp", args=["y", "x", "t"])],
        {"J": "j"},
    )
    _, result = run([node], ["J"], {"X": X, "T": T})
    np.testing.assert_allclose(result.outputs["J"], (np.cos(X) * X + np.sin(X)) * T, rtol=1e-12)


def test_in_axes_and_unmapped_results() -> None:
    """Negative in_axes; a result that does not depend on the mapped values is the same
    for every index; a result may name a body input (the slices, stacked)."""
    X = RNG.standard_normal((2, 3, 4))
    node = vmap(
        ["X", "X"],
        ["a", "b"],
        [NodeSpec("s", expr="sum(a) * b"), NodeSpec("c", expr="w * 2")],
        {"S": "s", "C": "c", "A": "a"},
        in_axes=[-1, 2],
    )
    _, result = run([node], ["S", "C", "A"], {"X": X, "w": np.arange(3.0)})
    Xm = np.moveaxis(X, -1, 0)
    np.testing.assert_allclose(result.outputs["S"], Xm.sum((1, 2))[:, None, None] * Xm)
    np.testing.assert_array_equal(result.outputs["C"], np.stack([np.arange(3.0) * 2] * 4))
    np.testing.assert_array_equal(result.outputs["A"], Xm)
    same = vmap(["X", "X"], ["a", "b"], [NodeSpec("s", expr="sum(a) * b")], {"S": "s"})
    same.attrs["in_axes"] = -1  # (one int: every argument's)
    _, again = run([same], ["S"], {"X": X})
    np.testing.assert_array_equal(again.outputs["S"], result.outputs["S"])


# ------------------------------------------------------------------ jacobian and hessian


def mlp_100(x: Any, w1: Any, w2: Any, lib: Any) -> Any:
    return lib.tanh(lib.tanh(x @ w1) @ w2)


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_jacobian_against_torch_autograd_functional(mode: str) -> None:
    x = RNG.standard_normal(6)
    w1, w2 = RNG.standard_normal((6, 5)) / 2, RNG.standard_normal((5, 4)) / 2
    graph = [
        NodeSpec("y", expr="tanh(tanh(x @ w1) @ w2)"),
        NodeSpec("J", op="jacobian", args=["y", "x"], attrs={"mode": mode}),
        NodeSpec("K", expr=f"jacobian(y, w1, mode='{mode}')"),
    ]
    _, result = run(graph, ["J", "K"], {"x": x, "w1": w1, "w2": w2})
    t = [torch.tensor(a) for a in (x, w1, w2)]
    want_x = taf.jacobian(lambda x: mlp_100(x, t[1], t[2], torch), t[0])
    want_w = taf.jacobian(lambda w: mlp_100(t[0], w, t[2], torch), t[1])
    assert result.outputs["J"].shape == (4, 6) and result.outputs["K"].shape == (4, 6, 5)
    np.testing.assert_allclose(result.outputs["J"], want_x.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(result.outputs["K"], want_w.numpy(), rtol=1e-12, atol=1e-14)


def test_jacobian_of_shaped_values_and_its_gradient() -> None:
    """output.shape + input.shape for matrices; differentiable: ∂ Σ J² / ∂x against
    torch.func (a jacobian inside a gradient) and finite differences."""
    x = RNG.standard_normal((2, 3))
    graph = [
        NodeSpec("y", expr="sin(x) @ transpose(x, dim0=0, dim1=1)"),
        NodeSpec("J", expr="jacobian(y, x, mode='rev')"),
        NodeSpec("F", expr="jacobian(y, x, mode='fwd')"),
        NodeSpec("T", expr="sum(J * J)"),
    ]
    _, result = run(graph, ["J", "F"], {"x": x})
    want = taf.jacobian(lambda x: torch.sin(x) @ x.T, torch.tensor(x)).numpy()
    assert result.outputs["J"].shape == (2, 2, 2, 3)
    np.testing.assert_allclose(result.outputs["J"], want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(result.outputs["F"], want, rtol=1e-12, atol=1e-14)

    _, result = run(graph, ["T"], {"x": x}, requires=["x"], backward=True)
    leaf = torch.tensor(x, requires_grad=True)
    (torch.func.jacrev(lambda x: torch.sin(x) @ x.T)(leaf) ** 2).sum().backward()
    np.testing.assert_allclose(result.gradients["x"], leaf.grad.numpy(), rtol=1e-10)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_a_budget_chunks_a_jacobian(mode: str) -> None:
    """A Jacobian is a vmap over a basis: over the budget, its rows (or columns) are
    computed in the largest chunks that fit."""
    x, w = RNG.standard_normal(60), RNG.standard_normal((60, 60)) / 8
    graph = [
        NodeSpec("y", expr="tanh(w @ tanh(w @ x))"),
        NodeSpec("J", op="jacobian", args=["y", "x"], attrs={"mode": mode}),
        NodeSpec("T", expr="sum(J * J)"),
    ]
    whole, a = run(graph, ["T"], {"x": x, "w": w}, no_grad=True)
    assert whole.vmap_chunks == {"J": 60}
    budget = whole.planned_peak_bytes * 9 // 10
    chunked, b = run(
        graph, ["T"], {"x": x, "w": w}, no_grad=True, limits=Limits(memory_budget_bytes=budget)
    )
    assert 1 < chunked.vmap_chunks["J"] < 60 and chunked.planned_peak_bytes <= budget
    np.testing.assert_allclose(b.outputs["T"], a.outputs["T"], rtol=1e-12)
    jac = taf.jacobian(
        lambda x: torch.tanh(torch.tensor(w) @ torch.tanh(torch.tensor(w) @ x)), torch.tensor(x)
    )
    np.testing.assert_allclose(b.outputs["T"], (jac**2).sum().item(), rtol=1e-12)


def lse(x: Any) -> Any:
    return torch.logsumexp(x, 0)


def test_hessian_of_gradbench_lse_against_torch() -> None:
    x = RNG.standard_normal(100)
    graph = [NodeSpec("l", expr="logsumexp(x, dim=0)"), NodeSpec("H", expr="hessian(l, x)")]
    _, result = run(graph, ["H"], {"x": x})
    want = taf.hessian(lse, torch.tensor(x)).numpy()
    np.testing.assert_allclose(result.outputs["H"], want, rtol=1e-10, atol=1e-14)
    assert result.outputs["H"].shape == (100, 100)


def test_hessian_of_a_matrix_input_and_its_gradient() -> None:
    w = RNG.standard_normal((2, 3))
    graph = [
        NodeSpec("l", expr="sum(tanh(w) ** 3)"),
        NodeSpec("H", op="hessian", args=["l", "w"]),
        NodeSpec("T", expr="sum(H * H)"),
    ]
    _, result = run(graph, ["H"], {"w": w})
    want = taf.hessian(lambda w: (torch.tanh(w) ** 3).sum(), torch.tensor(w)).numpy()
    assert result.outputs["H"].shape == (2, 3, 2, 3)
    np.testing.assert_allclose(result.outputs["H"], want, rtol=1e-12, atol=1e-14)
    _, result = run(graph, ["T"], {"w": w}, requires=["w"], backward=True)
    leaf = torch.tensor(w, requires_grad=True)
    (torch.func.hessian(lambda w: (torch.tanh(w) ** 3).sum())(leaf) ** 2).sum().backward()
    np.testing.assert_allclose(result.gradients["w"], leaf.grad.numpy(), rtol=1e-10)


def test_jacobian_of_an_independent_value_is_zeros() -> None:
    _, result = run(
        [NodeSpec("y", expr="w * 2"), NodeSpec("J", expr="jacobian(y, x)")],
        ["J"],
        {"x": np.ones(3), "w": np.ones(2)},
    )
    np.testing.assert_array_equal(result.outputs["J"], np.zeros((2, 3)))


# ------------------------------------------------------------------ bad nodes


def _one_error(nodes: Sequence[NodeSpec], arrays: Mapping[str, np.ndarray]) -> Any:
    (err,) = errors_of(nodes, arrays)
    return err


def test_bad_vmaps_name_the_node_and_the_field() -> None:
    X, Y = np.ones((4, 3)), np.ones((5, 3))
    err = _one_error(
        [vmap(["X", "Y"], ["x", "y"], [NodeSpec("s", expr="x + y")], {"R": "s"})], {"X": X, "Y": Y}
    )
    assert type(err).__name__ == "ShapeError" and err.node == "v"
    assert "every mapped size must agree" in str(err) and err.loc[-2:] == ("args", 1)

    err = _one_error(
        [vmap(["X"], ["x"], [NodeSpec("s", expr="x")], {"R": "s"}, in_axes=[2])], {"X": X}
    )
    assert err.loc[-3:] == ("attrs", "in_axes", 0) and "has 2 dims" in str(err)

    err = _one_error(
        [vmap(["X"], ["x"], [NodeSpec("s", expr="x @ nowhere")], {"R": "s"})], {"X": X}
    )
    assert "in the body of vmap 'v'" in str(err) and err.node == "s"
    assert err.loc == ("graph", "nodes", 0, "body", "nodes", 0, "args", 1)

    err = _one_error([vmap(["X"], ["x"], [NodeSpec("s", expr="x")], {"R": "t"})], {"X": X})
    assert "not a node or an input of the body" in str(err) and err.loc[-2:] == ("results", "R")

    bad = ReductionSpec("s", "clip_sum", -1.0)
    err = _one_error([vmap(["X"], ["x"], [NodeSpec("s", expr="x")], {"R": bad})], {"X": X})
    assert "max_norm" in str(err) and err.loc[-1] == "max_norm"

    err = _one_error([vmap(["X", "X"], ["x"], [NodeSpec("s", expr="x")], {"R": "s"})], {"X": X})
    assert type(err).__name__ == "ArityError" and "body.in" in str(err)

    err = _one_error(
        [vmap(["X"], ["x"], [NodeSpec("s", expr="x")], {"R": "s"}, chunk_size=0)], {"X": X}
    )
    assert err.loc[-2:] == ("attrs", "chunk_size")

    err = _one_error(
        [vmap(["X"], ["x"], [NodeSpec("s", expr="x > 0")], {"R": ReductionSpec("s", "sum")})],
        {"X": X},
    )
    assert "floating-point" in str(err)


def test_a_vmap_is_not_a_value_and_not_an_expr() -> None:
    X = np.ones((4, 3))
    node = vmap(["X"], ["x"], [NodeSpec("s", expr="x")], {"R": "s"})
    errors = errors_of([node, NodeSpec("u", expr="v * 2")], {"X": X})
    assert "'v' is a vmap node, not a value: use its results ('R')" in str(errors[0])
    (err,) = errors_of([NodeSpec("u", expr="vmap(X)")], {"X": X})
    assert "vmap takes a body and results" in str(err)


def test_a_hessian_needs_a_one_element_output() -> None:
    (err,) = errors_of([NodeSpec("H", expr="hessian(x * 2, x)")], {"x": np.ones(3)})
    assert "one-element output" in str(err) and err.node == "H"


def test_dp_sgd_steps_as_a_scan_of_clipped_per_sample_gradients() -> None:
    """A vmap inside a scan body (4 steps of DP-SGD's descent), and /backward through the
    whole loop: against torch.func, step for step."""
    X, w0 = RNG.standard_normal((5, 3)), RNG.standard_normal(3)
    per_sample = NodeSpec(
        "ps",
        op="vmap",
        args=["X"],
        body=MapBodySpec(
            in_=["x"],
            nodes=[NodeSpec("l", expr="sum(tanh(x * w) ** 2)"), NodeSpec("g", expr="grad(l, w)")],
        ),
        results={"C": ReductionSpec("g", "clip_sum", 0.5)},
    )
    descent = NodeSpec(
        "sgd",
        op="scan",
        args=["w0"],
        body=BodySpec(
            carry=["w"],
            xs=[],
            nodes=[per_sample, NodeSpec("w2", expr="w - 0.1 * C")],
            next={"w": "w2"},
        ),
        results={"W": "w"},
        attrs={"length": 4},
    )
    graph = [descent, NodeSpec("T", expr="sum(W * W)")]
    _, result = run(graph, ["T"], {"X": X, "w0": w0}, requires=["X", "w0"], backward=True)

    def loss(w: Any, x: Any) -> Any:
        return (torch.tanh(x * w) ** 2).sum()

    leaves = [torch.tensor(a, requires_grad=True) for a in (X, w0)]
    w = leaves[1]
    for _ in range(4):
        g = torch.func.vmap(torch.func.grad(loss), (None, 0))(w, leaves[0])
        factor = (0.5 / (torch.sqrt((g**2).sum(1)) + 1e-6)).clamp(max=1.0)
        w = w - 0.1 * (g * factor[:, None]).sum(0)
    (w * w).sum().backward()
    np.testing.assert_allclose(result.outputs["T"], (w * w).sum().item(), rtol=1e-12)
    for name, leaf in zip(("X", "w0"), leaves, strict=True):
        np.testing.assert_allclose(
            result.gradients[name], leaf.grad.numpy(), rtol=1e-10, atol=1e-14
        )
