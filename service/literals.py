"""Constant lifting read off a graph's bytes: a new literal costs no parse of the graph.

Define-by-run sends a new graph whenever a literal changes (a step size, a time), and
engine.graph.lifting gives that graph the program of its shape with its own literals put
in. That still validates and resolves the graph as sent, about as long as the run of a
small program (the recurrent cell: ~2 ms). Here the graph's bytes are split into their
numbers (JSON numbers, and the numbers written in `expr` strings) and everything else,
the text: a graph whose text was seen before, and whose numbers differ only where the
literals it lifts are written, takes the lifted program straight from the numbers.

Which number is which literal is found once per text (and per input specs and flags), when
the second graph of the text is compiled: its float numbers that equal a literal's value
are each moved to a value of their own (a sentinel, a few ulps away), the graph so written
is resolved again, and a literal that then holds a number's sentinel (and held that
number's value before) is that number's. Nothing else is taken on trust: the resolved
shape must be unchanged by the sentinels, every other literal must keep its value, and
every number that is not a literal's must come again as written, or the graph goes the
whole way (parsed, validated, resolved and compiled), as any graph does.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import xxhash

from gradserve.engine.graph.facts import literal_key
from gradserve.service.programs import Lru

# The next number of a graph's JSON: after what holds none (anything but a quote, a digit
# or a minus sign, and whole strings, unless one is an `expr` member's name), an `expr`
# member's value (its numbers are read too) or a JSON number.
_STRING = rb'[^"\\]*(?:\\.[^"\\]*)*"'
# (Possessive: what holds no number is never read twice; matched from where the last match
# ended, to the end, whose empty match ends the scan.)
_TOKENS = re.compile(
    rb'(?:[^"0-9-]++|"(?!expr"\s*:)' + _STRING + rb")*+"
    rb'(?:"expr"\s*:\s*"(' + _STRING[:-1] + rb')"'
    rb"|(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)|\Z)"
)
# A number written in an expression (Python's literals, unsigned), not part of a name
# (`x1`), an attribute, or a longer number (`1_000`, `0x1f`, `2j`).
_EXPR_NUMBERS = re.compile(
    rb"(?<![\w.])((?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?)(?![\w.])"
)
_FLOAT_MARKS = frozenset(b".eE")
TEXTS = 1024  # texts whose literal places a process remembers
ULPS = 2**-40  # how far a sentinel is from the value it stands for (relative)


@dataclass(frozen=True)
class Split:
    """A graph's bytes as `split_numbers` reads them: the key of its text (all but its numbers),
    and its numbers as written."""

    text_key: str
    numbers: list[bytes]


def split_numbers(graph: bytes) -> Split:
    """The graph's numbers, in order, and the key of the rest of its bytes."""
    numbers: list[bytes] = []
    text = xxhash.xxh3_128()
    at = 0
    for start, end in _number_spans(graph):
        text.update(graph[at:start])
        text.update(b"\x00")
        numbers.append(graph[start:end])
        at = end
    text.update(graph[at:])
    return Split(text.hexdigest(), numbers)


def _number_spans(graph: bytes) -> Iterator[tuple[int, int]]:
    """Where the graph's numbers are written: (start, end) of each, in order."""
    at = 0
    while (m := _TOKENS.match(graph, at)) is not None and m.end() > at:
        if m.start(2) >= 0:
            yield m.start(2), m.end(2)
        elif m.start(1) >= 0:
            base = m.start(1)
            for e in _EXPR_NUMBERS.finditer(m.group(1)):
                yield base + e.start(1), base + e.end(1)
        at = m.end()


def _is_float(number: bytes) -> bool:
    return not _FLOAT_MARKS.isdisjoint(number)


@dataclass(frozen=True)
class Sites:
    """Where one text's lifted literals are written: per literal (in the resolved graph's
    order), the index of the number that gives its value, or None (a literal that no
    float number moves: its value stays `values`'); and the numbers as written in the graph
    it was found on (each one that gives no literal must come again as written)."""

    shape: Hashable  # the lifting shape (engine.graph.compiler.lifting_shape)
    values: tuple[float, ...]
    number_of: tuple[int | None, ...]
    numbers: tuple[bytes, ...]

    @functools.cached_property
    def lifted(self) -> frozenset[int]:
        """The numbers that give a literal."""
        return frozenset(i for i in self.number_of if i is not None)

    def literals(self, numbers: Sequence[bytes]) -> list[float] | None:
        """The literals' values of a graph of this text with `numbers`, or None where it
        differs elsewhere than in a lifted literal (or writes one as an integer, or not as
        a finite number)."""
        if len(numbers) != len(self.numbers):
            return None
        new: dict[int, float] = {}
        for i, (number, was) in enumerate(zip(numbers, self.numbers, strict=True)):
            if number == was:
                continue
            if i not in self.lifted or not _is_float(number):
                return None
            value = float(number)
            if not math.isfinite(value):
                return None
            new[i] = value
        if not new:
            return list(self.values)
        return [
            v if i is None or i not in new else new[i]
            for v, i in zip(self.values, self.number_of, strict=True)
        ]


Resolve = Callable[[bytes], "tuple[Hashable, list[float]] | None"]


def find_sites(graph: bytes, found: Split, resolve: Resolve) -> Sites | None:
    """Where the literals of `graph` (split as `found`) are written, or None where that
    cannot be told (see the module's docstring). `resolve`: a graph's bytes to its lifting
    shape and literals' values (None if it has none, or is not valid)."""
    lifting = resolve(graph)
    if lifting is None:
        return None
    shape, values = lifting
    numbers = found.numbers
    literal_keys = {literal_key(v) for v in values}
    taken = literal_keys | {literal_key(float(n)) for n in numbers}
    sentinels: dict[int, float] = {}  # number index -> its sentinel
    for i, number in enumerate(numbers):
        if not _is_float(number) or literal_key(float(number)) not in literal_keys:
            continue
        value = float(number)
        step = max(abs(value), 1.0) * ULPS
        sentinel = value + step * (i + 1)
        while literal_key(sentinel) in taken:
            sentinel += step
        taken.add(literal_key(sentinel))
        sentinels[i] = sentinel
    if not sentinels:
        return None
    lifting_moved = resolve(_rewrite(graph, sentinels))
    if lifting_moved is None or lifting_moved[0] != shape or len(lifting_moved[1]) != len(values):
        return None
    by_sentinel = {literal_key(s): i for i, s in sentinels.items()}
    number_of: list[int | None] = []
    for value, moved_value in zip(values, lifting_moved[1], strict=True):
        at = by_sentinel.get(literal_key(moved_value))
        if at is not None and literal_key(float(numbers[at])) == literal_key(value):
            number_of.append(at)
        elif literal_key(moved_value) == literal_key(value):
            number_of.append(None)
        else:  # (a literal computed from numbers: not one of them as written)
            return None
    if all(i is None for i in number_of):
        return None
    return Sites(shape, tuple(values), tuple(number_of), tuple(numbers))


def _rewrite(graph: bytes, sentinels: dict[int, float]) -> bytes:
    """`graph` with the numbers of `sentinels` written as their sentinels."""
    out: list[bytes] = []
    at = 0
    for i, (start, end) in enumerate(_number_spans(graph)):
        if i in sentinels:
            out.append(graph[at:start])
            out.append(repr(sentinels[i]).encode())
            at = end
    out.append(graph[at:])
    return b"".join(out)


class TextSites:
    """A process's literal places, by text and the input specs and flags the program key
    holds (a text found to have none is remembered too), and the texts some were found
    for: the most recently used `limit` of each."""

    def __init__(self, limit: int = TEXTS) -> None:
        self._sites = Lru(limit)  # key -> Sites, or None: none to be found
        self._texts = Lru(limit)  # text key -> True: some found
        self._lock = threading.Lock()

    def known(self, key: str) -> bool:
        with self._lock:
            return key in self._sites

    def seen(self, text_key: str) -> bool:
        """Whether places were found for this text (with some specs and flags)."""
        with self._lock:
            return self._texts.get(text_key) is not None

    def literals(self, key: str, numbers: Sequence[bytes]) -> tuple[Hashable, list[float]] | None:
        """The lifting shape and literals' values of a graph of a known text, or None."""
        with self._lock:
            sites: Sites | None = self._sites.get(key)
        if sites is None:
            return None
        values = sites.literals(numbers)
        return None if values is None else (sites.shape, values)

    def learn(self, key: str, text_key: str, sites: Sites | None) -> None:
        with self._lock:
            self._sites.put(key, sites)
            if sites is not None:
                self._texts.put(text_key, True)
