"""Durations as operators write them on the command line: `500ms`, `90s`, `2m`, `24h`."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds in `text`; a bare number is seconds; compound values like `1m30s` add up."""
    text = text.strip()
    if not text:
        raise ValueError("empty duration")
    try:
        value = float(text)
    except ValueError:
        pos = 0
        value = 0.0
        for m in _PART.finditer(text):
            if m.start() != pos:
                break
            value += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if pos != len(text):
            raise ValueError(f"invalid duration {text!r} (use e.g. 500ms, 90s, 2m, 24h)") from None
    if value < 0:
        raise ValueError(f"negative duration {text!r}")
    return value
