"""Loops without unrolling: the `scan` step.

A scan step runs a body, a program of its own, once per step of a loop over the leading
axis of its sequences (as `jax.lax.scan`). Its arguments are the initial carries, the
sequences and the outer values the body reads (closures); it writes several slots: the
final carries, then each stacked result. The body lives in a Builder of its own, so a
`grad` inside it differentiates one step of the loop, not its history.

Reverse mode transposes a scan into another scan that runs the other way
(engine.graph.autodiff): its body is the VJP of this one's, and it reads, per step, the
values that VJP needs. The forward scan stacks those values (residuals) as extra results,
added when the derivation asks for them, so that a loop nothing differentiates keeps
none. All the bodies derived from one loop share its Builder (one slot space), so that
the VJP of a VJP finds the values it reads.

A residual stored once: the VJP reads a carry at each step, and the body value that
becomes its next value is stacked too (a residual, or a result the graph declares). The
carry's stack would be that stack shifted by one step, with the initial value first: the
reverse loop reads that one stack at the row of the step it visits next, and the initial
value (a closure) at its last step (`Body.shifted`).

Checkpointed loops (engine.graph.checkpoint chooses them and their k): the forward scan
keeps its carries at the start of every segment of k steps (`Body.every`; the first
segment takes what is left over), and the residuals of its last segment in buffers of k
rows. Its reverse loop (`Body.replay`) runs the last segment from those buffers, then,
segment by segment back to the first, re-runs the forward body from the segment's
checkpoint to fill the buffers again, and runs its own body over them: n - k steps of the
forward body run again. The residuals are values of the forward body's own program, so
the replay and the plain loop compute them alike, and the gradients are the same bit for
bit. A residual that is a carry whose next value has a buffer is read from that buffer one
row back, and at a segment's first step from its checkpoint.

Memory: a scan step holds its stacked results (checkpoints and buffers too) from its
start, the carries the body made at the previous step, and the body's own peak; while a
checkpointed reverse loop replays a segment, it holds the replay's peak and carries with
its own carries. The planner and the executor count the same (engine.graph.plan,
engine.graph.executor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gradserve.engine.graph.builder import Builder, Sym
from gradserve.engine.graph.facts import size_of
from gradserve.engine.graph.ir import BYTE_COST, Program, Step
from gradserve.engine.ops.registry import Meta, OpDef

# Cost units charged per body step per iteration, whatever the step computes: what
# running it costs the loop (so that a long loop of tiny steps is priced as work).
ITERATION_STEP_COST = 1000


@dataclass(eq=False)
class Body:
    """A loop body: its steps in the shared Builder `b`, the slots that stand for the
    carries, the current slices of the sequences and the closures, each carry's next value
    and the values stacked as results."""

    b: Builder
    steps: list[Step]
    carries: list[int]
    xs: list[int]
    closures: list[int]
    nexts: list[int]
    ys: list[int]
    length: int
    reverse: bool = False
    # A reverse loop's sequences read shifted by one step: (x, closure), the slice of
    # sequence x at the step the loop visits next, and closure's value at its last step.
    shifted: list[tuple[int, int]] = field(default_factory=list)
    # A checkpointed forward loop: segments of `every` steps (at most its length). Its
    # program also gives the values `replayed` (its reverse loop's residuals); it stacks
    # its carries at the start of each segment, and the residuals of its last segment into
    # buffers of `every` rows (results after the stacked ones: `start`, `buffered`).
    every: int = 0
    replayed: list[int] = field(default_factory=list)
    # A checkpointed reverse loop: the forward body it replays, whose checkpoints, buffers,
    # sequences and closures are the step's arguments after its own closures, and whose
    # `replayed` values its program is given after its closures.
    replay: Body | None = None
    # A loop that engine.graph.rolling made of an unrolled one: the client's nodes its
    # blocks hold (what the program reports as run, as unrolled); 0 for a client's scan.
    unrolled_nodes: int = 0
    # Set where a reverse loop is derived to run once (no create_graph): the scan step
    # whose VJP it is, which engine.graph.checkpoint may checkpoint. Compile time only.
    vjp_of: Step | None = None
    # Set by the planner: which of the step's results (final carries, stacked ones, then
    # checkpoints and buffers) the program uses, and the body planned for them.
    wanted: list[bool] = field(default_factory=list)
    program: Program | None = None

    @property
    def inputs(self) -> list[int]:
        """The slots its program is given."""
        if self.replay is not None:
            return [*self.carries, *self.xs, *self.closures, *self.replay.replayed]
        return [*self.carries, *self.xs, *self.closures]

    @property
    def segments(self) -> int:
        """A checkpointed forward loop's segments (a checkpoint each)."""
        return -(-self.length // self.every) if self.every else 0

    def start(self, segment: int) -> int:
        """A checkpointed forward loop's step where `segment` starts: the segments are
        `every` steps long but the first, which takes what is left over, so that the last
        (which the forward keeps whole, and nothing replays) is as long as the buffers."""
        return max(0, self.length - (self.segments - segment) * self.every)

    def lagged(self) -> dict[int, int]:
        """A checkpointed forward loop's replayed values that are read from another's
        buffer one row back, not buffered: a carry (slot -> its number) whose next value is
        replayed too, and no carry (which would be read back in turn)."""
        replayed = set(self.replayed)
        return {
            c: k
            for k, (c, n) in enumerate(zip(self.carries, self.nexts, strict=True))
            if c in replayed and n in replayed and n not in self.carries
        }

    def buffered(self) -> list[int]:
        """A checkpointed forward loop's replayed values that have a buffer."""
        lags = self.lagged()
        return [r for r in self.replayed if r not in lags]


def _no_forward(*_: Any, **__: Any) -> Any:
    raise AssertionError("a scan step runs in the executor's loop, never as a kernel")


def _no_infer(*_: Any, **__: Any) -> Meta:
    raise AssertionError("a scan step's results are typed when it is emitted")


def _cost(metas: list[Meta], out: Meta, *, body: Body) -> tuple[int, int]:
    """The body's planned cost once per step, each step also charged ITERATION_STEP_COST,
    and the stacked results written once (checkpoints and buffers too); a checkpointed
    reverse loop's replay (`replay_cost`)."""
    program = body.program
    assert program is not None, "a scan is priced after its body is planned"
    metas = body.b.metas
    nc, ny = len(body.carries), len(body.ys)
    wanted = body.wanted
    stacked = sum(
        size_of(metas[y]) for y, want in zip(body.ys, wanted[nc : nc + ny], strict=True) if want
    )
    kept = 0
    if body.every:
        checkpoints = wanted[nc + ny : nc + ny + nc]
        kept = body.segments * sum(
            size_of(metas[c]) for c, want in zip(body.carries, checkpoints, strict=True) if want
        )
        kept += body.every * sum(
            size_of(metas[r])
            for r, want in zip(body.buffered(), wanted[nc + ny + nc :], strict=True)
            if want
        )
    overhead = ITERATION_STEP_COST * len(program.steps) // BYTE_COST
    flops, moved = replay_cost(body)
    return (
        body.length * program.flops + flops,
        body.length * (program.bytes_moved + stacked + overhead) + kept + moved,
    )


def replay_cost(body: Body) -> tuple[int, int]:
    """What a checkpointed reverse loop adds to run its forward body again (flops,
    bytes): the forward body's planned cost once per step but those of the last segment,
    each also writing its buffers."""
    replay = body.replay
    if replay is None:
        return 0, 0
    program = replay.program
    assert program is not None, "a replay is priced after its body is planned"
    metas = body.b.metas
    steps = replay.length - replay.every
    buffered = sum(size_of(metas[r]) for r in replay.buffered())
    overhead = ITERATION_STEP_COST * len(program.steps) // BYTE_COST
    return steps * program.flops, steps * (program.bytes_moved + buffered + overhead)


SCAN = OpDef(
    name="scan",
    group="transforms",
    args=(),
    variadic=True,
    forward=_no_forward,
    infer=_no_infer,
    cost=_cost,
    # A result may be an argument itself (a carry of a loop of length 0).
    views_input=True,
    doc="A loop over the leading axis of its sequences (a step of a compiled program).",
)


# Where a carry's next value comes from, per carry: an array the outer program counts (a
# slice of a sequence, or a closure), one the body makes, or the value of carry j (>= 0).
OUTER, MADE = -1, -2


def executed_steps(program: Program) -> int:
    """The steps a run executes: a loop's body's as many times as it iterates (what the
    interpreter's overhead a step multiplies; the fast lane's bound). Counted once a
    program."""
    if program.executed_count is None:
        count = 0
        for step in program.steps:
            body = step.attrs.get("body") if step.op is SCAN else None
            if body is not None and body.program is not None:
                count += executed_steps(body.program) * max(body.length, 1)
            else:
                count += 1
        program.executed_count = count
    return program.executed_count


def compiled_steps(program: Program) -> int:
    """The steps XLA compiles: a loop's body once. Counted once a program."""
    if program.compiled_count is None:
        count = 0
        for step in program.steps:
            body = step.attrs.get("body") if step.op is SCAN else None
            count += 1 + (
                compiled_steps(body.program) if body is not None and body.program is not None else 0
            )
        program.compiled_count = count
    return program.compiled_count


def carry_sources(body: Body, program: Program) -> tuple[list[int], list[int]]:
    """Per carry, where its next value comes from (OUTER, MADE or a carry number), and the
    slot whose array it is (through steps that return their input, as detach does)."""
    made_by = {step.out: step for step in program.steps}
    carry_index = {slot: k for k, slot in enumerate(body.carries)}
    outer = set(body.xs) | set(body.closures)
    sources, roots = [], []
    for slot in body.nexts:
        while slot in made_by and made_by[slot].op.returns_input:
            slot = made_by[slot].args[0]  # type: ignore[assignment]
        roots.append(slot)
        sources.append(carry_index.get(slot, OUTER if slot in outer else MADE))
    return sources, roots


def emit_scan(
    b: Builder,
    body: Body,
    inits: list[Sym],
    xs: list[Sym],
    closures: list[Sym],
    hoist: bool = True,
) -> list[Sym]:
    """Append the scan step of `body` to `b`: its final carries (metas of the initial
    ones) and its stacked results, as Syms of `b`. With `hoist`, the body's steps that
    read nothing that changes from step to step run once, before the loop (their values
    become closures)."""
    if hoist:
        closures = _hoist(b, body, list(closures))
    metas = body.b.metas
    outs = [b.value(init.meta) for init in inits]
    outs += [b.value(Meta((body.length, *metas[y].shape), metas[y].dtype)) for y in body.ys]
    slots = tuple(o.slot for o in outs)
    b.steps.append(
        Step(
            SCAN,
            tuple(v.slot for v in (*inits, *xs, *closures)),
            {"body": body},
            slots[0],
            b.kind,
            b.origin,
            slots[1:],
        )
    )
    return outs


def _hoist(b: Builder, body: Body, closures: list[Sym]) -> list[Sym]:
    """Move the loop-invariant steps of `body` (that read only closures, literals and each
    other: a transposed weight, a constant) onto `b`; returns the closures extended with
    their values."""
    outer = dict(zip(body.closures, closures, strict=True))
    kept = []
    for step in body.steps:
        if step.op is SCAN or not all(a in outer for a in step.slots):
            kept.append(step)
            continue
        sym = b.value(body.b.metas[step.out])
        moved = Step(
            step.op,
            tuple(outer[a].slot if type(a) is int else a for a in step.args),
            step.attrs,
            sym.slot,
            b.kind,
            step.origin,
        )
        b.steps.append(moved)
        facts = body.b.facts.get(step)
        if facts is not None:
            b.facts[moved] = facts
        outer[step.out] = sym
        body.closures.append(step.out)
        closures.append(sym)
    body.steps = kept
    return closures


def stacked(b: Builder, step: Step, slots: list[int]) -> list[Sym]:
    """The stacked results of `step` for the body values `slots` (residuals a derivation
    reads), added to the step where it does not stack them yet."""
    body: Body = step.attrs["body"]
    metas = body.b.metas
    out = []
    for slot in slots:
        if slot in body.ys:
            result = step.outs[len(body.carries) + body.ys.index(slot)]
            out.append(b.syms[result])
            continue
        body.ys.append(slot)
        sym = b.value(Meta((body.length, *metas[slot].shape), metas[slot].dtype))
        step.more = (*step.more, sym.slot)
        out.append(sym)
    return out
