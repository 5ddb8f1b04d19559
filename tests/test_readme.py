"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_engine_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    engine_blocks = [b for b in blocks if b.startswith("import gradserve.engine as ge")]
    assert engine_blocks, "the README has no engine example"
    for block in engine_blocks:
        namespace: dict[str, object] = {}
        exec(compile(block, str(README), "exec"), namespace)  # our own README, not user input
        assert namespace["z"].item() == -5.0  # type: ignore[attr-defined]
        assert namespace["x"].grad.item() == 4.0  # type: ignore[attr-defined]
        assert namespace["b"].tolist() == [41.0]  # type: ignore[attr-defined]


def test_every_setting_has_a_row_in_the_settings_table() -> None:
    from gradserve.service.settings import Settings

    text = README.read_text()
    missing = [name for name in Settings.model_fields
               if f"| `GRADSERVE_{name.upper()}` |" not in text]
    assert not missing, f"settings without a row in the README's table: {missing}"
