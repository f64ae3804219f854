"""`key=value` log lines with a level per subsystem, or the same fields as JSON.

`GOLOG_LOG_LEVEL=policy=debug,router=debug` (the seeds' form) or `HIVENET_LOG_LEVEL`
(`info`, or the same per-subsystem list) set the levels; a bare level applies to every
subsystem without its own. Both variables are read: a subsystem named in either gets
that level, and where both name the same thing (a subsystem, or the bare default)
`GOLOG_LOG_LEVEL` wins, as the seeds tell operators to set it. Unknown level names are
reported once on stderr and ignored.

Messages use logging's lazy `%` arguments, so a disabled level costs no formatting.

`--log-format json` (or go-log's `GOLOG_LOG_FMT=json`, which the Go router's operators
already set) writes one JSON object per line instead. Its fields are those of the
`key=value` line: the formatted line is read back with the quoting rules of `quote`, so
every call site keeps writing one shape and the two formats cannot drift apart. The
bare words of a line (the event, `policy_exhausted`) become `msg`, go-log's name for it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from protocol.p2p import quiet_libp2p_logging

SUBSYSTEMS = ("router", "policy", "link", "http", "provider", "agent", "engine", "tenant")
# Upstream's subsystem names, for the loggers here that do that work: a level set for
# one of them (`GOLOG_LOG_LEVEL=api=warn`) applies to these unless they are named too.
UPSTREAM_SUBSYSTEMS = {
    "api": ("http",),
    "auth": ("tenant",),
    "p2p": ("link", "router.p2p"),
    "storage": ("history",),
}
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    # go-log's names above error
    "dpanic": logging.CRITICAL,
    "panic": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}
_NAMES = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warn",
    logging.ERROR: "error",
    logging.CRITICAL: "fatal",
}
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_UNESCAPES = {v[1]: k for k, v in _ESCAPES.items()}
FORMATS = ("text", "json")


def _needs_quotes(text: str) -> bool:
    return not text or any(c in ' "=\\' or not c.isprintable() for c in text)


def _escape_code(code: int) -> str:
    # Fixed widths, as in Python's own literals, so the escape reads back unambiguously.
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def quote(value: object) -> str:
    """A value as it appears after `key=`: bare when safe, else double-quoted.

    Quoted values escape `\\`, `"`, newlines, tabs and other control characters, so one
    record is always one line and `key=value` pairs split unambiguously.
    """
    text = str(value)
    if not _needs_quotes(text):
        return text
    out = []
    for c in text:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif not c.isprintable() and c != " ":
            out.append(_escape_code(ord(c)))
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def kv(**fields: object) -> str:
    return " ".join(f"{k}={quote(v)}" for k, v in fields.items() if v is not None)


def _unquote(text: str, start: int) -> tuple[str, int]:
    """The value of a quoted field that opens at `start`, and the index after it."""
    out = []
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            return "".join(out), i + 1
        if c == "\\" and i + 1 < len(text):
            e = text[i + 1]
            width = {"x": 2, "u": 4, "U": 8}.get(e)
            if width and i + 2 + width <= len(text):
                out.append(chr(int(text[i + 2 : i + 2 + width], 16)))
                i += 2 + width
                continue
            out.append(_UNESCAPES.get(e, e))
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out), i  # unterminated: the rest of the line is the value


def fields_of(line: str) -> dict[str, str]:
    """A `key=value` line read back into its fields; bare words are joined into `msg`.

    The inverse of `kv`/`quote` for what they write. Any other text (a free-form debug
    message, a stray quote) still comes back whole, in `msg` or as a value, never lost.
    """
    fields: dict[str, str] = {}
    words: list[str] = []
    i, n = 0, len(line)
    while i < n:
        if line[i] == " ":
            i += 1
            continue
        j = i
        while j < n and line[j] not in ' ="':
            j += 1
        if j < n and line[j] == "=" and j > i:
            if j + 1 < n and line[j + 1] == '"':
                value, end = _unquote(line, j + 1)
            else:
                end = line.find(" ", j + 1)
                end = n if end < 0 else end
                value = line[j + 1 : end]
            fields.setdefault(line[i:j], value)
            i = end
        else:
            end = line.find(" ", i)
            end = n if end < 0 else end
            words.append(line[i:end])
            i = end
    if words:
        return {"msg": " ".join(words), **fields}
    return fields


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        level = _NAMES.get(record.levelno, record.levelname.lower())
        line = f"ts={ts}.{int(record.msecs):03d}Z level={level} subsystem={record.name} "
        line += record.getMessage().replace("\n", "\\n")
        if record.exc_info:
            line += " exc=" + quote(self.formatException(record.exc_info))
        return line


class _JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        # Fields of the process on every line (`label_lines`).
        self.labels: dict[str, str] = {}

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        head = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": _NAMES.get(record.levelno, record.levelname.lower()),
            "subsystem": record.name,
            **self.labels,
        }
        body = fields_of(record.getMessage())
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        # The record's own fields come first and win over a message that names one of them.
        head.update((k, v) for k, v in body.items() if k not in head)
        return json.dumps(head, ensure_ascii=False)


def parse_levels(spec: str) -> tuple[int | None, dict[str, int]]:
    """`info`, `policy=debug,router=debug` or both: (bare level, per-subsystem levels).

    Unknown level names are skipped; `invalid_levels` lists them.
    """
    default: int | None = None
    per: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, level = part.rpartition("=")
        value = _LEVELS.get(level.strip().lower())
        if value is None:
            continue
        if name.strip():
            per[name.strip()] = value
        else:
            default = value
    return default, per


def invalid_levels(spec: str) -> list[str]:
    """The parts of a level spec that name no known level."""
    bad = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        _, _, level = part.rpartition("=")
        if level.strip().lower() not in _LEVELS:
            bad.append(part)
    return bad


def levels_from(env: dict[str, str] | os._Environ[str]) -> dict[str, int]:
    """The level of every subsystem, and of any other logger an operator named."""
    default, per = parse_levels(env.get("HIVENET_LOG_LEVEL", ""))
    golog_default, golog_per = parse_levels(env.get("GOLOG_LOG_LEVEL", ""))
    per.update(golog_per)
    if golog_default is not None:
        default = golog_default
    if default is None:
        default = logging.INFO
    for theirs, ours in UPSTREAM_SUBSYSTEMS.items():
        if theirs in per:
            for name in ours:
                per.setdefault(name, per[theirs])
    levels = {name: default for name in SUBSYSTEMS}
    levels.update(per)
    return levels


def log_format_from(flag: str | None, env: dict[str, str] | os._Environ[str]) -> str:
    """`--log-format` when given, else `GOLOG_LOG_FMT` (`json`; any other value is text,
    as go-log treats its `color`/`nocolor`), else text."""
    if flag:
        return flag
    return "json" if env.get("GOLOG_LOG_FMT", "").strip().lower() == "json" else "text"


def label_lines(**fields: str) -> None:
    """Put `fields` on every JSON line from now on, as the Go agent labels its lines with
    its peer ID; text lines keep their shape."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, _JsonFormatter):
            handler.formatter.labels.update(fields)


def setup_logging(environ: dict[str, str] | None = None, log_format: str | None = None) -> None:
    env = os.environ if environ is None else environ
    handler = logging.StreamHandler(sys.stderr)
    json_lines = log_format_from(log_format, env) == "json"
    handler.setFormatter(_JsonFormatter() if json_lines else _Formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    quiet_libp2p_logging()
    # Applied after the libp2p quieting, so `libp2p=debug` asked for by name still works.
    for name, level in levels_from(env).items():
        logging.getLogger(name).setLevel(level)
    for var in ("HIVENET_LOG_LEVEL", "GOLOG_LOG_LEVEL"):
        bad = invalid_levels(env.get(var, ""))
        if bad:
            logging.getLogger("logs").warning(
                "log_level_ignored variable=%s parts=%s known=%s",
                var,
                quote(",".join(bad)),
                "debug,info,warn,error,fatal",
            )
