"""The engine's typed surface (engine/functions.py, and Tensor's generated methods and
operators in engine/_tensor.py) is what `python -m gradserve.engine.codegen` writes from the op
registry: a changed OpDef without a rerun fails here, as openapi.json's drift test does."""

from __future__ import annotations

import inspect

import gradserve.engine as engine
from gradserve.engine.codegen import FUNCTIONS, TENSOR, render_functions, render_tensor
from gradserve.engine.ops import OPS


def test_the_checked_in_surface_is_the_registrys() -> None:
    assert FUNCTIONS.read_text() == render_functions(), "run `python -m gradserve.engine.codegen`"
    source = TENSOR.read_text()
    assert source == render_tensor(source), "run `python -m gradserve.engine.codegen`"


def test_every_op_is_a_function_and_a_method_with_its_attributes() -> None:
    for name, op in OPS.items():
        params = inspect.signature(getattr(engine, name)).parameters
        assert set(op.attrs) <= set(params), name
        if op.args and not op.variadic:
            assert callable(getattr(engine.Tensor, name)), name
