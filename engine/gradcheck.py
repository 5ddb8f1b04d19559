"""Central finite differences against the analytic vector-Jacobian product.

Like `torch.autograd.gradcheck`, but checking a seeded random projection: for a
random output cotangent v and input direction u, ⟨u, Jᵀv⟩ (one backward pass)
must equal ⟨Ju, v⟩, estimated as (f(x + εu) - f(x - εu)) / 2ε · v. Inputs should
be float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gradserve.engine._tensor import Tensor, grad, tensor


class GradcheckError(AssertionError):
    """The analytic and numeric gradients disagree; the message shows both."""


def _outputs(fn: Callable[..., Any], inputs: Sequence[Tensor]) -> list[Tensor]:
    out = fn(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _shifted(
    fn: Callable[..., Any],
    inputs: list[Tensor],
    diff: list[int],
    us: list[np.ndarray],
    vs: list[np.ndarray],
    step: float,
) -> float:
    """⟨f(x + step·u), v⟩. Grad mode stays on: `fn` may itself take gradients."""
    moved = list(inputs)
    for i, u in zip(diff, us, strict=True):
        t = inputs[i]
        moved[i] = tensor(t.numpy() + step * u, dtype=t.dtype, device=t.device, requires_grad=True)
    res = _outputs(fn, moved)
    return sum(float(np.sum(r.numpy() * v)) for r, v in zip(res, vs, strict=True))


def gradcheck(
    fn: Callable[..., Tensor | Sequence[Tensor]],
    inputs: Sequence[Tensor],
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    seed: int = 0,
    trials: int = 2,
    raise_exception: bool = True,
) -> bool:
    """True if `fn`'s gradients match central differences at `inputs`."""
    inputs = list(inputs)
    rng = np.random.default_rng(seed)
    diff = [i for i, t in enumerate(inputs) if t.requires_grad]
    if not diff:
        raise ValueError("gradcheck needs at least one input with requires_grad=True")
    for _ in range(trials):
        outs = _outputs(fn, inputs)
        vs = [rng.standard_normal(o.shape) for o in outs]
        us = [rng.standard_normal(inputs[i].shape) for i in diff]
        grads = grad(
            [o for o in outs if o.requires_grad],
            [inputs[i] for i in diff],
            grad_outputs=[
                tensor(v, dtype=o.dtype, device=o.device)
                for o, v in zip(outs, vs, strict=True)
                if o.requires_grad
            ],
            allow_unused=True,
        )
        analytic = sum(
            float(np.sum(g.numpy() * u)) for g, u in zip(grads, us, strict=True) if g is not None
        )

        numeric = (
            _shifted(fn, inputs, diff, us, vs, eps) - _shifted(fn, inputs, diff, us, vs, -eps)
        ) / (2 * eps)
        if not abs(analytic - numeric) <= atol + rtol * abs(numeric):
            if raise_exception:
                raise GradcheckError(
                    f"gradient mismatch: analytic ⟨u, Jᵀv⟩ = {analytic!r}, "
                    f"numeric ⟨Ju, v⟩ = {numeric!r} (eps={eps}, atol={atol}, rtol={rtol})"
                )
            return False
    return True
