"""A YAML document the router runs on (its policy, its auth file) and its reloads from
SIGHUP and the admin API: a bad document never replaces a good one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Generic, TypeVar

from prometheus_client import Counter

from protocol.logs import quote

T = TypeVar("T")


class DocumentError(ValueError):
    """A document that cannot be loaded; `errors` holds one message per problem."""

    label = "document"

    def __init__(self, errors: list[str]) -> None:
        super().__init__(f"invalid {self.label}: " + "; ".join(errors))
        self.errors = errors


def read_document(path: str | Path, error: type[DocumentError], noun: str) -> str:
    """A document file's text; one that cannot be read is `error`, naming the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error([f"{path}: cannot read {noun} ({exc})"]) from None


class DocumentStore(Generic[T]):
    """`kind` names the log events (`<kind>_reloaded`, `<kind>_reload_failed`) and the
    messages; a subclass parses (raising an error with `.errors`) and installs."""

    kind: str
    # What the document and its file are called in messages ("policy", "policy file").
    noun: str
    title: str

    def __init__(self, reloads: Counter, log: logging.Logger, path: str | None) -> None:
        self.reloads = reloads
        self.log = log
        self.path = path

    def parse(self, text: str) -> T:
        """The document in `text`, or DocumentError naming every problem."""
        raise NotImplementedError

    def install(self, value: T) -> str:
        """Make `value` the running document; what the reload line says about it."""
        raise NotImplementedError

    def replace(self, text: str, origin: str) -> list[str]:
        """Validate and install `text`; the errors, empty on success."""
        try:
            value = self.parse(text)
        except DocumentError as exc:
            return self.reject(exc.errors, origin)
        summary = self.install(value)
        self.reloads.labels("success").inc()
        self.log.info("%s_reloaded origin=%s %s", self.kind, origin, summary)
        return []

    def reject(self, errors: list[str], origin: str) -> list[str]:
        """Count and log a reload that failed before or during validation; `errors`."""
        self.reloads.labels("failure").inc()
        self.log.warning(
            "%s_reload_failed origin=%s errors=%s", self.kind, origin, quote("; ".join(errors))
        )
        return errors

    def reload_file(self) -> list[str]:
        """Re-read the file (SIGHUP); the errors, empty on success."""
        if self.path is None:
            return self.without_file()
        try:
            # Not UTF-8 must be a rejected reload, not an exception in the signal task.
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return self.reject([f"{self.path}: cannot read {self.title} ({exc})"], "file")
        return self.replace(text, "file")

    def without_file(self) -> list[str]:
        """SIGHUP on a router started without the file."""
        return []
