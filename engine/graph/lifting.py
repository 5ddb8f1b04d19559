"""Constant lifting: graphs that differ only in float literals share one compiled program.

Define-by-run records a new graph whenever a literal changes (a step size, a time, a
learning rate), and each such graph would be compiled anew: validated, differentiated,
planned and bound, for a program whose steps are the same but for one number. Here the
compiler keys a resolved graph by everything but its float literals' values (its
`shape`: ops, references, ids, attributes, integer and bool literals, the inputs' specs
and the request's flags), and a graph whose shape was compiled before takes that
program with its new literals put in: only the steps that hold one are bound again.

A float literal is lifted (it may take any value) when the program uses it only as
itself: every argument of a step that holds its value holds that very object, passed on
unchanged by the VJPs (`OpDef.lifts_literals`: `pow` computes with its exponent, so its
literals are not lifted). Any other literal is fixed: a graph whose fixed literal differs
is compiled, and its program becomes the template. Integer and bool literals decide
dtypes and shapes as often as not (`x ** 2`, an index, a flag), and a small int is one
object with every other of its value, so they are part of the shape, never lifted. So
the program a graph gets is, step for step, the one its own compile would give: the
same steps, plan and kernels, and the same bits.

Loops (`scan`) are not lifted: their bodies are compiled programs of their own.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from gradserve.engine.graph.executor import rebind
from gradserve.engine.graph.facts import literal_key
from gradserve.engine.graph.ir import Lit, Program, Step
from gradserve.engine.ops.registry import OpDef

TEMPLATES = 256  # shapes a process keeps a template for, at most
TEMPLATE_BYTES = 64 << 20  # and the programs' estimated bytes, at most


class GraphLiteral:
    """One float literal of a resolved graph: its Lit (whose value object the steps of its
    program hold) and the op it is an argument of (None: a transform's)."""

    __slots__ = ("lit", "op")

    def __init__(self, lit: Lit, op: OpDef | None) -> None:
        self.lit = lit
        self.op = op


class Template:
    """A program compiled from one graph of its shape, and where its float literals are.
    Literals that are one object (a Python float used twice) are one group; per group, the
    (step, argument) places that hold it, or None where it is fixed (a graph of this
    shape must have the same value there)."""

    __slots__ = ("group", "keys", "literals", "program", "sites")

    def __init__(self, program: Program, literals: Sequence[GraphLiteral]) -> None:
        self.program = program
        self.literals: Sequence[GraphLiteral] | None = literals  # until first instantiated
        self.group: list[int] = []
        self.sites: list[list[tuple[int, int]] | None] = []
        self.keys: list[Hashable] = []  # per group: its value's literal_key

    def _find_sites(self, literals: Sequence[GraphLiteral]) -> None:
        """Where the literals are: worked out when a second graph of the shape comes (a
        graph sent once pays nothing for it)."""
        self.group, self.sites = _sites(self.program.steps, literals)
        self.keys = [None] * len(self.sites)
        for k, literal in enumerate(literals):
            self.keys[self.group[k]] = literal_key(literal.lit.value)
        self.literals = None

    def instantiate(self, literals: Sequence[float]) -> Program | None:
        """The program of a graph of this shape with these literals' values, or None where
        a fixed one differs (or two of one group do). (Its `plan_ms` is the compiler's to
        set.)"""
        if self.literals is not None:
            self._find_sites(self.literals)
        if len(literals) != len(self.group):
            return None
        keys: list[Hashable] = [None] * len(self.sites)
        values: list[float | None] = [None] * len(self.sites)  # per group: a new value
        for k, value in enumerate(literals):
            key = literal_key(value)
            g = self.group[k]
            if keys[g] is None:
                keys[g] = key
                if key != self.keys[g]:
                    if self.sites[g] is None:
                        return None
                    values[g] = value
            elif keys[g] != key:
                return None
        steps = self.program.steps
        changed: dict[int, list[object]] = {}
        for g, new in enumerate(values):
            if new is None:
                continue
            for i, j in self.sites[g] or ():
                args = changed.get(i)
                if args is None:
                    args = changed[i] = list(steps[i].args)
                args[j] = Lit(new)
        program = copy.copy(self.program)
        if changed:
            program.steps = new_steps = list(steps)
            for i, args in changed.items():
                s = steps[i]
                new_steps[i] = Step(
                    s.op,
                    tuple(args),  # type: ignore[arg-type]
                    s.attrs,
                    s.out,
                    s.kind,
                    s.origin,
                    s.more,
                )
            program.run = rebind(program, self.program.run, sorted(changed))
        program.lifted = True
        return program


def _sites(
    steps: Sequence[Step], literals: Sequence[GraphLiteral]
) -> tuple[list[int], list[list[tuple[int, int]] | None]]:
    """Each literal's group (the literals that are one object), and per group the places
    in `steps` that hold that object, or None where it is fixed: an op computes with it,
    or some value of the program equals it without being it (a copy: where it came from
    is not known)."""
    group: list[int] = []
    sites: list[list[tuple[int, int]] | None] = []
    by_object: dict[int, int] = {}  # id of a value object -> its group
    by_key: dict[Hashable, list[int]] = {}  # a value -> the groups that have it
    for literal in literals:
        value = literal.lit.value
        op = literal.op
        g = by_object.get(id(value))
        if g is None:
            g = by_object[id(value)] = len(sites)
            sites.append([])
            by_key.setdefault(literal_key(value), []).append(g)
        if op is None or not op.lifts_literals:
            sites[g] = None
        group.append(g)

    def fix_equal(value: object) -> None:
        for g in by_key.get(literal_key(value), ()):
            sites[g] = None

    for i, step in enumerate(steps):
        for j, a in enumerate(step.args):
            if type(a) is Lit and type(a.value) is float:
                g = by_object.get(id(a.value))
                if g is not None:
                    place = sites[g]
                    if place is not None:
                        place.append((i, j))
                else:
                    fix_equal(a.value)
        for v in step.attrs.values():
            if type(v) is float:
                fix_equal(v)
    return group, sites


class Templates:
    """A process's templates, by shape: the most recently used `limit` of them, within
    `max_bytes` of programs (their estimated bytes: a template keeps its program alive
    after the program cache lets it go)."""

    def __init__(self, limit: int = TEMPLATES, max_bytes: int = TEMPLATE_BYTES) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.bytes = 0
        self._held: OrderedDict[Hashable, Template] = OrderedDict()
        self._lock = threading.Lock()

    def instantiate(self, shape: Hashable, literals: Sequence[float]) -> Program | None:
        """The program of a graph of `shape` with its float literals' values `literals`
        (in the graph's order), from its template, or None."""
        with self._lock:
            template = self._held.get(shape)
            if template is None:
                return None
            self._held.move_to_end(shape)
        return template.instantiate(literals)

    def learn(self, shape: Hashable, literals: Sequence[GraphLiteral], program: Program) -> None:
        """`program`, just compiled from a graph of `shape`, is its shape's template."""
        size = program.estimated_bytes
        if size > self.max_bytes:
            return
        template = Template(program, literals)
        with self._lock:
            old = self._held.pop(shape, None)
            if old is not None:
                self.bytes -= old.program.estimated_bytes
            self._held[shape] = template
            self.bytes += size
            while len(self._held) > self.limit or self.bytes > self.max_bytes:
                _, out = self._held.popitem(last=False)
                self.bytes -= out.program.estimated_bytes

    def __len__(self) -> int:
        return len(self._held)
