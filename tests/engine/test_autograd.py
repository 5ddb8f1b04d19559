"""Autograd semantics as PyTorch users know them: the seed examples, accumulation,
retain_graph, detach, no_grad and its isolation across threads, deep graphs,
second-order gradients, PyTorch's type promotion."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import gradserve.engine as engine
from gradserve.engine.errors import BackwardError, DTypeError, ShapeError

try:
    import torch
except ImportError:  # the PyTorch comparisons skip; everything else runs
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch (the test extra) is absent")


def test_seed_example_backward() -> None:
    x = engine.tensor(2.0, requires_grad=True)
    y = engine.tensor(3.0, requires_grad=True)
    z = (x + y) * (x - y)
    assert z.item() == -5.0
    assert z.grad_fn is not None and z.grad_fn.name() == "MulBackward"
    z.backward()
    assert x.grad is not None and y.grad is not None
    assert x.grad.item() == 4.0 and y.grad.item() == -6.0
    assert x.grad.dtype == "float32" and x.grad.shape == ()


def test_seed_example_no_grad() -> None:
    a = engine.tensor([5.0], requires_grad=True)
    with engine.no_grad():
        b = a**2 + 16
    assert b.tolist() == [41.0]
    assert b.requires_grad is False and b.grad_fn is None
    assert a.requires_grad is True and a.grad is None


def test_grad_accumulates_across_backward_calls_and_paths() -> None:
    x = engine.tensor(3.0, requires_grad=True)
    (x * x).backward()  # two paths into x: 2x
    assert x.grad.item() == 6.0
    (x * 2.0).backward()
    assert x.grad.item() == 8.0


def test_second_backward_through_freed_graph_is_pytorch_error() -> None:
    x = engine.tensor(2.0, requires_grad=True)
    y = engine.exp(x) * x
    y.backward(retain_graph=True)
    y.backward()  # retained once: works, and accumulates
    np.testing.assert_allclose(x.grad.item(), 2 * (np.exp(2.0) * 3.0), rtol=1e-6)
    with pytest.raises(BackwardError, match="backward through the graph a second time"):
        y.backward()


def test_backward_of_a_node_without_saved_values_may_repeat() -> None:
    x = engine.tensor(1.0, requires_grad=True)
    z = x + 1.0  # AddBackward saves nothing: PyTorch allows a second backward
    z.backward()
    z.backward()
    assert x.grad.item() == 2.0


def test_non_scalar_backward_needs_gradient() -> None:
    x = engine.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(BackwardError, match="only for scalar outputs"):
        (x * 2).backward()
    (x * 2).backward(engine.tensor([1.0, 10.0]))
    assert x.grad.tolist() == [2.0, 20.0]
    one = engine.tensor([3.0], requires_grad=True)
    (one * one).backward()  # one element, shape (1,): the implicit 1 applies
    assert one.grad.tolist() == [6.0]


def test_backward_on_tensor_without_grad_fails() -> None:
    with pytest.raises(BackwardError, match="does not require grad"):
        engine.tensor(1.0).backward()


def test_detach_cuts_the_graph() -> None:
    x = engine.tensor(2.0, requires_grad=True)
    y = x * x
    d = y.detach()
    assert d.grad_fn is None and not d.requires_grad and d.is_leaf
    (d * x).backward()
    assert x.grad.item() == 4.0  # only the direct path: d is a constant


def test_leaf_and_requires_grad_rules() -> None:
    x = engine.tensor([1.0, 2.0], requires_grad=True)
    assert x.is_leaf and x.grad_fn is None
    y = x * 2
    assert not y.is_leaf and y.requires_grad
    c = engine.tensor([1.0, 2.0])
    assert not (c * 2).requires_grad and (c * 2).grad_fn is None
    with pytest.raises(DTypeError, match="floating point"):
        engine.tensor([1, 2], requires_grad=True)
    assert not (x > 1).requires_grad  # comparisons give bool and record nothing


def test_grad_mode_context_managers_and_decorators() -> None:
    x = engine.tensor(1.0, requires_grad=True)
    with engine.no_grad():
        assert not engine.is_grad_enabled()
        with engine.enable_grad():
            assert (x * 2).requires_grad
        assert not (x * 2).requires_grad
    assert engine.is_grad_enabled()

    @engine.no_grad()
    def frozen(t: engine.Tensor) -> engine.Tensor:
        return t * 3

    assert frozen(x).grad_fn is None
    with engine.set_grad_enabled(False):
        assert not (x * 2).requires_grad
    assert engine.is_grad_enabled()


def test_no_grad_does_not_leak_between_threads_or_pooled_jobs() -> None:
    """A no_grad job must never switch off recording for another job running beside it, nor
    for a later job that a server's thread pool runs on the same thread."""
    barrier = threading.Barrier(8)

    def job(k: int) -> bool:
        x = engine.tensor(float(k), requires_grad=True)
        if k % 2:
            with engine.no_grad():
                barrier.wait(timeout=10)
                return (x * 2).requires_grad
        barrier.wait(timeout=10)
        return (x * 2).requires_grad

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(job, range(8))) == [k % 2 == 0 for k in range(8)]

    # asyncio.to_thread (and anyio's, which the server's framework uses) runs each job in a
    # copy of the caller's context: a bare set_grad_enabled(False) ends with its job, though
    # the next jobs run on the very same thread (the executor has one).
    async def reuse_one_thread() -> list[bool]:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))
        await asyncio.to_thread(engine.set_grad_enabled, False)
        return [await asyncio.to_thread(engine.is_grad_enabled) for _ in range(4)]

    assert asyncio.run(reuse_one_thread()) == [True] * 4


@needs_torch
def test_a_bare_set_grad_enabled_lasts_for_its_thread_as_in_pytorch() -> None:
    """Grad mode is per thread, as PyTorch's is: a bare call inside a job submitted straight to
    a ThreadPoolExecutor (no context copied) stays for the later jobs on that thread."""

    def after_a_bare_call(lib: Any) -> list[bool]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(lib.set_grad_enabled, False).result()
            return [pool.submit(lib.is_grad_enabled).result() for _ in range(3)]

    assert after_a_bare_call(engine) == after_a_bare_call(torch) == [False] * 3
    assert engine.is_grad_enabled() and torch.is_grad_enabled()  # the caller's thread: untouched


def test_hundred_thousand_node_chain() -> None:
    x = engine.tensor(0.5, dtype="float64", requires_grad=True)
    y = x
    for _ in range(100_000):
        y = y * 1.0 + 0.0
    y.backward()
    assert x.grad.item() == 1.0


def test_unused_input_grad_is_none_with_allow_unused() -> None:
    x = engine.tensor(1.0, requires_grad=True)
    u = engine.tensor(1.0, requires_grad=True)
    with pytest.raises(BackwardError, match="not have been used"):
        engine.grad(x * 2, [x, u])
    gx, gu = engine.grad(x * 2, [x, u], allow_unused=True)
    assert gx.item() == 2.0 and gu is None


def test_grad_does_not_touch_dot_grad() -> None:
    x = engine.tensor(2.0, requires_grad=True)
    (g,) = engine.grad(x**3, x)
    assert g.item() == 12.0 and x.grad is None


def _hvp(f, x_np: np.ndarray, v_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = engine.tensor(x_np, requires_grad=True)
    (g,) = engine.grad(f(engine, x), x, create_graph=True)
    assert g.grad_fn is not None
    (hv,) = engine.grad(g, x, grad_outputs=engine.tensor(v_np))
    xt = torch.tensor(x_np, requires_grad=True)
    (gt,) = torch.autograd.grad(f(torch, xt), xt, create_graph=True)
    (hvt,) = torch.autograd.grad(gt, xt, grad_outputs=torch.tensor(v_np))
    return hv.numpy(), hvt.numpy()


SECOND_ORDER = {
    "poly": lambda m, x: m.sum(x**3 * m.sin(x)),
    "div-exp-log": lambda m, x: m.sum(m.exp(x) / (1.0 + x * x) + m.log(x * x + 1.0)),
    "sigmoid-tanh": lambda m, x: m.sum(m.sigmoid(x) * m.tanh(x)),
    "softplus-sqrt": lambda m, x: (
        m.sum(m.nn.functional.softplus(x) if m is torch else m.softplus(x))
        + m.sum(m.sqrt(x * x + 1.0))
    ),
    "mean-max": lambda m, x: m.mean(m.maximum(x, x * 0.5) ** 2),
    "where-clamp": lambda m, x: m.sum(m.where(x > 0, x**2, m.clamp(x, min=-0.5) ** 3)),
}


@needs_torch
@pytest.mark.parametrize("name", sorted(SECOND_ORDER))
def test_hessian_vector_products_match_torch(name: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(0.2, 1.5, (3, 4))
    v = rng.standard_normal((3, 4))
    ours, ref = _hvp(SECOND_ORDER[name], x, v)
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12)


def test_second_order_by_finite_differences() -> None:
    """gradcheck of the gradient itself: d/dx <grad f(x), w>, in float64."""
    rng = np.random.default_rng(1)
    w = engine.tensor(rng.standard_normal(5), dtype="float64")

    def first(x: engine.Tensor) -> engine.Tensor:
        (g,) = engine.grad(engine.sum(engine.tanh(x) * x**2), x, create_graph=True)
        return engine.sum(g * w)

    x = engine.tensor(rng.standard_normal(5), dtype="float64", requires_grad=True)
    assert engine.gradcheck(first, [x])


@needs_torch
@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (np.array([1, 2]), 2.5, "float32"),  # int tensor + float literal: default float
        (np.array([1.0, 2.0], dtype=np.float16), 2.5, "float16"),  # literals are weak
        (np.array([1, 2], dtype=np.int32), 5, "int32"),
        (np.array([True]), 1, "int64"),
        (np.array([1], dtype=np.int32), np.array(1.0), "float64"),  # 0-d float lifts ints
        (np.array([1.0], dtype=np.float16), np.array(1.0), "float16"),  # 0-d ranks lower
        (np.array([1], dtype=np.int64), np.array([1.0], dtype=np.float16), "float16"),
    ],
)
def test_type_promotion_matches_torch(a: np.ndarray, b: object, expected: str) -> None:
    ours = engine.tensor(a) + (engine.tensor(b) if isinstance(b, np.ndarray) else b)
    ref = torch.tensor(a) + (torch.tensor(b) if isinstance(b, np.ndarray) else b)
    assert ours.dtype == expected == str(ref.dtype).removeprefix("torch.")


def test_zero_dim_results_rank_below_dimensioned_tensors() -> None:
    """The value of a 0-d float64 result is a NumPy float64 scalar, which subclasses Python's
    float: it must still promote as a 0-d tensor, not as a weak literal."""
    a = engine.tensor([1.0, 2.0])
    c = engine.tensor(3.0, dtype="float64") * 2.0
    results = (a * c, a + c, engine.maximum(a, c), engine.where(a > 1, a, c), a * np.float64(2))
    for result in results:
        assert result.dtype == "float32"
    assert (engine.tensor([1, 2]) * c).dtype == "float64"  # a float 0-d lifts an int tensor


def test_integer_division_gives_float32() -> None:
    out = engine.tensor([1, 2]) / engine.tensor([2, 4])
    assert out.dtype == "float32" and out.tolist() == [0.5, 0.5]


def test_gradient_is_summed_back_over_broadcast_dims() -> None:
    a = engine.tensor(np.ones((3, 1)), requires_grad=True)
    b = engine.tensor(np.ones((1, 4)), requires_grad=True)
    engine.sum(a * b * 2.0).backward()
    assert a.grad.shape == (3, 1) and a.grad.tolist() == [[8.0]] * 3
    assert b.grad.shape == (1, 4) and b.grad.tolist() == [[6.0] * 4]


def test_gradient_dtype_follows_each_input() -> None:
    a = engine.tensor([1.0, 2.0], dtype="float32", requires_grad=True)
    b = engine.tensor([3.0, 4.0], dtype="float64", requires_grad=True)
    out = a * b
    assert out.dtype == "float64"
    engine.sum(out).backward()
    assert a.grad.dtype == "float32" and b.grad.dtype == "float64"


def test_shape_errors_name_the_op_and_shapes() -> None:
    with pytest.raises(ShapeError, match=r"add: shapes \(3,\) and \(4,\) cannot be broadcast"):
        engine.tensor([1.0, 2.0, 3.0]) + engine.tensor([1.0, 2.0, 3.0, 4.0])


def test_stable_extremes() -> None:
    x = engine.tensor([-800.0, 300.0], dtype="float64", requires_grad=True)
    s = engine.sigmoid(x)
    engine.sum(s).backward()
    assert s.tolist() == [0.0, 1.0] and x.grad.tolist() == [0.0, 0.0]  # no NaN from inf/inf
    x32 = engine.tensor([-300.0, 300.0], requires_grad=True)
    engine.sum(engine.sigmoid(x32)).backward()
    assert x32.grad.tolist() == [0.0, 0.0]
    big = engine.tensor([1e4, 0.0], dtype="float64", requires_grad=True)
    sp = engine.softplus(big)
    assert np.isfinite(sp.numpy()).all() and sp.tolist()[0] == 1e4


def test_python_api_surface() -> None:
    x = engine.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    assert x.shape == (2, 2) and x.dtype == engine.float32 and x.device == "cpu"
    y = x.sum(dim=1)
    assert y.grad_fn.name() == "SumBackward" and y.tolist() == [3.0, 7.0]
    assert (-x).tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    assert (2 - x).tolist() == [[1.0, 0.0], [-1.0, -2.0]]
    assert (2 ** engine.tensor([1.0, 3.0])).tolist() == [2.0, 8.0]
    assert {x: 1}[x] == 1  # hashable by identity, though == builds an op
    assert engine.tensor(np.arange(3.0)).dtype == "float64"  # NumPy data keeps its dtype
    assert engine.tensor([1, 2]).dtype == "int64" and engine.tensor([True]).dtype == "bool"
    for spelling in (
        "float64",
        engine.float64,
        np.float64,
        np.dtype("float64"),
        float,
        "torch.float64",
    ):
        assert engine.tensor([1, 2], dtype=spelling).dtype == "float64"
    with pytest.raises(DTypeError, match="unknown dtype 'complex64'"):
        engine.tensor([1, 2], dtype="complex64")


@needs_torch
def test_pytorch_spellings_indexing_and_varargs_sizes() -> None:
    a = np.arange(24.0).reshape(2, 3, 4)
    x = engine.tensor(a, requires_grad=True)
    t = torch.tensor(a, requires_grad=True)
    keys = [
        0,
        -1,
        (1, 2),
        (slice(None), 1),
        (Ellipsis, 2),
        (0, slice(1, 3), slice(None, None, 2)),
        slice(-1, None),
    ]
    for key in keys:
        ours, ref = x[key], t[key]
        assert ours.shape == tuple(ref.shape), key
        np.testing.assert_array_equal(ours.numpy(), ref.detach().numpy())
        (ours * ours).sum().backward()
        (ref * ref).sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), t.grad.numpy())
    with pytest.raises(IndexError, match="out of bounds"):
        x[5]
    assert x.reshape(6, 4).shape == (6, 4) and x.view(4, 6).shape == (4, 6)
    assert x.permute(2, 0, 1).shape == (4, 2, 3) and x.T.shape == (4, 3, 2)
    assert engine.zeros(2, 3).shape == (2, 3) and engine.ones((4,)).shape == (4,)
    assert x.double().dtype == "float64" and x.long().dtype == "int64"
    assert x.float().dtype == "float32"
