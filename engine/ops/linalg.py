"""Linear algebra: matmul, einsum, transpose, permute, det, inv, solve, cross (torch.linalg)."""

from __future__ import annotations

from typing import Any, NamedTuple

from gradserve.engine.dtypes import FLOATS, ITEMSIZE
from gradserve.engine.errors import DTypeError, ShapeError
from gradserve.engine.ops.common import dtype_name, is_number
from gradserve.engine.ops.registry import Attr, Meta, OpDef, nbytes, promoted_dtype, register
from gradserve.engine.shapes import broadcast_shapes, fmt, normalize_dim, numel

Shape = tuple[int, ...]


def _same_dtype(*metas: Meta) -> str:
    """PyTorch's matmul, solve and cross refuse mixed dtypes instead of promoting."""
    if len({m.dtype for m in metas}) > 1:
        listed = " and ".join(m.dtype for m in metas)
        raise DTypeError(f"expected both arguments to have the same dtype, got {listed}")
    return metas[0].dtype


def _tensors_only(*args: Any) -> None:
    """Refuse number literals (arrays in a forward, Metas in a shape rule)."""
    if any(a.literal if isinstance(a, Meta) else is_number(a) for a in args):
        raise ShapeError("arguments must be tensors, not numbers")


def _check_arrays(*arrays: Any) -> None:
    """The forward's share of the checks: tensors only, of one dtype (the backend would
    promote silently)."""
    _tensors_only(*arrays)
    _same_dtype(*(Meta((), str(a.dtype)) for a in arrays))


# ------------------------------------------------------------------ matmul


def _matmul_shape(a: Shape, b: Shape) -> Shape:
    """torch.matmul's result shape: 1-D operands are promoted to matrices and dropped again."""
    if not a or not b:
        raise ShapeError("both arguments to matmul need to be at least 1D")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ShapeError(f"shapes {fmt(a)} and {fmt(b)} do not match")
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2])
    except ShapeError:
        raise ShapeError(f"shapes {fmt(a)} and {fmt(b)} do not match (batch dims)") from None
    rows = a2[-2:-1] if len(a) > 1 else ()
    cols = b2[-1:] if len(b) > 1 else ()
    return batch + rows + cols


_BOOL_MATMUL = "matmul is not implemented for bool tensors (PyTorch has no bool kernel)"


def _matmul_infer(metas: list[Meta]) -> Meta:
    a, b = metas
    shape = _matmul_shape(a.shape, b.shape)  # also refuses numbers: they are 0-d
    dtype = _same_dtype(a, b)
    if dtype == "bool":
        raise DTypeError(_BOOL_MATMUL)
    return Meta(shape, dtype)


def _matmul(xp: Any, a: Any, b: Any) -> Any:
    _check_arrays(a, b)
    if a.dtype == xp.bool:
        raise DTypeError(_BOOL_MATMUL)
    return xp.matmul(a, b)


def _matmul_cost(metas: list[Meta], out: Meta) -> tuple[int, int]:
    """A multiply and an add per output element and step of the shared dim."""
    inner = metas[0].shape[-1] if metas[0].shape else 1
    return 2 * numel(out.shape) * inner, sum(nbytes(m) for m in metas) + nbytes(out)


def _factorization_cost(factor: float) -> Any:
    """An LU factorisation's n^3 work (times `factor`) per matrix, plus the solves' n^2 per
    right-hand column."""

    def cost(metas: list[Meta], out: Meta) -> tuple[int, int]:
        a = metas[0].shape
        n = a[-1] if a else 1
        matrices = numel(a[:-2])
        columns = numel(out.shape) // max(numel(out.shape[:-2]), 1) if len(out.shape) > 1 else 1
        flops = int(matrices * (factor * n**3 + 2 * n * n * columns))
        return flops, sum(nbytes(m) for m in metas) + nbytes(out)

    return cost


def _matmul_kernel(backend: Any, metas: list[Meta | None]) -> Any:
    # The checks (tensors of one dtype, not bool, shapes that match) were the shape rule's.
    return backend.xp.matmul


def _as_matrices(F: Any, g: Any, a: Any, b: Any) -> tuple[Any, Any, Any]:
    """The operands and the gradient with 1-D operands promoted to matrices, as matmul does."""
    sa, sb = tuple(a.shape), tuple(b.shape)
    a2 = F.reshape(a, shape=[1, sa[0]]) if len(sa) == 1 else a
    b2 = F.reshape(b, shape=[sb[0], 1]) if len(sb) == 1 else b
    batch = broadcast_shapes(sa[:-2], sb[:-2])
    rows = 1 if len(sa) == 1 else sa[-2]
    cols = 1 if len(sb) == 1 else sb[-1]
    return F.reshape(g, shape=[*batch, rows, cols]), a2, b2


def _vector_grad(F: Any, g: Any, axis: int) -> Any:
    """A promoted vector's gradient (..., 1, n) or (..., n, 1), summed over every dim but
    `axis` (the vector's) to (n,); also when n is 0."""
    ndim = len(g.shape)
    return F.sum(g, dim=[d for d in range(ndim) if d != axis % ndim])


def _matmul_vjp_a(F: Any, g: Any, a: Any, b: Any) -> Any:
    g2, _, b2 = _as_matrices(F, g, a, b)
    grad = F.matmul(g2, F.transpose(b2, dim0=-1, dim1=-2))
    return _vector_grad(F, grad, -1) if len(a.shape) == 1 else grad


def _matmul_vjp_b(F: Any, g: Any, a: Any, b: Any) -> Any:
    g2, a2, _ = _as_matrices(F, g, a, b)
    grad = F.matmul(F.transpose(a2, dim0=-1, dim1=-2), g2)
    return _vector_grad(F, grad, -2) if len(b.shape) == 1 else grad


# ------------------------------------------------------------------ einsum

EINSUM_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def parse_einsum(equation: str, shapes: list[Shape]) -> tuple[list[str], str, dict[str, int]]:
    """Each operand's subscripts and the output's, one letter per dim ('...' spelt out in
    letters the equation does not use), and each letter's size after broadcasting."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ShapeError(
            f"equation {equation!r} has {len(terms)} operand(s) but {len(shapes)} were given"
        )
    for term in [*terms, out]:
        if not all(c in EINSUM_LETTERS for c in term.replace("...", "", 1)):
            raise ShapeError(f"invalid equation {equation!r}: use letters, ',', '->' and '...'")
    ell = max(
        (len(s) - len(t) + 3 for t, s in zip(terms, shapes, strict=True) if "..." in t), default=0
    )
    spare = "".join(c for c in EINSUM_LETTERS if c not in eq)[:ell]
    subs: list[str] = []
    sizes: dict[str, int] = {}
    for k, (term, shape) in enumerate(zip(terms, shapes, strict=True)):
        if "..." in term:
            n = len(shape) - len(term) + 3
            if n < 0:
                raise ShapeError(f"operand {k} has {len(shape)} dims, too few for {term!r}")
            term = term.replace("...", spare[ell - n :])  # '...' dims align on the right
        if len(term) != len(shape):
            raise ShapeError(
                f"operand {k} has shape {fmt(shape)} but subscripts {term!r} name {len(term)} dims"
            )
        for c, size in zip(term, shape, strict=True):
            have = sizes.setdefault(c, size)
            if have != size and 1 not in (have, size):
                raise ShapeError(
                    f"subscript {c!r} has size {size} in operand {k} but {have} elsewhere"
                )
            sizes[c] = have if size == 1 else size  # size-1 dims broadcast, as in PyTorch
        subs.append(term)
    if arrow:
        out = out.replace("...", spare)
        if len(set(out)) != len(out):
            raise ShapeError(f"output subscripts {out!r} repeat a letter")
        unknown = [c for c in out if c not in sizes]
        if unknown:
            raise ShapeError(f"output subscript {unknown[0]!r} appears in no operand")
    else:  # implicit output: '...' first, then the letters used once, alphabetically
        once = [c for c in sizes if c not in spare and "".join(subs).count(c) == 1]
        out = spare + "".join(sorted(once))
    return subs, out, sizes


def _einsum_dtype(dtypes: list[str], subs: list[str], out: str, shapes: list[Shape]) -> str:
    """torch.einsum's result dtype: the operands' promoted dtype, except that one operand
    summing integers or bool gives int64 (as sum does) and that bool tensors cannot be
    contracted (a summed letter of size > 1 in two operands: PyTorch's bmm has no bool)."""
    summed = set("".join(subs)) - set(out)
    if len(dtypes) == 1:
        return dtypes[0] if dtypes[0] in FLOATS or not summed else "int64"
    if all(d == "bool" for d in dtypes) and any(
        sum(
            1
            for t, s in zip(subs, shapes, strict=True)
            if any(n > 1 for x, n in zip(t, s, strict=True) if x == c)
        )
        > 1
        for c in summed
    ):
        raise DTypeError("einsum cannot contract bool tensors (PyTorch has no bool kernel)")
    return promoted_dtype([Meta((1,), d) for d in dtypes])


def _einsum_infer(metas: list[Meta], *, equation: str) -> Meta:
    _tensors_only(*metas)
    subs, out, sizes = parse_einsum(equation, [m.shape for m in metas])
    dtype = _einsum_dtype([m.dtype for m in metas], subs, out, [m.shape for m in metas])
    return Meta(tuple(sizes[c] for c in out), dtype)


class Contraction(NamedTuple):
    """How an einsum is computed, decided from its subscripts alone."""

    presum: list[tuple[int, ...]]  # per operand, the axes summed out first
    equations: list[str]  # the einsum calls that follow, in order: one per pair, left to
    # right, or one for a single operand (empty when the sums already give the result)


def _contraction(subs: list[str], out: str, summable: bool) -> Contraction:
    """PyTorch's order (without opt_einsum): each operand's letters that appear nowhere
    else (not in the output, not in another operand, not twice in it) are summed out
    first; then the operands are contracted left to right, one pair at a time, keeping the
    letters needed later. Doing the same keeps infinities and NaNs where PyTorch puts them,
    and makes the work known before running: `einsum('i,j->', a, b)` is two sums and a
    product, not len(a) * len(b) products. `summable`: the dtype can be summed first
    (not bool)."""
    presum: list[tuple[int, ...]] = []
    reduced: list[str] = []
    for k, term in enumerate(subs):
        elsewhere = set(out).union(*(s for j, s in enumerate(subs) if j != k))
        axes = tuple(
            i for i, c in enumerate(term) if summable and c not in elsewhere and term.count(c) == 1
        )
        presum.append(axes)
        reduced.append("".join(c for i, c in enumerate(term) if i not in axes))
    if len(reduced) == 1:
        return Contraction(presum, [] if reduced[0] == out else [f"{reduced[0]}->{out}"])
    equations, cur = [], reduced[0]
    for k in range(1, len(reduced)):
        later = set(out).union(*reduced[k + 1 :])
        target = (
            out
            if k == len(reduced) - 1
            else "".join(dict.fromkeys(c for c in cur + reduced[k] if c in later))
        )
        equations.append(f"{cur},{reduced[k]}->{target}")
        cur = target
    return Contraction(presum, equations)


def _einsum(xp: Any, *operands: Any, equation: str) -> Any:
    _tensors_only(*operands)
    shapes = [tuple(o.shape) for o in operands]
    subs, out, _ = parse_einsum(equation, shapes)
    names = [dtype_name(xp, o.dtype) for o in operands]
    result = _einsum_dtype(names, subs, out, shapes)
    dtype = getattr(xp, result)
    operands = tuple(o if o.dtype == dtype else xp.astype(o, dtype) for o in operands)
    plan = _contraction(subs, out, result != "bool")
    cur, *rest = (
        xp.sum(o, axis=axes) if axes else o for o, axes in zip(operands, plan.presum, strict=True)
    )
    if not plan.equations:
        return cur if any(plan.presum) else xp.asarray(cur, copy=True)
    for equation_k, other in zip(plan.equations, [*rest] or [None], strict=True):
        cur = xp.einsum(equation_k, cur) if other is None else xp.einsum(equation_k, cur, other)
    return cur


def _einsum_cost(metas: list[Meta], out: Meta, *, equation: str) -> tuple[int, int]:
    """The work of the contraction `_einsum` runs: the first sums, then each einsum call at
    the product of the sizes of its letters (a multiply and an add each)."""
    subs, result, sizes = parse_einsum(equation, [m.shape for m in metas])
    plan = _contraction(subs, result, out.dtype != "bool")
    flops = sum(numel(m.shape) for m, axes in zip(metas, plan.presum, strict=True) if axes)
    moved = sum(nbytes(m) for m in metas) + nbytes(out)
    for eq in plan.equations:
        letters = set(eq.replace(",", "").replace("->", ""))
        work = numel([sizes[c] for c in letters])
        flops += 2 * work
        moved += numel([sizes[c] for c in eq.partition("->")[2]]) * ITEMSIZE[out.dtype]
    return flops, moved


def _einsum_vjp(F: Any, g: Any, operands: tuple[Any, ...], *, equation: str) -> list[Any]:
    subs, out, sizes = parse_einsum(equation, [tuple(o.shape) for o in operands])
    dtype = F.dtype_of(g)
    operands = tuple(o if F.dtype_of(o) == dtype else F.cast(o, dtype=dtype) for o in operands)
    grads = []
    for i, term in enumerate(subs):
        others = [s for j, s in enumerate(subs) if j != i]
        known = set(out).union(*others)
        # The letters this operand's gradient can be computed over; the rest (summed only
        # here) are broadcast back, and repeated letters (a diagonal) are masked.
        first = "".join(c for k, c in enumerate(term) if term.index(c) == k and c in known)
        grad = F.einsum(
            g,
            *(o for j, o in enumerate(operands) if j != i),
            equation=",".join([out, *others]) + "->" + first,
        )
        # Sizes as computed (a letter may have broadcast from size 1 in the others).
        got = dict(zip(first, grad.shape, strict=True))
        grad = F.reshape(
            grad,
            shape=[got[c] if term.index(c) == k and c in known else 1 for k, c in enumerate(term)],
        )
        grad = F.expand(grad, shape=[sizes[c] for c in term])
        for k, c in enumerate(term):
            j = term.index(c)
            if j != k:  # a repeated letter: only its diagonal gets the gradient
                grad = F.where(_positions(F, grad, j) == _positions(F, grad, k), grad, 0.0)
        # Size-1 dims that broadcast against another operand: their gradient is summed.
        shape = tuple(operands[i].shape)
        spread = [k for k, c in enumerate(term) if shape[k] == 1 and sizes[c] != 1]
        if spread:
            grad = F.sum(grad, dim=spread, keepdim=True)
        grads.append(grad)
    return grads


def _positions(F: Any, like: Any, dim: int) -> Any:
    """Each element's index along `dim`, from a cumulative count of ones."""
    return F.cumsum(F.ones_like(like), dim=dim)


# ---------------------------------------------------------- transpose, permute


def _transpose_dims(ndim: int, dim0: int, dim1: int) -> list[int]:
    perm = list(range(ndim))
    d0, d1 = normalize_dim(dim0, ndim), normalize_dim(dim1, ndim)
    if ndim:  # a 0-d tensor accepts dims 0 and -1 and stays as it is
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


def _transpose(xp: Any, x: Any, *, dim0: int, dim1: int) -> Any:
    return xp.permute_dims(x, tuple(_transpose_dims(len(x.shape), dim0, dim1)))


def _permute_kernel(xp: Any, perm: list[int]) -> Any:
    """permute_dims with the permutation fixed (the identity is the input itself, as
    NumPy's view; swapping the last two dims is the standard's `.mT`)."""
    n = len(perm)
    if perm == list(range(n)):
        return lambda x: x
    if n >= 2 and perm == [*range(n - 2), n - 1, n - 2]:
        return lambda x: x.mT
    axes, permute_dims = tuple(perm), xp.permute_dims
    return lambda x: permute_dims(x, axes)


def _transpose_kernel(backend: Any, metas: list[Meta], *, dim0: int, dim1: int) -> Any:
    return _permute_kernel(backend.xp, _transpose_dims(len(metas[0].shape), dim0, dim1))


def _permute_dims_kernel(backend: Any, metas: list[Meta], *, dims: list[int]) -> Any:
    return _permute_kernel(backend.xp, _permutation(len(metas[0].shape), dims))


def _transpose_infer(metas: list[Meta], *, dim0: int, dim1: int) -> Meta:
    (m,) = metas
    perm = _transpose_dims(len(m.shape), dim0, dim1)
    return Meta(tuple(m.shape[p] for p in perm), m.dtype)


def _permutation(ndim: int, dims: list[int]) -> list[int]:
    if len(dims) != ndim:
        raise ShapeError(
            f"dims {list(dims)} must name each of the tensor's {ndim} dimension(s) once"
        )
    perm = [normalize_dim(d, ndim) for d in dims]
    if len(set(perm)) != len(perm):
        raise ShapeError(f"dims {list(dims)} repeat a dimension")
    return perm


def _permute_infer(metas: list[Meta], *, dims: list[int]) -> Meta:
    (m,) = metas
    return Meta(tuple(m.shape[p] for p in _permutation(len(m.shape), dims)), m.dtype)


def _permute_vjp(F: Any, g: Any, *, dims: list[int]) -> Any:
    perm = _permutation(len(dims), dims)
    inverse = [perm.index(k) for k in range(len(perm))]
    return F.permute(g, dims=inverse)


# ---------------------------------------------------------- det, inv, solve


def _square(shape: Shape) -> None:
    if len(shape) < 2:
        raise ShapeError(f"A must have at least 2 dimensions, got shape {fmt(shape)}")
    if shape[-1] != shape[-2]:
        raise ShapeError(
            "A must be batches of square matrices, but they are "
            f"{shape[-2]} by {shape[-1]} matrices"
        )


def _float(dtype: str) -> None:
    if dtype not in FLOATS:
        raise DTypeError(f"expected a floating point input, got {dtype}")


def _float_array(xp: Any, a: Any) -> None:
    if not xp.isdtype(a.dtype, "real floating"):
        raise DTypeError(f"expected a floating point input, got {a.dtype}")


def _det(xp: Any, a: Any) -> Any:
    _float_array(xp, a)
    return xp.linalg.det(a)


def _inv(xp: Any, a: Any) -> Any:
    _float_array(xp, a)
    return xp.linalg.inv(a)


def _det_infer(metas: list[Meta]) -> Meta:
    (m,) = metas
    _square(m.shape)
    _float(m.dtype)
    return Meta(m.shape[:-2], m.dtype)


def _inv_infer(metas: list[Meta]) -> Meta:
    (m,) = metas
    _square(m.shape)
    _float(m.dtype)
    return Meta(m.shape, m.dtype)


def _mT(F: Any, x: Any) -> Any:
    return F.transpose(x, dim0=-1, dim1=-2)


def _det_vjp(F: Any, g: Any, a: Any, result: Any) -> Any:
    # Jacobi's formula d det(A) = det(A) tr(A^-1 dA), as PyTorch: a singular matrix
    # (det exactly 0) gets 0, computed on the identity in its place so that inv never
    # fails (decided per matrix from the data, never by looking at it on the host); when
    # the backward is itself differentiated PyTorch gives it the cofactor matrix, and so
    # do we.
    scale = F.reshape(g * result, shape=[*result.shape, 1, 1])
    if not numel(tuple(a.shape)):
        return scale * _mT(F, F.inv(a))
    mask = F.reshape(result == 0, shape=[*result.shape, 1, 1])
    eye = _positions(F, a, -1) == _positions(F, a, -2)
    safe = F.where(mask, F.where(eye, F.ones_like(a), F.zeros_like(a)), a)
    grad = scale * _mT(F, F.inv(safe))
    if F.create_graph and a.shape[-1] <= _COFACTOR_MAX:
        cofactor = _cofactors(F, a) * F.reshape(g, shape=[*result.shape, 1, 1])
        grad = F.where(mask, cofactor, grad)
    return grad


_COFACTOR_MAX = 8  # the recurrence below loses digits on larger matrices


def _cofactors(F: Any, a: Any) -> Any:
    """The cofactor matrix (the gradient of det, also at a singular matrix): the
    transposed adjugate, by the Faddeev-LeVerrier recurrence M_1 = I,
    M_k+1 = A M_k - tr(A M_k) / k I, adj(A) = (-1)^(n-1) M_n. Matmuls and traces only, so
    that it is exact at a singular matrix and differentiates again without determinants."""
    n = a.shape[-1]
    eye = F.where(_positions(F, a, -1) == _positions(F, a, -2), F.ones_like(a), F.zeros_like(a))
    m = eye
    for k in range(1, n):
        am = F.matmul(a, m)
        trace = F.sum(am * eye, dim=[-2, -1], keepdim=True)
        m = am - trace / k * eye
    return _mT(F, m if n % 2 else -m)


def _inv_vjp(F: Any, g: Any, result: Any) -> Any:
    r_t = _mT(F, result)
    return -F.matmul(F.matmul(r_t, g), r_t)


def _solve_vector_case(a: Shape, b: Shape) -> bool:
    """torch.linalg.solve reads B as (batched) vectors when it is 1-D or has A's shape
    without its last dim."""
    return len(b) == 1 or b == a[:-1]


def _solve_shape(a: Shape, b: Shape) -> Shape:
    _square(a)
    n = a[-1]
    if _solve_vector_case(a, b):
        if b[-1] != n:
            raise ShapeError(f"shapes {fmt(a)} and {fmt(b)} do not match (A is {n} by {n})")
        return (*broadcast_shapes(a[:-2], b[:-1]), n)
    if len(b) < 2 or b[-2] != n:
        raise ShapeError(f"shapes {fmt(a)} and {fmt(b)} do not match (A is {n} by {n})")
    return broadcast_shapes(a[:-2], b[:-2]) + b[-2:]


def _solve_infer(metas: list[Meta]) -> Meta:
    a, b = metas
    _tensors_only(a, b)
    _float(a.dtype)
    dtype = _same_dtype(a, b)
    return Meta(_solve_shape(a.shape, b.shape), dtype)


def _solve(xp: Any, a: Any, b: Any) -> Any:
    _check_arrays(a, b)
    _float_array(xp, a)
    _solve_shape(tuple(a.shape), tuple(b.shape))
    vector = _solve_vector_case(tuple(a.shape), tuple(b.shape))
    if vector:  # the array API reads only a 1-D B as a vector: solve a column, then drop it
        b = xp.expand_dims(b, axis=-1)
    # The batch dims broadcast here: not every backend's solve broadcasts them (CuPy's does not).
    batch = broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    a = xp.broadcast_to(a, (*batch, *a.shape[-2:]))
    b = xp.broadcast_to(b, (*batch, *b.shape[-2:]))
    x = xp.linalg.solve(a, b)
    return x[..., 0] if vector else x


def _solve_kernel(backend: Any, metas: list[Meta | None]) -> Any:
    """`_solve` with its decisions made once from the shapes (the checks were the shape
    rule's): the vector case, and a broadcast only where the batch dims differ."""
    a, b = (m.shape for m in metas)  # type: ignore[union-attr]
    xp = backend.xp
    vector = _solve_vector_case(a, b)
    b_mat = (*b, 1) if vector else b
    batch = broadcast_shapes(a[:-2], b_mat[:-2])
    solve = xp.linalg.solve
    if a[:-2] != batch or b_mat[:-2] != batch:
        return None
    if vector:
        return lambda a, b: solve(a, b[..., None])[..., 0]
    return solve


def _linalg_kernel(name: str) -> Any:
    """The backend's function itself (the dtype check was the shape rule's)."""
    return lambda backend, metas: getattr(backend.xp.linalg, name)


def _solve_vjp_b(F: Any, g: Any, a: Any, result: Any) -> Any:
    return F.solve(_mT(F, a), g)  # B's gradient is A^-T g


def _solve_vjp_a(F: Any, g: Any, a: Any, result: Any) -> Any:
    gb = F.solve(_mT(F, a), g)
    if len(result.shape) < len(a.shape):  # vectors: the outer product gb x^T
        col = F.reshape(gb, shape=[*gb.shape, 1])
        row = F.reshape(result, shape=[*result.shape[:-1], 1, result.shape[-1]])
        return -(col * row)
    return -F.matmul(gb, _mT(F, result))


# ------------------------------------------------------------------ cross


def _cross_dim(a: Shape, b: Shape, dim: int) -> tuple[Shape, int]:
    if len(a) != len(b):
        raise ShapeError(
            f"shapes {fmt(a)} and {fmt(b)}: inputs must have the same number of dimensions"
        )
    shape = broadcast_shapes(a, b)
    d = normalize_dim(dim, len(shape))
    if not shape or shape[d] != 3:
        raise ShapeError(
            f"dim {dim} of shapes {fmt(a)} and {fmt(b)} must have size 3 for a cross product"
        )
    return shape, d


def _cross_infer(metas: list[Meta], *, dim: int) -> Meta:
    a, b = metas
    _tensors_only(a, b)
    dtype = _same_dtype(a, b)
    return Meta(_cross_dim(a.shape, b.shape, dim)[0], dtype)


def _cross(xp: Any, a: Any, b: Any, *, dim: int) -> Any:
    _check_arrays(a, b)
    shape, d = _cross_dim(tuple(a.shape), tuple(b.shape), dim)
    # The array API takes the axis after broadcasting, counted from the end.
    return xp.linalg.cross(
        xp.broadcast_to(a, shape), xp.broadcast_to(b, shape), axis=d - len(shape)
    )


register(
    OpDef(
        name="matmul",
        group="linear algebra",
        doc="Matrix product as torch.matmul: 1-D operands are vectors, batch dims broadcast; "
        "both operands must have one dtype.",
        args=("input", "other"),
        forward=_matmul,
        infer=_matmul_infer,
        vjp=(_matmul_vjp_a, _matmul_vjp_b),
        save=("input", "other"),
        cost=_matmul_cost,
        kernel=_matmul_kernel,
    ),
    OpDef(
        name="einsum",
        group="linear algebra",
        doc="Einstein summation over the operands (letters, '...', explicit or implicit "
        "output), as torch.einsum.",
        args=("operands",),
        views_input=True,
        forward=_einsum,
        infer=_einsum_infer,
        vjp=_einsum_vjp,
        cost=_einsum_cost,
        save=("operands",),
        attrs={"equation": Attr("str", doc="e.g. 'ij,jk->ik'")},
        variadic=True,
        call_order=("equation", "*operands"),
    ),
    OpDef(
        name="transpose",
        group="linear algebra",
        doc="Swap two dims.",
        args=("input",),
        views_input=True,
        forward=_transpose,
        infer=_transpose_infer,
        kernel=_transpose_kernel,
        vjp=(lambda F, g, *, dim0, dim1: F.transpose(g, dim0=dim0, dim1=dim1),),
        attrs={"dim0": Attr("int", doc="a dim"), "dim1": Attr("int", doc="the other dim")},
        positional_attrs=("dim0", "dim1"),
    ),
    OpDef(
        name="permute",
        group="linear algebra",
        doc="Reorder all dims.",
        args=("input",),
        views_input=True,
        forward=lambda xp, x, *, dims: xp.permute_dims(x, tuple(_permutation(x.ndim, dims))),
        infer=_permute_infer,
        kernel=_permute_dims_kernel,
        vjp=(_permute_vjp,),
        attrs={"dims": Attr("ints", doc="the new order of the dims")},
        positional_attrs=("dims",),
    ),
    OpDef(
        name="det",
        group="linear algebra",
        doc="Determinant of (batches of) square matrices; the gradient needs A invertible.",
        args=("A",),
        forward=_det,
        infer=_det_infer,
        kernel=_linalg_kernel("det"),
        vjp=(_det_vjp,),
        save=("A", "result"),
        cost=_factorization_cost(2 / 3),
    ),
    OpDef(
        name="inv",
        group="linear algebra",
        doc="Inverse of (batches of) square matrices.",
        args=("A",),
        forward=_inv,
        infer=_inv_infer,
        kernel=_linalg_kernel("inv"),
        vjp=(_inv_vjp,),
        save=("result",),
        cost=_factorization_cost(2),
    ),
    OpDef(
        name="solve",
        group="linear algebra",
        doc="X with A X = B, as torch.linalg.solve (B: matrices, or vectors shaped like A "
        "without its last dim, or 1-D).",
        args=("A", "B"),
        forward=_solve,
        infer=_solve_infer,
        kernel=_solve_kernel,
        vjp=(_solve_vjp_a, _solve_vjp_b),
        save=("A", "result"),
        cost=_factorization_cost(2 / 3),
    ),
    OpDef(
        name="cross",
        group="linear algebra",
        doc="Cross product of 3-vectors along `dim`, as torch.linalg.cross (batch dims broadcast).",
        args=("input", "other"),
        forward=_cross,
        infer=_cross_infer,
        vjp=(
            lambda F, g, a, b, *, dim: F.cross(b, g, dim=dim),
            lambda F, g, a, b, *, dim: F.cross(g, a, dim=dim),
        ),
        save=("input", "other"),
        attrs={"dim": Attr("int", -1, "the dim of size 3")},
        positional_attrs=("dim",),
    ),
)
