"""The audit log: one JSON line per client inference request, rotated by size.

It records who asked for what and how it ended (time, request id, tenant, key id, source
address, model, step, agent, status, the admission gate that refused, tokens, duration)
and never any prompt or answer text, nor a key. Admin calls that change the router's
keys or settings get a line too (`audit_admin`), marked `"kind":"admin"`.
"""

from __future__ import annotations

import fcntl
import json
import logging
import logging.handlers
import os
import sys
import time
from dataclasses import dataclass

from protocol.logs import quote

log = logging.getLogger("tenant")


@dataclass(frozen=True)
class AuditRecord:
    request_id: str
    tenant: str
    endpoint: str
    model: str | None
    step: str | None
    agent: str | None
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    duration_s: float
    code: str | None = None  # the error code the client got; None on success
    trace_id: str | None = None  # with tracing on (OTEL_EXPORTER_OTLP_ENDPOINT)
    key_id: str | None = None  # the key's id (never the key); None: no key needed
    source_ip: str | None = None
    # The admission gate that refused (b1, b2, b4_occupancy, ...; see router/admission).
    gate: str | None = None


@dataclass(frozen=True)
class AdminRecord:
    """One admin call that changed something: who (`key_id` of the admin key), from
    where, what (`action`, e.g. `api_key.put`) on which `target`, and how it ended."""

    action: str
    target: str | None
    status: int
    key_id: str | None = None
    source_ip: str | None = None
    request_id: str | None = None
    detail: str | None = None


class _SharedRotatingHandler(logging.handlers.RotatingFileHandler):
    """Size rotation that several processes appending to one file agree on: the
    workers of `serve --workers N` share `--audit-log`. With the standard handler each
    worker rotated on its own, a worker still holding a renamed file rotated again, and
    lines inside the kept window were deleted (4 workers: 12 of the last 40 lines gone).

    Before each line a writer checks that its file is still the one at `path`, and
    reopens it when another worker rotated. A rotation runs under an exclusive `flock`
    of the current file; a writer that waited for it finds the file moved and reopens
    instead of rotating again."""

    # Whether the last line failed (full disk, directory gone): said once, not per line.
    failing = False
    _failed = False
    # (device, inode) of the file the stream writes to, read once when it opens.
    _identity: tuple[int, int] | None = None

    def _open(self):  # type: ignore[no-untyped-def]  # logging's own signature
        stream = super()._open()
        own = os.fstat(stream.fileno())
        self._identity = (own.st_dev, own.st_ino)
        return stream

    def emit(self, record: logging.LogRecord) -> None:
        self._failed = False
        super().emit(record)
        if self.failing and not self._failed:
            self.failing = False
            log.info("audit_log_writable path=%s", quote(self.baseFilename))

    def handleError(self, record: logging.LogRecord) -> None:
        # logging's own handling prints a traceback with the whole line for every
        # request; the router says it once, and again when the file takes lines.
        self._failed = True
        if not self.failing:
            self.failing = True
            exc = sys.exc_info()[1]
            log.error(
                "audit_log_write_failed path=%s reason=%s lines=dropped_until_writable",
                quote(self.baseFilename),
                quote(f"{type(exc).__name__}: {exc}"),
            )

    def shouldRollover(self, record: logging.LogRecord) -> int:
        if self.stream is not None and self._moved():
            self._reopen()
        return super().shouldRollover(record)

    def _reopen(self) -> None:
        assert self.stream is not None
        self.stream.close()
        # None until it opens: a path that cannot be opened is tried again next line.
        self.stream = None  # type: ignore[assignment]
        self.stream = self._open()

    def doRollover(self) -> None:
        if self.stream is None:
            super().doRollover()
            return
        # A descriptor of its own holds the lock while the stream is closed and renamed.
        lock = os.dup(self.stream.fileno())
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._moved():
                self._reopen()
            else:
                super().doRollover()
        finally:
            os.close(lock)

    def _moved(self) -> bool:
        """Whether `path` no longer names the file this handler writes to."""
        try:
            at_path = os.stat(self.baseFilename)
        except FileNotFoundError:
            return True
        return (at_path.st_dev, at_path.st_ino) != self._identity


class AuditLog:
    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        # A logger of its own, outside the `key=value` tree: nothing else lands here.
        self.logger = logging.Logger(f"audit:{path}")
        self.handler = _SharedRotatingHandler(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
        )
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger.addHandler(self.handler)
        self.logger.propagate = False

    def write(self, record: AuditRecord) -> None:
        line = {
            "time": _now(),
            "request_id": record.request_id,
            "tenant": record.tenant,
            "key_id": record.key_id,
            "source_ip": record.source_ip,
            "endpoint": record.endpoint,
            "model": record.model,
            "step": record.step,
            "agent": record.agent,
            "status": record.status,
            "code": record.code,
            "gate": record.gate,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "total_tokens": (
                None
                if record.prompt_tokens is None
                else record.prompt_tokens + (record.completion_tokens or 0)
            ),
            "duration_ms": round(record.duration_s * 1000, 1),
            "trace_id": record.trace_id,
        }
        self.logger.info("%s", json.dumps(line, separators=(",", ":")))

    def write_admin(self, record: AdminRecord) -> None:
        line = {
            "time": _now(),
            "kind": "admin",
            "request_id": record.request_id,
            "action": record.action,
            "target": record.target,
            "status": record.status,
            "key_id": record.key_id,
            "source_ip": record.source_ip,
            "detail": record.detail,
        }
        self.logger.info("%s", json.dumps(line, separators=(",", ":")))

    def close(self) -> None:
        self.handler.close()


def audit_admin(log: AuditLog | None, record: AdminRecord) -> None:
    """Write an admin call's line when the router keeps an audit log (--audit-log)."""
    if log is not None:
        log.write_admin(record)


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
