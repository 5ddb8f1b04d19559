"""Rematerialization: a backward over its memory budget recomputes forward values in the
backward instead of keeping them from the forward, and the planner proves the new peak.

The method: Chen et al.'s checkpointed segments (2016), generalised to any DAG by cutting
the forward where the values it keeps alive are fewest, laid out from the end so that it
adds the least compute a single recomputation allows, and checked by the exact planner.

- Cuts. A cut after forward step c keeps the values the forward still reads after c (its
  live frontier: on a chain, one value; on a residual net, the block's input). What the
  forward makes after a cut, up to the next one (a segment), can then be recomputed from
  the cut's values, the request's inputs and the values that are never recomputed: a
  segment's values are dropped after their last forward use, and recomputed just before
  the first backward step that needs them (reading the kept values and each other, in
  slots of their own), so that the backward of a segment holds that segment and the cuts
  below it. The cut is placed, within the reach of a segment, where the frontier is
  smallest.
- Layout. At the forward's end the program holds the cuts and the last segment, which is
  never recomputed; while the backward runs down segment k it holds the cuts below k and
  segment k. So every segment may hold the resident bytes B less the bytes of the cuts
  below it: the segments are laid out from the end, the last one the longest, each one
  below longer by the cut between them. Every value the backward reads that is not held
  at the forward's end must be recomputed at least once, so for the resident bytes B this
  layout recomputes the least a single recomputation allows (on a chain of n values of
  which B fit: n - B of them, once each, with B down to about √(2n)). Chen's forward greedy
  recomputes more (its last segment is whatever is left over), multi-level schemes
  (revolve, Checkmate's solver) reach less memory for more compute and a solver; a greedy
  such as DTR decides as it runs, where here everything is decided before anything runs.
- Search. The peak of the rewritten program is planned exactly (the same planner, with
  the recompute steps as ordinary steps, so buffer reuse never takes a buffer a later
  step reads), for a handful of B chosen by a secant search towards the budget: the
  plan whose peak fits with the least recomputation wins. When none fits, a few plans
  that do not depend on the budget are tried for the smallest peak: the layouts of the
  least B that lays out (found by bisection on the layout alone, which is cheap) and a
  little more, and every value recomputed where first needed (the least where the
  backward's own peak comes after its first steps). The smallest of their peaks is what
  the request would need, and a budget of it fits.

What is never recomputed: the request's inputs, outputs and gradients, held values, what
a `scan` step makes (a loop is a unit: its body is planned per step and never duplicated;
its own checkpointing is the loop's), and any value that one of those is (a `detach` of
it). The recomputed steps are the forward's own steps (op, arguments and attributes), so
their values and the gradients are bit for bit those without recomputation.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, MutableMapping

from gradserve.engine.errors import MemoryBudgetError
from gradserve.engine.graph.facts import Facts, facts_of, size_of
from gradserve.engine.graph.ir import BACKWARD, RECOMPUTE, Program, Step
from gradserve.engine.graph.plan import plan
from gradserve.engine.graph.scan import SCAN

# Exact plans tried towards the budget (each is linear in the program's size), and the
# ones tried for the smallest peak when none fits.
SEARCH_PLANS = 5
LEAST_PLANS = 3
# Layouts worked out per search for the least resident bytes (each is linear as well),
# and walks per layout while the cuts' bytes are guessed.
BISECTIONS = 24
GUESSES = 8


def rematerialize(
    program: Program, budget: int, *, ufuncs: bool, facts: MutableMapping[Step, Facts]
) -> Program:
    """A program computing what the planned backward `program` computes within `budget`
    bytes, forward values recomputed in its backward, planned; raises MemoryBudgetError,
    naming the smallest peak it reached, when none fits. `ufuncs` as the planner takes it;
    `facts` (the steps' facts) gains the recompute steps'."""
    search = _Search(program, ufuncs, facts)
    best = search.run(budget)
    if best is None:
        path = "no_grad" if program.no_grad else "grad"
        least = search.least
        raise MemoryBudgetError(
            f"the planned peak memory of this request is {program.planned_peak_bytes} bytes; "
            f"the {path} budget is {budget} bytes, and it would need at least {least} bytes "
            "even recomputing forward values in the backward",
            planned_bytes=least,
            budget_bytes=budget,
        )
    best.peak_without_recompute = program.planned_peak_bytes
    return best


class _Forward:
    """What the layout reads of a planned program: per forward step (its position), the
    bytes of its result if the backward reads it and it may be recomputed (`saved`), that
    result's last read in the forward (`last`), and the bytes the forward holds across
    the point after it that may be recomputed (`frontier`)."""

    def __init__(self, program: Program, facts: Mapping[Step, Facts]) -> None:
        steps, metas = program.steps, program.metas
        nf = next((i for i, s in enumerate(steps) if s.kind == BACKWARD), len(steps))
        self.program, self.nf = program, nf
        made = [-1] * len(metas)  # the forward step that makes a slot (not a loop's results)
        root = list(range(len(metas)))  # the slot whose array a slot is (detach: its input's)
        read = [-1] * len(metas)  # per root: its last read in the forward
        for p in range(nf):
            step = steps[p]
            for a in step.slots:
                read[root[a]] = p
            if step.op is SCAN:
                continue
            made[step.out] = p
            f = facts.get(step) or facts_of(step, metas)
            if f.returns_input:
                root[step.out] = root[step.args[0]]  # type: ignore[index]
        fixed = {
            root[s]
            for s in (
                *program.inputs.values(),
                *program.grad_inputs.values(),
                *(s for _, s in program.outputs),
                *(s for _, s in program.gradients),
                *program.held,
            )
        }
        self.made, self.root = made, root
        # May be recomputed: made by a forward step other than a loop, and its array not
        # one that stays (nor a loop's, nor an input's).
        self.free = free = [
            made[s] >= 0 and made[root[s]] >= 0 and root[s] not in fixed for s in range(len(metas))
        ]
        # The backward's first read of each forward value.
        first: dict[int, int] = {}
        for j in range(nf, len(steps)):
            for a in steps[j].slots:
                if made[a] >= 0 and a not in first:
                    first[a] = j
        self.first = first
        saved_roots = {root[a] for a in first if free[a]}
        self.saved = saved = [0] * nf
        self.last = [-1] * nf
        spans = [0] * (nf + 1)
        for p in range(nf):
            out = steps[p].out
            if steps[p].op is SCAN or root[out] != out or not free[out]:
                continue
            size = size_of(metas[out])
            self.last[p] = read[out]
            if out in saved_roots:
                saved[p] = size
            if read[out] > p:
                spans[p] += size
                spans[read[out]] -= size
        frontier = [0] * nf
        live = 0
        for p in range(nf):
            live += spans[p]
            frontier[p] = live
        self.frontier = frontier
        self.positions = [p for p in range(nf) if saved[p]]  # ascending
        self.total = sum(saved)
        self.smallest = min((saved[p] for p in self.positions), default=0)

    def layout(self, resident: int) -> list[int] | None:
        """The cuts (forward positions, descending) for `resident` bytes of kept values,
        or None where they do not lay out: a segment may hold `resident` less the cuts
        below it, which are first guessed, then taken from the layout, until they hold."""
        guess = 0
        for _ in range(GUESSES):
            found = self._walk(resident, guess)
            if found is None:
                return None
            cuts, placed = found
            if placed > resident:
                return None
            if placed <= guess:
                return cuts
            guess = placed
        return None

    def _walk(self, resident: int, guess: int) -> tuple[list[int], int] | None:
        """The segments from the forward's end down, each one as long as it may be: its
        saved bytes within `resident` less the cuts below it (`guess` less those placed
        above); the cuts and their bytes, or None where one value alone does not fit."""
        saved, last, frontier, positions = self.saved, self.last, self.frontier, self.positions
        cuts: list[int] = []
        placed = temp = 0
        hi = self.nf - 1  # the segment's top (the cut above it, or the forward's last step)
        k = len(positions) - 1
        while k >= 0:
            p = positions[k]
            if last[p] > hi:  # the cut above keeps it
                k -= 1
                continue
            s = saved[p]
            if temp + s <= resident - guess + placed:
                temp += s
                k -= 1
                continue
            if p == hi:  # (nothing above it in the segment to cut away)
                return None
            window = frontier[p:hi]  # a cut at c in [p, hi): the least frontier, lowest first
            c = p + window.index(min(window))
            cuts.append(c)
            placed += frontier[c]
            hi, temp = c, 0
            k = bisect_right(positions, c) - 1
        return cuts, placed

    def kept(self, cuts: list[int]) -> set[int]:
        """The roots kept from the forward: what the backward reads above the top cut (the
        last segment), and each cut's frontier."""
        steps, saved, last = self.program.steps, self.saved, self.last
        ascending = sorted(cuts)
        top = ascending[-1] if ascending else -1
        kept = set()
        for p in range(self.nf):
            if saved[p] and p > top:
                kept.add(steps[p].out)
            elif last[p] > p:  # live across a cut?
                i = bisect_left(ascending, p)
                if i < len(ascending) and ascending[i] < last[p]:
                    kept.add(steps[p].out)
        return kept


class _Search:
    """Rewritten programs for layouts of several resident sizes, planned exactly."""

    def __init__(self, program: Program, ufuncs: bool, facts: MutableMapping[Step, Facts]) -> None:
        self.program, self.ufuncs, self.facts = program, ufuncs, facts
        self.forward = _Forward(program, facts)
        self.least = program.planned_peak_bytes  # the smallest peak reached (when none fits)
        self.plans: dict[tuple[int, ...], Program] = {}  # by the roots kept

    def run(self, budget: int) -> Program | None:
        """The plan within `budget` that recomputes least, or None."""
        fw = self.forward
        if not fw.total:
            return None
        floor = self._least_resident()
        fits: list[Program] = []
        if floor is not None:  # a secant search on the resident bytes towards the budget
            base = self.program.planned_peak_bytes - fw.total  # (what is never recomputed)
            over = fw.total  # the least resident bytes known not to fit
            resident = min(max(budget - base, floor), fw.total - fw.smallest)
            for _ in range(SEARCH_PLANS):
                cuts = fw.layout(resident)
                if cuts is None:
                    break
                program = self._plan(fw.kept(cuts))
                step = budget - program.planned_peak_bytes
                if step >= 0:
                    fits.append(program)
                    nxt = min(resident + step, over - fw.smallest)  # (less to recompute)
                else:
                    over = min(over, resident)
                    if resident <= floor:
                        break
                    nxt = max(resident + step, floor)
                if abs(nxt - resident) < max(fw.smallest, 1):
                    break
                resident = nxt
        if not fits:
            peaks = [self.program.planned_peak_bytes]
            for kept in self._least_layouts(floor):
                program = self._plan(kept)
                peaks.append(program.planned_peak_bytes)
                if program.planned_peak_bytes <= budget:
                    fits.append(program)
            self.least = min(peaks)
        return min(fits, key=lambda p: (p.recompute_cost, p.planned_peak_bytes), default=None)

    def _least_resident(self) -> int | None:
        """The least resident bytes that lay out (bisection: the layout alone is cheap)."""
        fw = self.forward
        lo, hi = 0, fw.total
        if fw.layout(hi) is None:
            return None
        for _ in range(BISECTIONS):
            if hi - lo <= max(fw.smallest // 4, 1):
                break
            mid = (lo + hi) // 2
            if fw.layout(mid) is None:
                lo = mid
            else:
                hi = mid
        return hi

    def _least_layouts(self, floor: int | None) -> list[set[int]]:
        """The roots kept by the layouts tried for the smallest peak, whatever the budget
        (so that a budget of the smallest peak they reach fits): a few resident sizes from
        the least that lays out, and none kept (each value recomputed where the backward
        first needs it: the least where the backward's peak is past its first steps)."""
        fw = self.forward
        layouts: list[set[int]] = [set()]
        for k in range(LEAST_PLANS if floor is not None else 0):
            cuts = fw.layout(floor + floor * k // 8)  # type: ignore[operator]
            if cuts is not None:
                layouts.append(fw.kept(cuts))
        return layouts

    def _plan(self, kept: set[int]) -> Program:
        """The program rewritten to keep `kept`, planned (once per set)."""
        key = tuple(sorted(kept))
        program = self.plans.get(key)
        if program is None:
            program = self.plans[key] = self._rewrite(kept)
        return program

    def _rewrite(self, kept: set[int]) -> Program:
        """The program with every forward value the backward reads whose array is not
        `kept` (roots) recomputed, with what it reads that is not kept either: each just
        before the first backward step that needs it, in a slot of its own; planned."""
        program, facts, fw = self.program, self.facts, self.forward
        steps, metas = program.steps, program.metas
        made, root, free = fw.made, fw.root, fw.free
        need: dict[int, int] = {}  # recomputed slot -> the backward step it comes before
        heap: list[tuple[int, int]] = []
        for a, j in fw.first.items():
            if free[a] and root[a] not in kept:
                need[a] = j
                heap.append((-made[a], a))
        heapq.heapify(heap)
        order = []
        while heap:  # latest first: a value's readers are all placed when it is
            _, v = heapq.heappop(heap)
            order.append(v)
            j = need[v]
            for a in steps[made[v]].slots:
                if free[a] and root[a] not in kept:
                    if a not in need:
                        need[a] = j
                        heapq.heappush(heap, (-made[a], a))
                    elif j < need[a]:
                        need[a] = j
        order.reverse()  # in forward order
        copy = {v: len(metas) + k for k, v in enumerate(order)}
        before: dict[int, list[int]] = {}
        for v in order:
            before.setdefault(need[v], []).append(v)
        out = steps[: fw.nf]
        for j in range(fw.nf, len(steps)):
            for v in before.get(j, ()):
                out.append(_moved(steps[made[v]], copy, copy[v], RECOMPUTE, facts))
            step = steps[j]
            if any(a in copy for a in step.slots):
                step = _moved(step, copy, step.out, step.kind, facts)
            out.append(step)
        new = Program(
            metas=[*metas, *(metas[v] for v in order)],
            steps=out,
            inputs=program.inputs,
            grad_inputs=program.grad_inputs,
            outputs=program.outputs,
            gradients=program.gradients,
            requires_grad=program.requires_grad,
            grad_fn=program.grad_fn,
            no_grad=program.no_grad,
            backward=program.backward,
            held=set(program.held),
        )
        plan(new, ufuncs=self.ufuncs, facts=facts)
        return new


def _moved(
    step: Step, copy: dict[int, int], out: int, kind: str, facts: MutableMapping[Step, Facts]
) -> Step:
    """`step` reading the recomputed copies, writing `out`, as a step of `kind` (with its
    facts: the same signature)."""
    new = Step(
        step.op,
        tuple(copy.get(a, a) if type(a) is int else a for a in step.args),
        step.attrs,
        out,
        kind,
        step.origin,
        step.more,
    )
    f = facts.get(step)
    if f is not None:
        facts[new] = f
    return new
