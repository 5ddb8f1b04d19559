"""Loop rolling: an unrolled loop of a program's forward, rewritten as one `scan` step.

Define-by-run records a loop once per iteration: a 400-step chain is 400 copies of its
step, and its backward as many again. Here k consecutive blocks of forward steps that do
the same thing (the same ops, attributes, literals and metas, reading each other in the
same pattern, and the same values from before the run) become a scan whose body is the
first block. What a block reads from the one before is a carry (its initial value what the
first block reads there); what every block reads from before the run, a closure. The
backward is then derived from the scan (engine.graph.autodiff: its reverse loop), and
planned and priced as any loop is.

A run is rolled only where nothing after it reads its values but the last block's carries
(the final carries) and stacks of one value of every block (the loop's stacked result).
Each block computes what it computed unrolled, in the same order: the forward is the
same bit for bit, and the backward sums a closure's gradient over the blocks in the order
the unrolled backward meets them.

Where it is used: XLA compiles the rolled program (engine.graph.xla.lower, through
compiler.roll_program): one block rather than the whole chain. The interpreter keeps the
program as unrolled: there a loop costs each iteration its bookkeeping, for a run no
faster. Blocks that read a value of their own from before the run (an input x_t per step,
as a define-by-run cell has) are not rolled: the loop would read them stacked, copies that
take XLA's buffers past the unrolled program's plan, which bounds an executable's memory
(docs/contract.md).

Runs are found with NumPy on one integer per step (its signature), for every period up
to MAX_PERIOD: a step equal to the one `p` steps later, over (MIN_BLOCKS - 1) * p steps
in a row, is a candidate of period p. The largest candidates are tried first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradserve.engine.graph.builder import Builder
from gradserve.engine.graph.facts import attr_values, literal_key
from gradserve.engine.graph.ir import CAST, CONSTANT, NODE, Arg, Step
from gradserve.engine.graph.scan import SCAN, Body, emit_scan
from gradserve.engine.ops.registry import Meta

MIN_BLOCKS = 4  # fewer repeats are left unrolled: the loop's own overhead would not pay
MAX_PERIOD = 512  # steps in a block, at most
MAX_WORK = 1 << 24  # steps times periods compared, at most (a graph of 10^5 steps: 160)
ROUNDS = 8  # runs rolled in one program, at most
ANALYSES = 64  # candidate runs looked at for one, at most
_ROLLABLE = (NODE, CAST, CONSTANT)

# How a block's step reads an argument: a literal; a value its own block made (at that
# step of the block); one the block before made (a carry, and in the first block what it
# reads from before the run); or one from before the run.
_LIT, _IN, _PREV, _EXT = 0, 1, 2, 3


@dataclass(eq=False)
class _Run:
    start: int
    period: int
    blocks: int
    # per step of a block, per argument: (how, which): the block's step for _IN and _PREV,
    # the slot for _EXT
    pattern: list[list[tuple[int, int]]]
    carries: dict[int, int] = field(default_factory=dict)  # block step -> its initial value
    closures: list[int] = field(default_factory=list)
    stacked: dict[int, int] = field(default_factory=dict)  # block step -> the stack step
    renames: dict[int, int] = field(default_factory=dict)  # filled in by the rewrite


def roll_loops(b: Builder, held: set[int]) -> dict[int, int]:
    """Roll the runs of repeated blocks in `b.steps` (a forward, as emitted), in place.
    `held`: the slots read after these steps (the outputs). Returns the slots that a
    rolled loop's results replace (old -> new) among the values read after a run."""
    renames: dict[int, int] = {}
    for _ in range(ROUNDS):
        run = _next_run(b, held)
        if run is None:
            break
        _rewrite(b, run)
        held = {run.renames.get(s, s) for s in held}
        renames = {old: run.renames.get(new, new) for old, new in renames.items()}
        renames.update(run.renames)
    return renames


def _signatures(steps: list[Step], metas: list[Meta]) -> np.ndarray:
    """One integer per step, equal for steps that may be the same step of two blocks."""
    ids: dict[Any, int] = {}
    out = np.empty(len(steps), np.int64)
    for i, step in enumerate(steps):
        if step.op is SCAN or step.kind not in _ROLLABLE:
            out[i] = -1 - i  # (unique: breaks any run)
            continue
        key = (
            step.op,
            step.kind,
            metas[step.out],
            *[metas[a] if type(a) is int else literal_key(a.value) for a in step.args],  # type: ignore[union-attr]
            *attr_values(step.attrs),
        )
        try:
            out[i] = ids.setdefault(key, len(ids))
        except TypeError:  # an attribute that cannot be a key (nested lists)
            out[i] = -1 - i
    return out


def _candidates(keys: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(steps covered by whole blocks, period, first step, length) of each stretch where
    the keys repeat with a period, the largest first (and the shorter period first)."""
    n = len(keys)
    if n < MIN_BLOCKS or np.bincount(keys[keys >= 0]).max(initial=0) < MIN_BLOCKS:
        return []  # no step repeats often enough (most graphs: nothing more to look at)
    found = []
    for p in range(1, min(MAX_PERIOD, n // MIN_BLOCKS, MAX_WORK // n) + 1):
        same = keys[:-p] == keys[p:]
        if np.count_nonzero(same) < (MIN_BLOCKS - 1) * p:
            continue
        edges = np.flatnonzero(np.diff(np.concatenate(([0], same.view(np.int8), [0]))))
        for start, stop in zip(edges[::2], edges[1::2], strict=True):
            length = int(stop - start) + p
            if length >= MIN_BLOCKS * p:
                found.append((length // p * p, p, int(start), length))
    found.sort(key=lambda c: (-c[0], c[1]))
    return found


def _next_run(b: Builder, held: set[int]) -> _Run | None:
    """The first run of the largest candidates that can be rolled, within ANALYSES tries;
    a stretch where one period failed is not tried with another."""
    steps = b.steps
    candidates = _candidates(_signatures(steps, b.metas))
    if not candidates:
        return None
    producer = {step.out: i for i, step in enumerate(steps)}
    readers: dict[int, list[int]] = {}
    for i, step in enumerate(steps):
        for a in step.args:
            if type(a) is int:
                readers.setdefault(a, []).append(i)
    tries = 0
    failed: list[tuple[int, int]] = []
    for _, period, start, length in candidates:
        if any(a <= start and start + length <= z for a, z in failed):
            continue
        for offset in range(min(period, length - MIN_BLOCKS * period + 1)):
            run = _analyse(
                steps, producer, readers, held, start + offset, period, (length - offset) // period
            )
            if run is not None:
                return run
            tries += 1
            if tries >= ANALYSES:
                return None
        failed.append((start, start + length))
    return None


def _reads(
    steps: list[Step], producer: dict[int, int], start: int, i: int, p: int
) -> list[list[tuple[int, int]]] | None:
    """How block i's steps read their arguments ((_EXT, slot) for a value from before
    the run), or None where a step reads a block before the previous one."""
    base = start + i * p
    out = []
    for j in range(p):
        reads = []
        for a in steps[base + j].args:
            if type(a) is not int:
                reads.append((_LIT, 0))
                continue
            at = producer.get(a, -1)
            if base <= at:
                reads.append((_IN, at - base))
            elif i and base - p <= at:
                reads.append((_PREV, at - base + p))
            elif at < start:
                reads.append((_EXT, a))
            else:
                return None
        out.append(reads)
    return out


def _analyse(
    steps: list[Step],
    producer: dict[int, int],
    readers: dict[int, list[int]],
    held: set[int],
    start: int,
    p: int,
    blocks: int,
) -> _Run | None:
    """The longest run of at least MIN_BLOCKS blocks from `start` that can be rolled, as a
    _Run; None where there is none."""
    pattern = _reads(steps, producer, start, 1, p)
    first = _reads(steps, producer, start, 0, p)
    if pattern is None or first is None:
        return None
    count = 2
    while count < blocks and _reads(steps, producer, start, count, p) == pattern:
        count += 1
    if count < MIN_BLOCKS:
        return None
    run = _Run(start, p, count, pattern)
    closures: dict[int, int] = {}
    for j in range(p):
        for q, (how, which) in enumerate(pattern[j]):
            head = first[j][q]
            if how == _PREV:
                if head[0] != _EXT or run.carries.setdefault(which, head[1]) != head[1]:
                    return None  # (one carry, two initial values)
            elif head != (how, which):
                return None  # (a value that differs from block to block: a per-step input)
            elif how == _EXT:
                closures.setdefault(which, len(closures))
    run.closures = list(closures)
    return run if _escapes_allowed(steps, readers, held, run) else None


def _escapes_allowed(
    steps: list[Step], readers: dict[int, list[int]], held: set[int], run: _Run
) -> bool:
    """Whether what is read after the run (by a later step, or as an output) is only the
    last block's carries and whole stacks (`stack` along dim 0 of one value of every
    block, in order); the stacks are noted in `run.stacked`."""
    start, p, blocks = run.start, run.period, run.blocks
    end = start + p * blocks
    for at in range(start, end):
        slot = steps[at].out
        later = [r for r in readers.get(slot, ()) if r >= end]
        if not later and slot not in held:
            continue
        i, j = divmod(at - start, p)
        if i == blocks - 1 and j in run.carries:
            continue  # a final carry
        if slot in held:
            return False
        whole = [steps[start + k * p + j].out for k in range(blocks)]
        for r in later:
            step = steps[r]
            if (
                run.stacked.get(j, r) != r
                or step.op.name != "stack"
                or step.attrs.get("dim") != 0
                or list(step.args) != whole
            ):
                return False
            run.stacked[j] = r
    return True


def _rewrite(b: Builder, run: _Run) -> None:
    steps, metas = b.steps, b.metas
    start, p, k = run.start, run.period, run.blocks
    end = start + p * k
    block = steps[start : start + p]
    last = steps[end - p : end]
    bb = Builder()
    carry = {j: bb.value(metas[init]).slot for j, init in run.carries.items()}
    closure = {c: bb.value(metas[c]).slot for c in run.closures}
    local: list[int] = []
    for j, step in enumerate(block):
        args: list[Arg] = []
        for a, (how, which) in zip(step.args, run.pattern[j], strict=True):
            if how == _LIT:
                args.append(a)
            elif how == _IN:
                args.append(local[which])
            elif how == _PREV:
                args.append(carry[which])
            else:
                args.append(closure[which])
        out = len(bb.metas)
        bb.metas.append(metas[step.out])
        made = Step(step.op, tuple(args), step.attrs, out, step.kind, step.origin)
        bb.steps.append(made)
        facts = b.facts.get(step)
        if facts is not None:
            bb.facts[made] = facts
        local.append(out)
    body = Body(
        b=bb,
        steps=list(bb.steps),
        carries=list(carry.values()),
        xs=[],
        closures=list(closure.values()),
        nexts=[local[j] for j in run.carries],
        ys=[local[j] for j in run.stacked],
        length=k,
        # (a client's `stack` of every block's value is the loop's stacked result now)
        unrolled_nodes=k * sum(step.kind == NODE for step in block)
        + sum(steps[at].kind == NODE for at in run.stacked.values()),
    )
    rest = steps[end:]
    b.steps = steps[:start]
    saved = b.kind, b.origin
    b.kind, b.origin = NODE, block[0].origin  # (the final carries' grad_fn: their last op's)
    try:
        inits = [b.syms[s] for s in run.carries.values()]
        # Nothing hoisted: a step every block computes alike, computed once, would have its
        # gradient summed before its VJP rather than after (other bits).
        outs = emit_scan(b, body, inits, [], [b.syms[c] for c in run.closures], hoist=False)
    finally:
        b.kind, b.origin = saved
    renames = run.renames
    for n, j in enumerate(run.carries):
        renames[last[j].out] = outs[n].slot
    dropped = set()
    for n, at in enumerate(run.stacked.values()):
        renames[steps[at].out] = outs[len(run.carries) + n].slot
        dropped.add(at - end)
    for i, step in enumerate(rest):
        if i in dropped:
            continue
        if any(type(a) is int and a in renames for a in step.args):
            moved = Step(
                step.op,
                tuple(renames.get(a, a) if type(a) is int else a for a in step.args),
                step.attrs,
                step.out,
                step.kind,
                step.origin,
                step.more,
            )
            facts = b.facts.pop(step, None)
            if facts is not None:
                b.facts[moved] = facts
            step = moved
        b.steps.append(step)
