"""Where a request computes, decided from cheap facts: the fast lane (the front process,
on its event loop, where a hop to another process would cost more than the work) or a
worker process.

The facts are what the front process can know without parsing a body: its size, the
length of its JSON document, its graph's id (sent, or found by the key of the graph's
bytes as sent), and what the computations of that graph reported when they ended (their
program's cost, steps and key, learned from every reply, the front's own and the
workers'). A graph nobody has run yet is placed by what its body shows: a small document
with few nodes (counted in the graph's bytes, not parsed) is compiled and run in the fast
lane; anything else goes to a worker, which reports back. The front never compiles,
loads or serialises a program in order to place a request.

When no compute slot is busy (the server idle but for this request), the front process
has nothing better to do than the work itself, and a hop to a worker and back (~1 ms: a
pipe each way, two processes woken) is all a worker would add: a known program then runs
here up to larger bounds (the idle lane: some 10 ms of work), unless it has been lowered
to XLA, which the front process does not load (its tier keeps the books of the runs, and
asks for the lowering: service/tier.py).

A new graph whose text (all but its numbers: service/literals.py) a computation reported
as lifted, a graph that differs from one seen before only in float literals, is placed by
that program's figures: into the fast lane when the front process has found where that
text's literals are written itself (a new literal then costs no compile), and into the
idle lane, which may compile it (twice: the second graph of a text finds its places),
when the server is idle; anything else goes to a worker, which lifts it.

The decision is a guess that the process which runs the request checks: the fast lane
runs a program only within its bounds (service/compute.py `Bounds`), and a request whose
program turns out past them goes to a worker after all.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradserve.service.compute import Bounds, Stats
from gradserve.service.programs import Lru
from gradserve.service.shm import SHM_MIN_BYTES

# A new graph runs in the fast lane when its document is this small, it has at most this
# many nodes (compiled in ~1 ms at most), and its body is this small (its data, on which
# its cost grows, unknown yet)...
NEW_MAX_DOCUMENT_BYTES = 16 * 1024
NEW_MAX_NODES = 64
NEW_MAX_BODY_BYTES = 64 * 1024
# ... a known one when its document is this small (parsed and decoded in ~1 ms at most; a
# binary body's tail is viewed, not parsed), its body at most this large, and its program
# within the fast lane's bounds.
KNOWN_MAX_DOCUMENT_BYTES = 64 * 1024
KNOWN_MAX_BODY_BYTES = 4 << 20
# The fast lane's bounds: a run of about a millisecond at most (cost units, as
# engine.graph.ir.Program's: a 2-layer MLP's training step, 256x32 -> 64 -> 10, is 1.5e7
# and runs in ~0.5 ms here; and each step costs the interpreter about a microsecond).
FAST_LANE = Bounds(nodes=NEW_MAX_NODES, cost=30_000_000, steps=2_000)
# The idle lane's: a known program of up to ~10 ms (a k-means of 10,000 points is 1.6e9
# units and 10 ms; 10,000 steps ~12 ms of the interpreter's overhead), whose planned peak
# the front process may hold, in a body below the size that goes to shared memory (for a
# worker) as it arrives.
IDLE_LANE = Bounds(
    nodes=NEW_MAX_NODES, cost=2_000_000_000, steps=10_000, peak_bytes=32 << 20, fast_lane=False
)
IDLE_MAX_BODY_BYTES = SHM_MIN_BYTES
# A graph whose text lifts may be compiled in the idle lane up to this many nodes (~10 ms:
# the 24-step cell, 266 nodes, compiles in ~6), once or twice per text and process.
LIFTED_MAX_NODES = 1024
LIFTED_LANE = Bounds(
    nodes=LIFTED_MAX_NODES,
    cost=IDLE_LANE.cost,
    steps=IDLE_LANE.steps,
    peak_bytes=IDLE_LANE.peak_bytes,
    fast_lane=False,
)
REMEMBERED = 8192  # graphs (by id), and texts, whose figures the front remembers


@dataclass(frozen=True)
class Facts:
    """What the front process knows of a request before it is parsed."""

    body_bytes: int
    document_bytes: int  # its JSON document (a binary body's header)
    graph_id: str | None  # sent, or the id of the graph's bytes seen before
    nodes: int | None  # nodes its graph's bytes show (a graph sent in the body)
    idle: bool = False  # no compute slot is busy
    text_key: str | None = None  # its graph's text's, where a graph of that text lifted
    text_here: bool = False  # the front process has found where that text's literals are


@dataclass(frozen=True)
class Known:
    """What the last computation of a graph reported (of whichever kind: a /forward's
    program costs less than the /backward's, and a guess too low is caught by the fast
    lane's bounds)."""

    program_key: str
    cost: int
    steps: int
    peak_bytes: int
    lowered: bool  # it has an XLA executable: a worker runs it


@dataclass(frozen=True)
class Lane:
    fast: bool  # in the front process
    affinity: str | None = None  # the program key a worker may hold
    bounds: Bounds = FAST_LANE  # what it may run there


WORKER = Lane(fast=False)


class Placement:
    """The front process's placement: its facts about graphs, learned from replies."""

    def __init__(self) -> None:
        self._known = Lru(REMEMBERED)  # graph id -> Known
        self._texts = Lru(REMEMBERED)  # text key -> Known: of a lifted graph of that text

    def known(self, graph_id: str) -> Known | None:
        """What the last computation of a graph reported, if the front remembers it."""
        return self._known.get(graph_id)  # type: ignore[no-any-return]

    def lifted_texts(self) -> bool:
        """Whether a graph of some text was reported lifted (new graphs are worth reading
        for their text)."""
        return len(self._texts) > 0

    def text(self, text_key: str) -> Known | None:
        """What the last lifted computation of a graph of this text reported."""
        return self._texts.get(text_key)  # type: ignore[no-any-return]

    def place(self, facts: Facts) -> Lane:
        known = None if facts.graph_id is None else self.known(facts.graph_id)
        if known is not None:
            key = known.program_key
            if (
                facts.document_bytes <= KNOWN_MAX_DOCUMENT_BYTES
                and facts.body_bytes <= KNOWN_MAX_BODY_BYTES
                and FAST_LANE.admits(known.cost, known.steps, known.peak_bytes)
            ):
                return Lane(True, affinity=key)
            if (
                facts.idle
                and not known.lowered
                and facts.body_bytes < IDLE_MAX_BODY_BYTES
                and IDLE_LANE.admits(known.cost, known.steps, known.peak_bytes)
            ):
                return Lane(True, affinity=key, bounds=IDLE_LANE)
            return Lane(False, affinity=key)
        text = None if facts.text_key is None else self.text(facts.text_key)
        if text is not None:
            return self._place_text(facts, text)
        if facts.document_bytes > NEW_MAX_DOCUMENT_BYTES:
            return WORKER
        if facts.nodes is not None:  # a graph in the body, new or unreported
            return Lane(
                fast=facts.nodes <= NEW_MAX_NODES and facts.body_bytes <= NEW_MAX_BODY_BYTES
            )
        # Sent by an id whose program nobody has reported on: it may be costly. Neither
        # a graph nor an id (or not JSON at all): the parse says what is wrong, at once.
        return WORKER if facts.graph_id is not None else Lane(fast=True)

    @staticmethod
    def _place_text(facts: Facts, text: Known) -> Lane:
        """A new graph of a text that lifts, by the figures of that text's program."""
        if (
            facts.text_here
            and facts.document_bytes <= KNOWN_MAX_DOCUMENT_BYTES
            and facts.body_bytes <= KNOWN_MAX_BODY_BYTES
            and FAST_LANE.admits(text.cost, text.steps, text.peak_bytes)
        ):
            return Lane(True)  # lifted here (compiled only if its literals are not new ones)
        if (
            facts.idle
            and not text.lowered
            and facts.body_bytes < IDLE_MAX_BODY_BYTES
            and IDLE_LANE.admits(text.cost, text.steps, text.peak_bytes)
        ):
            return Lane(True, bounds=LIFTED_LANE)
        return WORKER

    def learn(self, stats: Stats) -> None:
        """What a computation reported (a run, or a fast-lane request found misplaced). A
        program once lowered stays the workers' (a worker that could not load it, or found
        it slower in XLA, runs it interpreted: no worse than before)."""
        if (
            stats.graph_id is None
            or stats.program_key is None
            or stats.compute_cost is None
            or stats.steps is None
        ):
            return
        before = self.known(stats.graph_id)
        lowered = stats.lowered or (
            before is not None and before.lowered and before.program_key == stats.program_key
        )
        known = Known(
            stats.program_key,
            stats.compute_cost,
            stats.steps,
            stats.planned_peak_bytes or 0,
            lowered,
        )
        self._known.put(stats.graph_id, known)
        if stats.text_key is not None:
            self._texts.put(stats.text_key, known)
