"""MkDocs hook: the configuration page's table of settings, generated from the settings
themselves (service/settings.py: each field's default, bounds and description), where the
page says `{{ settings_table }}`."""

from __future__ import annotations

from typing import Any

from pydantic.fields import FieldInfo

from gradserve.service.settings import Settings

MARKER = "{{ settings_table }}"
_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def shown_default(name: str, field: FieldInfo) -> str:
    """A setting's default as the table shows it: the value, and a byte size in binary
    units; unset (None) and empty as words (the description says what they mean)."""
    value = field.default
    if value is None:
        return "unset"
    if value == ():
        return "empty"
    text = f"`{value:g}`" if isinstance(value, float) else f"`{value}`"
    if isinstance(value, int) and not isinstance(value, bool) and "bytes" in name:
        per_s = "/s" if name.endswith("_s") else ""
        for unit, label in _UNITS:
            if value >= unit and value % unit == 0:
                return f"{text} ({value // unit} {label}{per_s})"
    return text


def settings_table() -> str:
    rows = ["| variable | default | what |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        rows.append(
            f"| `GRADSERVE_{name.upper()}` | {shown_default(name, field)} | {field.description} |"
        )
    return "\n".join(rows)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return markdown.replace(MARKER, settings_table()) if MARKER in markdown else markdown
