"""The audit log: one JSON line per client request, rotated by size.

It records who asked for what and how it ended (time, request id, tenant, key id, source
address, model, step, agent, status, the admission gate that refused, tokens, duration)
and never any prompt or answer text, nor a key. Every `/v1/*` call (inference and model
discovery) and every admin call get a line; an admin call's is marked `"kind":"admin"`.

Each line carries upstream's fields with upstream's types (issue 47), so its Promtail
pipeline and Loki dashboard read these files unchanged: `log_type` ("audit"), `level`
("info" below 400, else "error"), `ts` (the request's start, RFC 3339 with its offset),
`trace_id`, `request_id`, `tenant_id`, `key_id`, `model`, `agent_id`, `error_code`,
`source_ip` (strings, "" when unknown, never null), `status_code`, `latency_ms`,
`input_tokens`, `output_tokens` (integers, 0 when unknown). This router's own names
(`time`, `tenant`, `status`, `code`, `duration_ms`, `prompt_tokens`, ...) stay beside
them for the readers written before.

A path that cannot be opened does not stop the router: it says so in one line and
writes the audit lines to standard output, as upstream does.
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
from datetime import datetime

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
    duration_s: float = 0.0


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
        self.path: str | None = path
        handler: logging.Handler
        try:
            # Upstream creates the directory when it can; so does this.
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            handler = _SharedRotatingHandler(
                path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
            )
        except OSError as exc:
            log.error(
                "audit_log_unopenable path=%s reason=%s fallback=stdout",
                quote(path),
                quote(f"{type(exc).__name__}: {exc}"),
            )
            self.path = None
            handler = logging.StreamHandler(sys.stdout)
        self.handler = handler
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger.addHandler(self.handler)
        self.logger.propagate = False

    def write(self, record: AuditRecord) -> None:
        now = time.time()
        line = {
            **_upstream(
                now,
                record.duration_s,
                record.status,
                record.code,
                trace_id=record.trace_id,
                request_id=record.request_id,
                tenant_id="" if record.tenant == "-" else record.tenant,
                key_id=record.key_id,
                model=record.model,
                agent_id=record.agent,
                source_ip=record.source_ip,
                input_tokens=record.prompt_tokens,
                output_tokens=record.completion_tokens,
            ),
            "time": _utc(now),
            "tenant": record.tenant,
            "endpoint": record.endpoint,
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
        }
        self.logger.info("%s", json.dumps(line, separators=(",", ":")))

    def write_admin(self, record: AdminRecord) -> None:
        now = time.time()
        line = {
            **_upstream(
                now,
                record.duration_s,
                record.status,
                None,
                trace_id=None,
                request_id=record.request_id,
                tenant_id=None,
                key_id=record.key_id,
                model=None,
                agent_id=None,
                source_ip=record.source_ip,
                input_tokens=None,
                output_tokens=None,
            ),
            "time": _utc(now),
            "kind": "admin",
            "action": record.action,
            "target": record.target,
            "status": record.status,
            "detail": record.detail,
        }
        self.logger.info("%s", json.dumps(line, separators=(",", ":")))

    def close(self) -> None:
        self.handler.close()


# Upstream's error_code when the handler attached none (docs/observability/audit-logging).
_STATUS_CODES = {
    400: "request_invalid",
    401: "unauthorized",
    403: "model_forbidden",
    404: "model_not_found",
    429: "rate_limit_exceeded",
    503: "no_agents_available",
    504: "request_timeout",
}


def error_code_for(status: int, code: str | None) -> str:
    """The code the client got, else upstream's code for the status; "" below 400."""
    if code:
        return code
    if status < 400:
        return ""
    return _STATUS_CODES.get(status, "backend_error")


def _upstream(
    now: float,
    duration_s: float,
    status: int,
    code: str | None,
    *,
    input_tokens: int | None,
    output_tokens: int | None,
    **strings: str | None,
) -> dict[str, object]:
    """Upstream's fields, in its order: strings never null, counts never null."""
    line: dict[str, object] = {"log_type": "audit", "level": "error" if status >= 400 else "info"}
    for name in ("trace_id", "request_id", "tenant_id", "key_id", "model"):
        line[name] = strings[name] or ""
    line["status_code"] = status
    line["latency_ms"] = round(duration_s * 1000)
    line["input_tokens"] = input_tokens or 0
    line["output_tokens"] = output_tokens or 0
    line["agent_id"] = strings["agent_id"] or ""
    line["error_code"] = error_code_for(status, code)
    line["source_ip"] = strings["source_ip"] or ""
    line["ts"] = _rfc3339(now - duration_s)
    return line


def audit_admin(log: AuditLog | None, record: AdminRecord) -> None:
    """Write an admin call's line when the router keeps an audit log (--audit-log)."""
    if log is not None:
        log.write_admin(record)


def _utc(now: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def _rfc3339(when: float) -> str:
    """Local time with its UTC offset and milliseconds, as upstream's `ts`
    (`2026-07-27T16:20:10.123+02:00`); upstream fixes Europe/Rome, this the host's zone."""
    local = datetime.fromtimestamp(when).astimezone()
    return local.isoformat(timespec="milliseconds")
