"""Registry-driven checks of every op: forward against PyTorch, gradients against
central differences (float64) and against torch.autograd, error samples, and the
same forward and gradients again on array-api-strict."""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np
import pytest

import gradserve.engine as engine
from gradserve.engine._tensor import apply
from gradserve.engine.ops import OPS
from tests.support.op_samples import ERRORS, SAMPLES, TORCH, Sample
from tests.support.ops import engine_args, op_cases, run, torch_args

try:
    import torch
except ImportError:  # gradcheck and error samples still run; the comparisons skip
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch (the test extra) is absent")

CATALOG = """add sub mul div pow neg maximum minimum abs sign exp log log1p expm1 sqrt square
reciprocal sin cos tan tanh sigmoid relu softplus clamp eq ne lt le gt ge where sum mean prod
max min logsumexp var softmax log_softmax matmul einsum transpose permute det inv solve cross
reshape expand squeeze unsqueeze flatten cat stack slice index_select gather scatter_add cast
detach zeros ones full eye arange""".split()  # noqa: SIM905 - as docs/contract.md lists it


def assert_close(ours: engine.Tensor, ref: Any) -> None:
    expected = ref.detach().numpy()
    assert ours.shape == tuple(ref.shape), (ours.shape, tuple(ref.shape))
    assert ours.dtype == str(ref.dtype).removeprefix("torch."), (ours.dtype, ref.dtype)
    tol = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-10}.get(ours.dtype, 0)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=tol, atol=tol, equal_nan=True)


def test_catalog_is_complete() -> None:
    missing = [n for n in CATALOG if n not in OPS]
    assert not missing, f"ops missing from the registry: {missing}"
    for name in OPS:
        assert SAMPLES.get(name), f"{name} has no samples"
        assert name in TORCH, f"{name} has no PyTorch reference"
        assert ERRORS.get(name), f"{name} has no error samples"
        assert callable(getattr(engine, name)), f"engine.{name} is missing"


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("name", "sample"), op_cases())
def test_forward_matches_torch(name: str, sample: Sample, dtype: str) -> None:
    ours = run(name, engine_args(name, sample, dtype, False), sample.attrs)
    ref = TORCH[name](torch, *torch_args(name, sample, dtype, False), **sample.attrs)
    assert_close(ours, ref)


@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True, finite_differences=True))
def test_gradcheck(name: str, sample: Sample) -> None:
    args = engine_args(name, sample, "float64", True)
    if not any(isinstance(a, engine.Tensor) and a.requires_grad for a in args):
        pytest.skip("no differentiable float input in this sample")
    tensors = [i for i, a in enumerate(args) if isinstance(a, engine.Tensor)]

    def fn(*ts: engine.Tensor) -> engine.Tensor:
        full = list(args)
        for i, t in zip(tensors, ts, strict=True):
            full[i] = t
        return run(name, full, sample.attrs)

    assert engine.gradcheck(fn, [args[i] for i in tensors])


def _grads_vs_torch(name: str, sample: Sample) -> None:
    ours_in = engine_args(name, sample, "float64", True)
    ref_in = torch_args(name, sample, "float64", True)
    if not any(isinstance(a, engine.Tensor) and a.requires_grad for a in ours_in):
        pytest.skip("no differentiable float input in this sample")
    ours = run(name, ours_in, sample.attrs)
    ref = TORCH[name](torch, *ref_in, **sample.attrs)
    assert_close(ours, ref)
    assert ours.grad_fn is not None and ours.grad_fn.name() == OPS[name].grad_fn_name
    v = np.random.default_rng(7).standard_normal(ours.shape)
    ours.backward(engine.tensor(v, dtype="float64"))
    ref.backward(torch.tensor(v))
    for a, b in zip(ours_in, ref_in, strict=True):
        if isinstance(a, engine.Tensor) and a.requires_grad:
            assert a.grad is not None, "no gradient reached an input"
            assert a.grad.shape == a.shape and a.grad.dtype == a.dtype
            np.testing.assert_allclose(
                a.grad.numpy(), b.grad.numpy(), rtol=1e-7, atol=1e-9, equal_nan=True
            )


@needs_torch
@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_gradients_match_torch(name: str, sample: Sample) -> None:
    _grads_vs_torch(name, sample)


@needs_torch
@pytest.mark.parametrize(("name", "sample"), op_cases())
def test_array_api_strict(name: str, sample: Sample, backend_name: str) -> None:
    """Forward (and gradients where differentiable) on NumPy and on array-api-strict."""
    if sample.grad and OPS[name].differentiable:
        _grads_vs_torch(name, sample)
    else:
        ours = run(name, engine_args(name, sample, "float64", False), sample.attrs)
        ref = TORCH[name](torch, *torch_args(name, sample, "float64", False), **sample.attrs)
        assert_close(ours, ref)


def _binds(fn: Any, args: list[Any], attrs: dict[str, Any]) -> bool:
    try:
        inspect.signature(fn).bind(*args, **attrs)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize(
    ("name", "k"), [(n, k) for n, errs in sorted(ERRORS.items()) for k in range(len(errs))]
)
def test_error_samples(name: str, k: int) -> None:
    err = ERRORS[name][k]
    op = OPS[name]
    args = [engine.tensor(a) if isinstance(a, np.ndarray) else a for a in err.args]
    fn = getattr(engine, name)
    if op.variadic or not _binds(fn, args, err.attrs):
        # The registry's checks, as a graph's node meets them. From Python, the function's
        # signature refuses such a call first, with a TypeError (as PyTorch's do).
        if not op.variadic:
            with pytest.raises(TypeError):
                fn(*args, **err.attrs)
        with pytest.raises(err.error) as info:
            op.check_arity(len(args))
            apply(op, args, op.bind_attrs(err.attrs))
    else:
        with pytest.raises(err.error) as info:
            fn(*args, **err.attrs)
    assert re.search(err.match, str(info.value)), f"{info.value!s} !~ {err.match}"


@needs_torch
@pytest.mark.parametrize(("name", "sample"), op_cases(only_grad=True))
def test_second_order_matches_torch(name: str, sample: Sample) -> None:
    """Gradients of gradients (create_graph=True): d/dx ⟨∂f/∂x · v, w⟩ against PyTorch's
    double backward, so every VJP is itself differentiable."""
    if not sample.second_order:
        pytest.skip("PyTorch's double backward differs here on purpose (see the sample)")
    ours_in = engine_args(name, sample, "float64", True)
    ref_in = torch_args(name, sample, "float64", True)
    wrt = [i for i, a in enumerate(ours_in) if isinstance(a, engine.Tensor) and a.requires_grad]
    if not wrt:
        pytest.skip("no differentiable float input in this sample")
    rng = np.random.default_rng(11)
    ours = run(name, ours_in, sample.attrs)
    ref = TORCH[name](torch, *ref_in, **sample.attrs)
    v = rng.standard_normal(ours.shape)
    ws = [rng.standard_normal(ours_in[i].shape) for i in wrt]

    firsts = engine.grad(
        ours, [ours_in[i] for i in wrt], engine.tensor(v), create_graph=True, allow_unused=True
    )
    total = sum(
        (
            engine.sum(g * engine.tensor(w))
            for g, w in zip(firsts, ws, strict=True)
            if g is not None and g.requires_grad
        ),
        engine.tensor(0.0, dtype="float64"),
    )
    ref_firsts = torch.autograd.grad(
        ref, [ref_in[i] for i in wrt], torch.tensor(v), create_graph=True, allow_unused=True
    )
    ref_total = sum(
        (
            torch.sum(g * torch.tensor(w))
            for g, w in zip(ref_firsts, ws, strict=True)
            if g is not None and g.requires_grad
        ),
        torch.tensor(0.0, dtype=torch.float64),
    )
    if not ref_total.requires_grad:
        assert not total.requires_grad or np.allclose(
            [
                g.numpy()
                for g in engine.grad(total, [ours_in[i] for i in wrt], allow_unused=True)
                if g is not None
            ],
            0,
        )
        return
    seconds = engine.grad(total, [ours_in[i] for i in wrt], allow_unused=True)
    ref_seconds = torch.autograd.grad(ref_total, [ref_in[i] for i in wrt], allow_unused=True)
    for ours_g, ref_g, i in zip(seconds, ref_seconds, wrt, strict=True):
        expected = np.zeros(ours_in[i].shape) if ref_g is None else ref_g.numpy(force=True)
        got = np.zeros(ours_in[i].shape) if ours_g is None else ours_g.numpy()
        np.testing.assert_allclose(
            got,
            expected,
            rtol=1e-7,
            atol=1e-9,
            equal_nan=True,
            err_msg=f"second derivative w.r.t. argument {i}",
        )
