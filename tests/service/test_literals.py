"""Constant lifting read off a graph's bytes (service/literals.py): a graph whose text was
seen, with its literals' places found, takes its shape's program straight from its
numbers, unvalidated, and answers bit for bit as its own compile; any other difference
(an integer, an id, an attribute, a literal an op computes with, a literal written as an
integer or out of range, other input specs, bad data) goes the whole way and answers as a
fresh server does."""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import pytest

from gradserve.service.compute import Compute, Stats
from gradserve.service.literals import split_numbers
from gradserve.service.placement import NEW_MAX_NODES
from gradserve.service.settings import Settings
from gradserve.wire.graph_id import graph_key
from tests.support.in_process import serving

RNG = np.random.default_rng(11)
STEPS = 3


def _cell(
    one: str = "1.25", rate: str = "0.5", power: str = "2", name: str = "loss", steps: int = STEPS
) -> dict:
    """A recurrent cell as define-by-run records it, its literals written as given: `one`
    in every step's expr and as a JSON number, `rate` in the loss, `power` an exponent
    (`steps` past STEPS read the inputs x0... again, in turn)."""
    nodes: list[dict[str, Any]] = []
    h = "h0"
    for t in range(steps):
        nodes += [
            {"id": f"a{t}", "expr": f"x{t % STEPS} @ w + {h} @ u + b"},
            {"id": f"p{t}", "op": "add", "args": [f"a{t}", json.loads(one)]},
            {
                "id": f"h{t + 1}",
                "expr": f"sigmoid(p{t}) * {h} + sigmoid(a{t} + {one}) * tanh(a{t})",
            },
        ]
        h = f"h{t + 1}"
    nodes.append({"id": name, "expr": f"sum({h} ** {power}) * {rate}"})
    return {"nodes": nodes, "outputs": [name]}


DATA = {f"x{t}": RNG.standard_normal((2, 3)) for t in range(STEPS)} | {
    "w": RNG.standard_normal((3, 3)) * 0.5,
    "u": RNG.standard_normal((3, 3)) * 0.5,
    "b": RNG.standard_normal(3) * 0.1,
    "h0": RNG.standard_normal((2, 3)),
}


def _body(graph: dict, dtype: str = "float64", **extra: Any) -> bytes:
    inputs = {
        k: {"data": v.tolist(), "dtype": dtype, "requires_grad": True} for k, v in DATA.items()
    }
    return json.dumps({"graph": graph, "inputs": inputs, **extra}).encode()


def _run(compute: Compute, body: bytes) -> tuple[dict[str, Any], Stats]:
    stats = Stats()
    reply = compute.serve("backward", body, None, None, 1e12, lambda _: None, stats)
    return json.loads(b"".join(bytes(p) for p in reply.parts)), stats


def _own(body: bytes) -> dict[str, Any]:
    """The answer of a process that never saw another graph."""
    return _run(Compute(Settings(program_store_bytes=0)), body)[0]


def _taught(*ones: str) -> Compute:
    """A process that has compiled the cell with `ones` (the second found the places)."""
    compute = Compute(Settings(program_store_bytes=0))
    for one in ones:
        _run(compute, _body(_cell(one)))
    return compute


def _read_off_its_bytes(compute: Compute, answer: dict[str, Any]) -> bool:
    """Whether the answer's graph was lifted from its numbers: held unvalidated."""
    return isinstance(compute.programs.graphs.get(answer["meta"]["graph_id"]), bytes)


def _same(answer: dict[str, Any], own: dict[str, Any]) -> None:
    assert answer["outputs"] == own["outputs"]
    assert answer["gradients"] == own["gradients"]
    assert answer["meta"]["graph_id"] == own["meta"]["graph_id"]


# ---------------------------------------------------------------- the split


def test_the_numbers_are_the_json_numbers_and_those_written_in_exprs() -> None:
    graph = (
        b'{"nodes":[{"id":"a-1","expr":"x1 * 1.5 + y ** 2 - 3e-2 * x + .5 + 1_0 + 0x1f",'
        b'"attrs":{"eps":1e-5,"dim":-1}},{"id":"b2","op":"add","args":["a-1",-2.5]},'
        b'{"id":"say \\"expr\\": \\"9\\"","expr":"b2 * 4."}],"outputs":["b2"]}'
    )
    found = split_numbers(graph)
    # (not x1's 1, a1's 1, b2's 2, 1_0 or 0x1f; not the 9 in a string that is no expr)
    assert found.numbers == [b"1.5", b"2", b"3e-2", b".5", b"1e-5", b"-1", b"-2.5", b"4."]


def test_graphs_that_differ_only_in_numbers_have_one_text() -> None:
    base = split_numbers(json.dumps(_cell("1.25", "0.5")).encode())
    other = split_numbers(json.dumps(_cell("2.5e-3", "7")).encode())
    assert base.text_key == other.text_key and base.numbers != other.numbers
    for different in (_cell(name="loss2"), {**_cell(), "outputs": ["h3"]}):
        assert split_numbers(json.dumps(different).encode()).text_key != base.text_key
    assert split_numbers(b'{"nodes":[],"outputs":[]}').numbers == []


# ---------------------------------------------------------------- the program


def test_a_new_literal_is_read_off_the_bytes_and_answers_as_its_own_compile() -> None:
    compute = _taught("1.25", "1.5")
    for one in ("1.75", "3e-3", "2.5", "1.25e2"):
        body = _body(_cell(one))
        answer, stats = _run(compute, body)
        assert stats.program == "lifted" and answer["meta"]["program"] == "lifted"
        assert _read_off_its_bytes(compute, answer)
        _same(answer, _own(body))
    # The graph so held is validated when a program of it is first compiled (here by id,
    # with other specs).
    by_id = json.loads(_body(_cell("1.75"), dtype="float32"))
    graph_id = graph_key(by_id.pop("graph"))
    answer, stats = _run(compute, json.dumps({**by_id, "graph_id": graph_id}).encode())
    assert stats.program == "compiled"
    assert not isinstance(compute.programs.graphs.get(graph_id), bytes)
    _same(answer, _own(_body(_cell("1.75"), dtype="float32")))


def test_a_lifted_answer_has_the_gradients_of_finite_differences_and_torch() -> None:
    torch = pytest.importorskip("torch")
    compute = _taught("1.25", "1.5")
    answer, _ = _run(compute, _body(_cell("0.375", "0.25")))
    assert _read_off_its_bytes(compute, answer)

    def loss(**x: Any) -> Any:
        sigmoid, tanh = (
            (torch.sigmoid, torch.tanh)
            if isinstance(x["w"], torch.Tensor)
            else (lambda v: 1 / (1 + np.exp(-v)), np.tanh)
        )
        h = x["h0"]
        for t in range(STEPS):
            a = x[f"x{t}"] @ x["w"] + h @ x["u"] + x["b"]
            h = sigmoid(a + 0.375) * h + sigmoid(a + 0.375) * tanh(a)
        return (h**2).sum() * 0.25

    assert answer["outputs"]["loss"]["data"] == pytest.approx(float(loss(**DATA)), rel=1e-12)
    for k, x in DATA.items():  # central differences, float64, along a random direction
        u = RNG.standard_normal(x.shape)
        up, down = loss(**DATA | {k: x + 1e-6 * u}), loss(**DATA | {k: x - 1e-6 * u})
        np.testing.assert_allclose(
            (up - down) / 2e-6,
            np.sum(np.array(answer["gradients"][k]["data"]) * u),
            rtol=1e-5,
            atol=1e-8,
            err_msg=k,
        )
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in DATA.items()}
    loss(**tensors).backward()
    for k, t in tensors.items():
        np.testing.assert_allclose(answer["gradients"][k]["data"], t.grad.numpy(), rtol=1e-12)


@pytest.mark.parametrize(
    "graph",
    [
        pytest.param(_cell("1.75", power="3"), id="an integer literal"),
        pytest.param(_cell("1.75", power="2.0"), id="a literal an op computes with"),
        pytest.param(_cell("2"), id="the literal written as an integer"),
        pytest.param(_cell("1e999"), id="the literal out of range"),
        pytest.param(_cell("-0.125"), id="a minus sign in an expr"),
    ],
)
def test_a_graph_of_the_text_that_differs_elsewhere_goes_the_whole_way(graph: dict) -> None:
    compute = _taught("1.25", "1.5")
    body = _body(graph)
    try:
        own = _own(body)
    except Exception as err:  # (1e999: not valid JSON for a float: refused as it would be)
        with pytest.raises(type(err)):
            _run(compute, body)
        return
    answer, _ = _run(compute, body)
    assert not _read_off_its_bytes(compute, answer)
    _same(answer, own)


def test_other_input_specs_find_their_own_places() -> None:
    compute = _taught("1.25", "1.5")
    answer, stats = _run(compute, _body(_cell("1.75"), dtype="float32"))
    assert stats.program == "compiled" and not _read_off_its_bytes(compute, answer)
    _same(answer, _own(_body(_cell("1.75"), dtype="float32")))


def test_an_attribute_equal_to_a_literal_is_not_taken_for_it() -> None:
    """`dim`-like attributes are the graph's shape: a float attribute whose value is also
    a literal's makes its places unknowable from the bytes; the graph is compiled."""

    def graph(one: str, alpha: str) -> dict:
        return {
            "nodes": [
                {"id": "a", "expr": f"x0 * {one}"},
                {"id": "l", "op": "clamp", "args": ["a"], "attrs": {"min": json.loads(alpha)}},
                {"id": "loss", "op": "sum", "args": ["l"]},
            ],
            "outputs": ["loss"],
        }

    compute = Compute(Settings(program_store_bytes=0))
    for one in ("0.25", "0.5"):
        _run(compute, _body(graph(one, "0.25")))
    for one, alpha in (("0.75", "0.25"), ("0.25", "0.75")):
        body = _body(graph(one, alpha))
        answer, _ = _run(compute, body)
        _same(answer, _own(body))


# ---------------------------------------------------------------- errors, as a fresh server


@pytest.mark.anyio
async def test_bad_input_with_a_known_text_is_refused_as_a_fresh_server_refuses_it() -> None:
    bad = [
        {"inputs": {"w": {"data": [[1.0, 2.0]], "dtype": "float64", "requires_grad": "yes"}}},
        {"inputs": {"w": {"data": [[1.0, "a"]], "dtype": "float64"}}},
        {"graph_id": "0" * 32},
        {"inputs": {"w": {"tensor_id": "0" * 32}}},  # held by nobody: 409
        {"no_grad": 3},
    ]
    answers: list[list[tuple[int, Any]]] = []
    for teach in (True, False):
        async with serving() as (c, _):
            if teach:
                for one in ("1.25", "1.5", "1.75"):
                    r = await c.post("/backward", content=_body(_cell(one)))
                    assert r.status_code == 200
                assert r.json()["meta"]["program"] == "lifted"
            got = []
            for change in bad:
                body = json.loads(_body(_cell("0.875")))
                for k, v in change.items():
                    body[k] = {**body[k], **v} if isinstance(v, dict) and k in body else v
                r = await c.post("/backward", json=body)
                problem = r.json()
                got.append(
                    (r.status_code, {k: problem.get(k) for k in ("type", "detail", "errors")})
                )
            answers.append(got)
    assert answers[0] == answers[1]
    assert all(status in (409, 422) for status, _ in answers[0])


@pytest.mark.anyio
async def test_over_http_a_new_literal_is_read_off_the_bytes() -> None:
    bodies = [_body(_cell(one)) for one in ("1.25", "1.5", "1.75", "2.25")]
    async with serving() as (c, _):
        answers = [(await c.post("/backward", content=body)).json() for body in bodies]
        metrics = (await c.get("/metrics")).text
    assert [a["meta"]["program"] for a in answers] == ["compiled", "lifted", "lifted", "lifted"]
    assert 'gradserve_compiles_total{role="front"} 1.0' in metrics
    assert 'gradserve_program_lookups_total{role="front",source="lifted"} 3.0' in metrics
    for answer, body in zip(answers[2:], bodies[2:], strict=True):
        _same(answer, _own(body))


@pytest.mark.anyio
async def test_over_http_a_new_literal_of_a_large_graph_is_lifted_in_the_front() -> None:
    """A graph past the fast lane's new graphs (64 nodes) goes to a worker, until one of its
    text is lifted there: the idle front then compiles that text (twice: the second finds
    where its literals are), and lifts every new literal after, in the fast lane."""
    cell = functools.partial(_cell, steps=30)  # 91 nodes
    assert len(cell()["nodes"]) > NEW_MAX_NODES
    bodies = [_body(cell(f"1.{k}5")) for k in range(1, 8)]
    async with serving(compute_workers=1) as (c, _):
        answers = [(await c.post("/backward", content=body)).json() for body in bodies]
        metrics = (await c.get("/metrics")).text
    programs = [a["meta"]["program"] for a in answers]
    assert programs == ["compiled", "lifted", "compiled", "lifted", "lifted", "lifted", "lifted"]
    # (a compile that finds its shape's template is a lifted lookup, not a compile)
    for role, compiled, lifted in (("worker", 1, 1), ("front", 1, 4)):
        assert f'gradserve_compiles_total{{role="{role}"}} {compiled}.0' in metrics
        assert (
            f'gradserve_program_lookups_total{{role="{role}",source="lifted"}} {lifted}.0'
            in metrics
        )
    assert all(a["meta"]["tier_reason"].startswith("fast lane") for a in answers[4:])
    for answer, body in zip(answers, bodies, strict=True):
        _same(answer, _own(body))
