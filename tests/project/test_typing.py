"""User code type-checks: mypy, strict, over tests/typecheck/user_code.py (the engine API,
the client and tracing, written as the README writes them) finds nothing, and over a copy
with a mistake a user could make finds exactly that mistake. The copy keeps the test able
to fail: were the engine's operators `Any` again, or a module not found (an unresolved
import is `Any` under `ignore_missing_imports`), the mistakes would pass unseen.

The library's own modules are followed for their types but not reported here
(`--follow-imports=silent`): tests/project/test_lint.py checks them under the project's settings.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.user_code import MISTAKES, ROOT, USER_CODE


def _mypy(*files: Path) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--no-incremental",
            *map(str, files),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result.stdout + result.stderr


def test_user_code_type_checks_and_mistakes_are_caught(tmp_path: Path) -> None:
    broken = tmp_path / "broken_user_code.py"
    broken.write_text(USER_CODE.read_text() + "\n" + "\n".join(MISTAKES) + "\n")
    first = USER_CODE.read_text().count("\n") + 2  # the line of the first mistake
    out = _mypy(USER_CODE, broken)  # one run for both: mypy's start is most of its time

    errors = re.findall(r"^(.+?):(\d+): error: (.*)$", out, re.M)
    assert not [e for e in errors if Path(e[0]).name == USER_CODE.name], out
    found = {int(line): message for path, line, message in errors if Path(path).name == broken.name}
    assert set(found) == set(range(first, first + len(MISTAKES))), out
    for (line, message), expected in zip(sorted(found.items()), MISTAKES.values(), strict=True):
        assert expected in message, (line, message)
