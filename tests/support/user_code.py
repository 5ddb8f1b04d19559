"""Shared by the tests (from tests/project/test_typing.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


USER_CODE = ROOT / "tests" / "typecheck" / "user_code.py"


# Mistakes appended to the copy, each with what mypy must say about its line.
MISTAKES = {
    'bad_operand = x + "a"': 'Argument 1 has incompatible type "str"',
    'bad_forward = f.gradients["x"]': '| None" is not indexable',  # /forward's Result
    "bad_method = x.summ()": '"Tensor" has no attribute "summ"',
    "bad_op = ge.softmaxx(w)": 'Module has no attribute "softmaxx"',
}
