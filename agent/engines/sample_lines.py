"""Prometheus sample lines, read without prometheus_client where they are plain.

prometheus_client's parser walks a line a character at a time in Python, some 20 µs a
line: the ~50 lines the sampler reads from an engine's page, twice a second, were most
of an idle agent's CPU. A line in the plain form engines write (`name{label="value",…}
value [timestamp]`, single spaces, the three escapes of the format) is read here with
one regular expression; any other line goes to prometheus_client, whose verdict (the
sample, or the ValueError) is then the answer. The plain form is chosen so that both
readings agree on every line it admits; tests/test_engines.py holds it to that.
"""

from __future__ import annotations

import re
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], Any]

_LABEL_TEXT = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_PLAIN = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)"
    rf"(?:\{{((?:{_LABEL_TEXT}(?:,{_LABEL_TEXT})*,?)?)\}})?"
    r" ([^ \t]+)(?: -?[0-9]+)?"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def read_sample(line: str) -> list[Sample]:
    """The samples of one line of Prometheus text (a comment or blank line has none);
    ValueError, TypeError or IndexError as prometheus_client raises them."""
    plain = _plain(line.strip())
    return [plain] if plain is not None else read_page(line)


def read_page(text: str) -> list[Sample]:
    """Every sample of a page, through prometheus_client alone."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _plain(line: str) -> Sample | None:
    match = _PLAIN.fullmatch(line)
    if match is None:
        return None
    name, label_text, value_text = match.groups()
    labels: dict[str, str] = {}
    if label_text:
        for label, value in _LABEL.findall(label_text):
            # Reserved names (`__name__` among them) and repeated ones are the
            # library's to judge.
            if label.startswith("__") or label in labels:
                return None
            labels[label] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
    if "_" in value_text:
        return None
    try:
        value: Any = int(value_text)
    except ValueError:
        try:
            value = float(value_text)
        except ValueError:
            return None
    return name, labels, value


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group(0)]
