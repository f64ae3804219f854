"""The audit log: one JSON line per client inference request, rotated by size.

It records who asked for what and how it ended (time, request id, tenant, model, step,
agent, status, tokens, duration) and never any prompt or answer text. Each admin API
call has a line too (`audit_admin`: which admin key, from where, what, the status).
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from dataclasses import dataclass


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


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


class AuditLog:
    def __init__(self, path: str, max_bytes: int, backups: int) -> None:
        # A logger of its own, outside the `key=value` tree: nothing else lands here.
        self.logger = logging.Logger(f"audit:{path}")
        self.handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
        )
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger.addHandler(self.handler)
        self.logger.propagate = False

    def write(self, record: AuditRecord) -> None:
        now = time.time()
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
            + f".{int(now % 1 * 1000):03d}Z",
            "request_id": record.request_id,
            "tenant": record.tenant,
            "endpoint": record.endpoint,
            "model": record.model,
            "step": record.step,
            "agent": record.agent,
            "status": record.status,
            "code": record.code,
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

    def audit_admin(
        self,
        request_id: str,
        key_id: str | None,
        source_ip: str,
        method: str,
        path: str,
        status: int,
    ) -> None:
        """An admin call: `key_id` names the admin key (never the key), None when the
        call presented no valid one."""
        line = {
            "time": _now(),
            "request_id": request_id,
            "kind": "admin",
            "key_id": key_id,
            "source_ip": source_ip,
            "method": method,
            "endpoint": path,
            "status": status,
        }
        self.logger.info("%s", json.dumps(line, separators=(",", ":")))

    def close(self) -> None:
        self.handler.close()
