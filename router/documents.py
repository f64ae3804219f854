"""A YAML document the router runs on (its policy, its auth file): its parsing, the
validation both loaders share, and its reloads from SIGHUP and the admin API: a bad
document never replaces a good one.

Validation collects every error with the path of the offending field, because an
operator fixing a rejected file should not have to reload it once per mistake.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import reprlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import yaml
from prometheus_client import Counter

from protocol.files import read_regular
from protocol.logs import quote

T = TypeVar("T")

# A document file larger than this is refused unread (the admin API takes 1 MiB).
MAX_FILE_BYTES = 16 * 1024 * 1024
# Errors listed per refused document: every one matters to whoever fixes a file, but a
# document of a hundred thousand bad keys must not make a reply of megabytes.
MAX_ERRORS = 100
# A value quoted in an error message: its beginning. YAML aliases can make a small
# document hold a structure whose full repr is gigabytes.
_MORE_ERRORS = f"(more errors not listed: the first {MAX_ERRORS} are above)"
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxdict, _SHOWN.maxlist, _SHOWN.maxtuple = 2, 4, 4, 4
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 80, 80, 40


class DocumentError(ValueError):
    """A document that cannot be loaded; `errors` holds one message per problem."""

    label = "document"

    def __init__(self, errors: list[str]) -> None:
        errors = capped(errors)
        super().__init__(f"invalid {self.label}: " + "; ".join(errors))
        self.errors = errors


def capped(errors: list[str]) -> list[str]:
    """The first MAX_ERRORS of `errors`, and a line saying there were more."""
    if len(errors) <= MAX_ERRORS:
        return errors
    return [*errors[:MAX_ERRORS], _MORE_ERRORS]


class YamlInvalid(ValueError):
    """Text that is not one YAML document; `errors` holds the reason."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def parse_yaml(text: str) -> tuple[object, list[str]]:
    """The YAML document, and its duplicate keys as errors; YamlInvalid when unreadable."""
    try:
        try:
            return _parse(text, _LOADER)
        except yaml.YAMLError:
            if _LOADER is yaml.SafeLoader or len(text) > PURE_PARSER_BYTES:
                raise
            # PyYAML's own parser again, for its messages (what the examples quote),
            # and for whatever it reads that libyaml does not; only on a failure, and
            # only for a document it reads in milliseconds.
            return _parse(text, yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise YamlInvalid([yaml_error(exc)]) from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise YamlInvalid(["invalid YAML: collections nested too deeply"]) from None
    except Exception as exc:  # PyYAML's constructors fail on some tagged scalars (`!!int`)
        raise YamlInvalid([f"invalid YAML: {type(exc).__name__}: {exc}"]) from None


def parse_document(text: str, error: type[DocumentError]) -> tuple[object, list[str]]:
    """`parse_yaml` for a loader: text that is not YAML is `error` with the reason."""
    try:
        return parse_yaml(text)
    except YamlInvalid as exc:
        raise error(exc.errors) from None


# libyaml's parser where PyYAML was built with it: a 1 MiB document of 100,000 keys took
# the pure-Python one 5 s of the router's only thread.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Past this size a document libyaml refused is not parsed again by the pure-Python parser
# for its message: a 1 MiB one took it 5.6 s of that thread to fail again. A policy or
# auth file is a few KiB.
PURE_PARSER_BYTES = 64 * 1024


def _parse(text: str, loader_class: Any) -> tuple[object, list[str]]:
    """The YAML document, and the duplicate keys PyYAML would silently overwrite."""
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        duplicates: list[str] = []
        find_duplicates(node, "", duplicates)
        return loader.construct_document(node), duplicates
    finally:
        loader.dispose()


def find_duplicates(
    node: yaml.Node, path: str, found: list[str], visited: set[int] | None = None
) -> None:
    """Append to `found` each mapping key under `node` that repeats an earlier one."""
    # An alias is its anchor's node object: walking each node once keeps aliases of
    # aliases (a "billion laughs") and self-referencing anchors from running away.
    visited = set() if visited is None else visited
    if id(node) in visited:
        return
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            # A collection as a key is refused when the document is constructed.
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            child = f"{path}.{key}" if path else key
            if key in seen:
                found.append(
                    f"{child}: duplicate key at line {key_node.start_mark.line + 1}"
                    " (only the last one would apply)"
                )
            seen.add(key)
            find_duplicates(value_node, child, found, visited)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            find_duplicates(item, f"{path}[{i}]", found, visited)


def yaml_error(exc: yaml.YAMLError) -> str:
    """PyYAML's error as one message, with its line and column when it has them."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return f"invalid YAML: {problem}"
    return f"line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}"


def hint(word: str, known: tuple[str, ...]) -> str:
    """ "; did you mean 'x'?" for the known word closest to `word`, or nothing."""
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def shown(value: object) -> str:
    """`value`'s repr, cut short past a few items and characters."""
    return _SHOWN.repr(value)


def kind(value: object) -> str:
    """How a wrong value reads in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        # YAML 1.1 reads bare yes/no/on/off (and NO, the country code) as booleans.
        return f"boolean {str(value).lower()} (quote the value if it is text)"
    if isinstance(value, str):
        return f"string {shown(value)}"
    if isinstance(value, int) and not is_number(value):
        return f"a number too large ({shown(value)})"
    if isinstance(value, int | float):
        return f"number {value}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def is_number(value: object) -> bool:
    """An int or float from YAML; booleans (`yes`) are not numbers, nor an integer past
    what a float holds (`float()` of it raises)."""
    if isinstance(value, float):
        return True
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and -sys.float_info.max <= value <= sys.float_info.max
    )


class Validator:
    """Collects every problem of a document into `errors` as `<path>: <message>`; a
    loader subclasses it with one method per section."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors

    def error(self, path: str, message: str) -> None:
        # Past what `DocumentError` lists, one more says so and the rest are not made.
        if len(self.errors) <= MAX_ERRORS:
            self.errors.append(f"{path}: {message}")

    def unknown_keys(
        self,
        prefix: str,
        mapping: dict[Any, Any],
        known: tuple[str, ...],
        what: str,
        misplaced: dict[str, str] | None = None,
        aliases: dict[str, str] | None = None,
    ) -> None:
        """One error per key of `mapping` not in `known`. The hint says where a
        `misplaced` key belongs, which known key an alias (another gateway's name) is,
        or else the closest known key."""
        for key in mapping:
            if len(self.errors) > MAX_ERRORS:
                break  # none more is listed: no hint to look for (difflib, per key)
            if key not in known:
                word = str(key)
                if aliases and word in aliases:
                    found = f"; did you mean {aliases[word]!r}?"
                else:
                    found = (misplaced or {}).get(word) or hint(word, known)
                self.error(f"{prefix}{word}", f"{what} (known: {', '.join(known)}){found}")

    def integer(self, path: str, raw: object, low: int, high: int | None = None) -> int:
        """A whole number from `low` to `high` (`2.0` is 2); 0 when absent or invalid."""
        if raw is None:
            return 0
        if not is_number(raw) or not float(raw).is_integer():
            self.error(path, f"must be an integer, got {kind(raw)}")
            return 0
        value = int(raw)
        if value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
            self.error(path, f"must be {bounds}, got {value}")
            return 0
        return value

    def required_string(self, path: str, raw: dict[Any, Any], what: str) -> str:
        """`raw[key]` for the last part of `path`: a non-empty string, `what` it means."""
        key = path.rsplit(".", 1)[1]
        value = raw.get(key)
        if value is None:
            self.error(path, f"missing (required: {what})")
            return ""
        if not isinstance(value, str):
            self.error(path, f"must be a string, got {kind(value)}")
            return ""
        if not value.strip():
            self.error(path, f"must not be empty (required: {what})")
            return ""
        return value


def read_text(path: str | Path) -> str:
    """A document file's UTF-8 text (`read_regular`'s refusals: no FIFO, no device, at
    most MAX_FILE_BYTES); UnicodeDecodeError for what is not UTF-8."""
    return read_regular(path, MAX_FILE_BYTES).decode("utf-8")


def read_document(path: str | Path, error: type[DocumentError], noun: str) -> str:
    """A document file's text; one that cannot be read is `error`, naming the file."""
    try:
        return read_text(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise error([f"{path}: cannot read {noun} ({exc})"]) from None


def version_of(text: str) -> str:
    """A document's version: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def etag(version: str) -> tuple[str, str]:
    """The `ETag` header of a document at `version` (a strong tag: the version quoted)."""
    return ("etag", f'"{version}"')


@dataclass(frozen=True)
class PreconditionFailed(Exception):
    """A write whose `If-Match` does not name the running document (HTTP 412);
    `current` is the version it would have to name."""

    current: str


class Contended(Exception):
    """A write that lost every try to other routers' writes of the same document made
    at the same moment (HTTP 503: retry)."""


def matches(if_match: str | None, version: str) -> bool:
    """Whether an `If-Match` header names `version` (RFC 9110: `*`, or a list of tags
    compared strongly, so a weak `W/"…"` tag never matches); no header matches."""
    if if_match is None:
        return True
    tags = [t.strip() for t in if_match.split(",")]
    return "*" in tags or f'"{version}"' in tags


class FleetWriter(Protocol):
    """What runs a store's writes against the copy several routers share
    (router/fleet/config_sync.py): DocumentStore.change hands them over when it is set."""

    async def write(
        self,
        store: DocumentStore[Any],
        prepare: Callable[[], Any],
        origin: str,
        if_match: str | None,
    ) -> list[str]: ...


class DocumentStore(Generic[T]):
    """`kind` names the log events (`<kind>_reloaded`, `<kind>_reload_failed`) and the
    messages; a subclass parses (raising an error with `.errors`) and installs."""

    kind: str
    # What the document and its file are called in messages ("policy", "policy file").
    noun: str
    title: str
    # The largest text accepted from another router (router/fleet/config_sync.py).
    max_bytes = 1024 * 1024

    def __init__(self, reloads: Counter, log: logging.Logger, path: str | None) -> None:
        self.reloads = reloads
        self.log = log
        self.path = path
        # Called with the origin after each change made here (not from the fleet):
        # router/fleet/config_sync.py publishes it to the other routers.
        self.on_replaced: list[Callable[[str], None]] = []
        self._versioned: tuple[str, str] | None = None
        # With --state-url: writes go through the fleet's copy, so none is lost.
        self.fleet: FleetWriter | None = None

    def parse(self, text: str) -> T:
        """The document in `text`, or DocumentError naming every problem."""
        raise NotImplementedError

    def source(self) -> str:
        """The running document's text; empty when there is none."""
        raise NotImplementedError

    def version(self) -> str:
        """The running document's version: the same text is the same version on every
        router, with no coordination. Hashed once per change, not per call."""
        text = self.source()
        if self._versioned is None or self._versioned[0] is not text:
            self._versioned = (text, version_of(text))
        return self._versioned[1]

    def install(self, value: T) -> str:
        """Make `value` the running document; what the reload line says about it."""
        raise NotImplementedError

    def replace(self, text: str, origin: str) -> list[str]:
        """Validate and install `text`; the errors, empty on success."""
        try:
            value = self.parse(text)
        except DocumentError as exc:
            return self.reject(exc.errors, origin)
        except Exception as exc:  # a validator's bug: the document is refused, the daemon lives
            self.log.exception("%s_validation_failed origin=%s", self.kind, origin)
            why = f"{self.title} could not be checked ({type(exc).__name__})"
            return self.reject([why], origin)
        self.commit(value, origin)
        return []

    def parsed(self, text: str) -> T:
        """`parse`, where a validator's bug is a refused document (logged), never an
        exception that reaches the caller."""
        try:
            return self.parse(text)
        except DocumentError:
            raise
        except Exception as exc:
            self.log.exception("%s_validation_failed origin=admin_api", self.kind)
            why = f"{self.title} could not be checked ({type(exc).__name__})"
            raise DocumentError([why]) from None

    def text_of(self, value: T) -> str:
        """A parsed document's text (each document type keeps it as `source`)."""
        return str(value.source)  # type: ignore[attr-defined]

    async def before_commit(self, value: T) -> None:
        """What must be done before `value` runs (the key registry saves it)."""

    async def change(
        self,
        prepare: Callable[[], T],
        origin: str,
        if_match: str | None = None,
    ) -> list[str]:
        """A change through the admin API: `prepare()` builds the next document from the
        running one (DocumentError: refused, with the reasons returned; other
        refusals propagate). `If-Match` must name the running document, or the
        fleet's with --state-url (PreconditionFailed)."""
        if self.fleet is not None:
            return await self.fleet.write(self, prepare, origin, if_match)
        if not matches(if_match, self.version()):
            raise PreconditionFailed(self.version())
        try:
            value = prepare()
        except DocumentError as exc:
            return self.reject(exc.errors, origin)
        await self.before_commit(value)
        self.commit(value, origin)
        return []

    def commit(self, value: T, origin: str) -> None:
        """Install a parsed document, count, log and tell the listeners."""
        summary = self.install(value)
        self.reloads.labels("success").inc()
        self.log.info(
            "%s_reloaded origin=%s %s version=%s", self.kind, origin, summary, self.version()
        )
        for listener in self.on_replaced:
            listener(origin)

    def supersedes(self, text: str) -> bool:
        """Whether the running document should win over `text` from another router
        (a registry whose own version is newer); the fleet then gets this one back."""
        return False

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
            text = read_text(self.path)
        except (OSError, UnicodeDecodeError) as exc:
            return self.reject([f"{self.path}: cannot read {self.title} ({exc})"], "file")
        return self.replace(text, "file")

    def without_file(self) -> list[str]:
        """SIGHUP on a router started without the file."""
        return []
