"""Error messages that help: the closest valid name for an unknown op, reference or
attribute, and the piece of an `expr` (with its 1-based column) an error comes from."""

from __future__ import annotations

import pytest

from gradserve.engine.errors import UnknownOpError, ValidationErrors
from gradserve.engine.graph import GraphSpec, NodeSpec, TensorSpec, compile_graph

INPUTS = {
    "x": TensorSpec((3, 4), "float32"),
    "w": TensorSpec((5, 2), "float32"),
    "weights": TensorSpec((4,), "float32"),
}


def message(node: NodeSpec) -> str:
    with pytest.raises(ValidationErrors) as info:
        compile_graph(GraphSpec([node], [node.id]), INPUTS)
    (err,) = info.value.errors
    return str(err)


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        (
            NodeSpec("z", expr="logsumexpp(x)"),
            "unknown op 'logsumexpp' (did you mean 'logsumexp'?)",
        ),
        (NodeSpec("z", op="softmx", args=["x"]), "unknown op 'softmx' (did you mean 'softmax'?)"),
        (
            NodeSpec("z", expr="sum(x, keep_dim=True)"),
            "unknown attribute 'keep_dim' (did you mean 'keepdim'?); sum takes: dim, keepdim",
        ),
        (NodeSpec("z", expr="x * weight"), "unknown reference 'weight' (did you mean 'weights'?)"),
        (
            NodeSpec("z", op="neg", args=["wieghts"]),
            "unknown reference 'wieghts' (did you mean 'weights'?)",
        ),
    ],
)
def test_unknown_names_suggest_the_closest(node: NodeSpec, expected: str) -> None:
    assert expected in message(node)


def test_an_unknown_op_is_the_same_problem_in_op_and_in_expr() -> None:
    for node in (NodeSpec("z", expr="2 * softmx(x)"), NodeSpec("z", op="softmx", args=["x"])):
        with pytest.raises(ValidationErrors) as info:
            compile_graph(GraphSpec([node], ["z"]), INPUTS)
        (err,) = info.value.errors
        assert type(err) is UnknownOpError and err.node == "z", err
        assert err.loc == ("graph", "nodes", 0, "expr" if node.expr else "op"), err.loc


def test_nothing_close_suggests_nothing() -> None:
    text = message(NodeSpec("z", expr="qqqqqq(x)"))
    assert "unknown op 'qqqqqq'" in text and "did you mean" not in text


def test_a_shape_error_names_its_piece_of_the_expression() -> None:
    text = message(NodeSpec("z", expr="relu(x) + x @ w"))
    assert text.endswith("shapes (3, 4) and (5, 2) do not match (in 'x @ w' at column 11)")
    # Columns count in the text as given (leading spaces included), from 1.
    assert "(in 'x @ w' at column 13)" in message(NodeSpec("z", expr="  relu(x) + x @ w"))
    multi = message(NodeSpec("z", expr="(relu(x)\n + x @ w)"))
    assert "(in 'x @ w' at line 2, column 4)" in multi
