"""Checkpointed loops: which differentiated scans recompute their residuals, and every how
many steps they keep their carries, so that a program fits its memory budget.

A scan that /backward differentiates (its reverse loop runs once: engine.graph.autodiff
marks it with `Body.vjp_of`) stacks its residuals, one row per step. Checkpointed with
segments of k steps (engine.graph.scan), it holds instead its carries at the start of each
segment and the residuals of one segment: about n/k·C + k·R bytes for n steps, carries of
C bytes and residuals of R bytes a step, least at k ≈ √(n·C/R); its reverse loop
recomputes every step but those of the last segment, which the forward stacks as it runs
(n - k steps of the forward body again). So among the k that fit, the largest recomputes
least: each loop that must be checkpointed gets the largest k that fits, and a loop that
fits without is not checkpointed.

How: first every candidate loop at its least-memory k, which is the least this can
reach (over the budget even then: the program is left so, or as it was where that took
less, and the caller says what it needs); then loop by loop, the most residual bytes
first, none if that fits, else the largest k that fits (a binary search, each probe a
plan of the whole program: the peak is the planner's, exact, not a model's).

Not checkpointed (their residuals stacked as before): loops inside a loop body (only a
program's own steps are), and loops whose reverse loop is itself differentiated (a
`grad` or `jvp` node's, derived with create_graph).

Binomial checkpointing (Griewank and Walther's revolve) would hold fewer checkpoints (s
of them for up to C(s + r, s) steps, recomputing each up to r times); this two-level
scheme recomputes each step at most once, so its time stays within the issue's 2x, and
its √n memory is already a small fraction of the plain stacks for the loops this serves
(2·√10,000 rows instead of 10,000).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gradserve.engine.graph.facts import Facts, size_of
from gradserve.engine.graph.ir import Program, Step
from gradserve.engine.graph.plan import plan
from gradserve.engine.graph.scan import Body
from gradserve.engine.ops.registry import Meta


@dataclass(eq=False)
class _Pair:
    """A forward scan and its reverse loop as derived, the steps now in the program in
    their place, and the slots of the checkpoints and buffers (their metas set by k)."""

    forward: Step
    reverse: Step
    now: tuple[Step, Step]
    checkpoints: list[int]
    buffers: list[int]
    least: int  # the k of least memory


def checkpoint_loops(
    program: Program, budget: int, *, ufuncs: bool, facts: Mapping[Step, Facts] | None = None
) -> int | None:
    """Checkpoint `program`'s differentiated loops (planned, and planned again as they
    change) so that its planned peak fits `budget`, recomputing as little as that allows.
    Returns None when it fits, else the least planned peak it reaches (the program is
    left at it)."""
    pairs = _pairs(program)
    if not pairs:
        return program.planned_peak_bytes

    def fits() -> bool:
        plan(program, ufuncs=ufuncs, facts=facts)
        return program.planned_peak_bytes <= budget

    plain = program.planned_peak_bytes
    for pair in pairs:
        _install(program, pair, pair.least)
    if not fits():
        if program.planned_peak_bytes < plain:
            return program.planned_peak_bytes
        for pair in pairs:  # (checkpointing takes more than it saves)
            _install(program, pair, 0)
        plan(program, ufuncs=ufuncs, facts=facts)
        return plain
    for pair in sorted(pairs, key=lambda p: -_residual_bytes(p.forward, p.reverse)):
        _install(program, pair, 0)
        if fits():
            continue
        low, high = pair.least, pair.forward.attrs["body"].length
        while low < high:  # (low fits)
            k = (low + high + 1) // 2
            _install(program, pair, k)
            if fits():
                low = k
            else:
                high = k - 1
        _install(program, pair, low)
        fits()
    return None


def checkpoint_every(
    program: Program, every: int, *, ufuncs: bool, facts: Mapping[Step, Facts] | None = None
) -> int:
    """Checkpoint each of `program`'s loops that may be every `every` steps (at most its
    length), whatever the budget, and plan it again (tests and benchmarks); how many."""
    pairs = _pairs(program)
    for pair in pairs:
        _install(program, pair, min(every, pair.forward.attrs["body"].length))
    plan(program, ufuncs=ufuncs, facts=facts)
    return len(pairs)


def _pairs(program: Program) -> list[_Pair]:
    """The program's loops that may be checkpointed, with their reverse loops."""
    steps = program.steps
    at = {id(step): i for i, step in enumerate(steps)}
    pairs = []
    for reverse in steps:
        rbody = reverse.attrs.get("body")
        if type(rbody) is not Body or rbody.vjp_of is None or id(rbody.vjp_of) not in at:
            continue
        forward = rbody.vjp_of
        body: Body = forward.attrs["body"]
        residuals = _residuals(body, rbody)
        if body.length < 2 or not residuals:
            continue
        metas = program.metas
        checkpoints = [_slot(metas, metas[0]) for _ in body.carries]
        probe = replace(body, every=1, replayed=residuals)
        buffers = [_slot(metas, metas[0]) for _ in probe.buffered()]
        carry = sum(size_of(body.b.metas[c]) for c in body.carries)
        row = sum(size_of(body.b.metas[r]) for r in probe.buffered())
        pairs.append(
            _Pair(
                forward,
                reverse,
                (forward, reverse),
                checkpoints,
                buffers,
                _least(body.length, carry, row),
            )
        )
    return pairs


def _residuals(forward: Body, reverse: Body) -> list[int]:
    """The values of the forward body that the reverse loop reads per step."""
    computed = {o for st in forward.steps for o in st.outs} | set(forward.carries)
    return [x for x in reverse.xs if x in computed]


def _residual_bytes(forward: Step, reverse: Step) -> int:
    body: Body = forward.attrs["body"]
    return body.length * sum(
        size_of(body.b.metas[r]) for r in _residuals(body, reverse.attrs["body"])
    )


def _least(length: int, carry: int, row: int) -> int:
    """The k for which ⌈length/k⌉ carries and k rows of residuals take the least bytes
    (the smallest of those)."""
    if not row:
        return length
    guess = max(1, min(length, round(math.sqrt(length * carry / row))))
    window = range(max(1, guess // 2), min(length, 2 * guess + 1) + 1)
    return min(window, key=lambda k: (-(-length // k) * carry + k * row, k))


def _slot(metas: list[Meta], meta: Meta) -> int:
    metas.append(meta)
    return len(metas) - 1


def _install(program: Program, pair: _Pair, every: int) -> None:
    """Put the pair's loops into the program checkpointed every `every` steps, or as
    derived (0)."""
    now = _checkpointed(program.metas, pair, every) if every else (pair.forward, pair.reverse)
    steps = program.steps
    for old, new in zip(pair.now, now, strict=True):
        steps[next(i for i, s in enumerate(steps) if s is old)] = new
    pair.now = now


def _checkpointed(metas: list[Meta], pair: _Pair, every: int) -> tuple[Step, Step]:
    """The forward scan and its reverse loop, checkpointed every `every` steps."""
    forward, reverse = pair.forward, pair.reverse
    fbody: Body = forward.attrs["body"]
    rbody: Body = reverse.attrs["body"]
    residuals = _residuals(fbody, rbody)
    kept = replace(fbody, every=every, replayed=residuals, wanted=[], program=None)
    inner = fbody.b.metas
    for slot, c in zip(pair.checkpoints, fbody.carries, strict=True):
        metas[slot] = Meta((kept.segments, *inner[c].shape), inner[c].dtype)
    for slot, r in zip(pair.buffers, kept.buffered(), strict=True):
        metas[slot] = Meta((kept.every, *inner[r].shape), inner[r].dtype)
    new_forward = Step(
        forward.op,
        forward.args,
        {"body": kept},
        forward.out,
        forward.kind,
        forward.origin,
        (*forward.more, *pair.checkpoints, *pair.buffers),
    )
    # The reverse loop reads the residuals from the replay, not as sequences, and no
    # initial carry for a shifted one.
    nc, nx = len(rbody.carries), len(rbody.xs)
    args = reverse.slots
    xs = [i for i, x in enumerate(rbody.xs) if x not in residuals]
    dropped = {j for _, j in rbody.shifted}
    closures = [j for j in range(len(rbody.closures)) if j not in dropped]
    fc, fx = len(fbody.carries), len(fbody.xs)
    given = forward.slots
    body = replace(
        rbody,
        xs=[rbody.xs[i] for i in xs],
        closures=[rbody.closures[j] for j in closures],
        shifted=[],
        replay=kept,
        vjp_of=None,
        wanted=[],
        program=None,
    )
    new_reverse = Step(
        reverse.op,
        (
            *args[:nc],
            *(args[nc + i] for i in xs),
            *(args[nc + nx + j] for j in closures),
            *pair.checkpoints,
            *pair.buffers,
            *given[fc : fc + fx],
            *given[fc + fx :],
        ),
        {"body": body},
        reverse.out,
        reverse.kind,
        reverse.origin,
        reverse.more,
    )
    return new_forward, new_reverse
