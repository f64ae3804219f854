"""`key=value` log lines with a level per subsystem.

`GOLOG_LOG_LEVEL=policy=debug,router=debug` (the seeds' form) or `HIVENET_LOG_LEVEL`
(`info`, or the same per-subsystem list) set the levels; a bare level applies to all.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from protocol.p2p import quiet_libp2p_logging

SUBSYSTEMS = ("router", "policy", "link", "http", "provider", "agent", "engine")
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}
_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn"}


def quote(value: object) -> str:
    """A value as it appears after `key=`: bare when safe, else double-quoted."""
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def kv(**fields: object) -> str:
    return " ".join(f"{k}={quote(v)}" for k, v in fields.items() if v is not None)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        level = _NAMES.get(record.levelno, record.levelname.lower())
        line = f"ts={ts}.{int(record.msecs):03d}Z level={level} subsystem={record.name} "
        line += record.getMessage()
        if record.exc_info:
            line += " exc=" + quote(self.formatException(record.exc_info))
        return line


def parse_levels(spec: str) -> tuple[int | None, dict[str, int]]:
    default: int | None = None
    per: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, level = part.rpartition("=")
        value = _LEVELS.get(level.strip().lower())
        if value is None:
            continue
        if name:
            per[name.strip()] = value
        else:
            default = value
    return default, per


def setup_logging(environ: dict[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    default, per = parse_levels(env.get("HIVENET_LOG_LEVEL", ""))
    golog_default, golog_per = parse_levels(env.get("GOLOG_LOG_LEVEL", ""))
    per.update(golog_per)
    default = golog_default or default or logging.INFO
    for name in SUBSYSTEMS:
        logging.getLogger(name).setLevel(per.get(name, default))
    quiet_libp2p_logging()
