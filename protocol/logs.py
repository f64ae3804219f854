"""`key=value` log lines with a level per subsystem.

`GOLOG_LOG_LEVEL=policy=debug,router=debug` (the seeds' form) or `HIVENET_LOG_LEVEL`
(`info`, or the same per-subsystem list) set the levels; a bare level applies to every
subsystem without its own. Both variables are read: a subsystem named in either gets
that level, and where both name the same thing (a subsystem, or the bare default)
`GOLOG_LOG_LEVEL` wins, as the seeds tell operators to set it. Unknown level names are
reported once on stderr and ignored.

Messages use logging's lazy `%` arguments, so a disabled level costs no formatting.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from protocol.p2p import quiet_libp2p_logging

SUBSYSTEMS = ("router", "policy", "link", "http", "provider", "agent", "engine", "tenant")
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


def _needs_quotes(text: str) -> bool:
    return not text or any(c in ' "=\\' or not c.isprintable() for c in text)


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
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def kv(**fields: object) -> str:
    return " ".join(f"{k}={quote(v)}" for k, v in fields.items() if v is not None)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        level = _NAMES.get(record.levelno, record.levelname.lower())
        line = f"ts={ts}.{int(record.msecs):03d}Z level={level} subsystem={record.name} "
        line += record.getMessage().replace("\n", "\\n")
        if record.exc_info:
            line += " exc=" + quote(self.formatException(record.exc_info))
        return line


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
    levels = {name: default for name in SUBSYSTEMS}
    levels.update(per)
    return levels


def setup_logging(environ: dict[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
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
