"""The last few hundred inference requests, and the log lines of each (its routing story).

`GET /admin/requests` and the console's Requests view read this. It is bounded both
ways: SIZE requests are kept (the oldest leaves when one more ends), each with at most
LINES lines; requests in flight are tracked only up to MAX_OPEN, beyond which a burst's
requests are summarised without their lines. A request costs one small record and two
dict operations; a log line is looked at only when it starts with `req=`, kept as the
record it is when its request is one being kept, and formatted only when someone reads
the story (`bench.recent`, docs/console.md).

The lines are the ones the router writes at its configured levels: with
`HIVENET_LOG_LEVEL=policy=debug` a story shows each step's selection and drain, at the
default `info` the access line and any forward error, exhaustion or shed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# A few hundred requests: a busy minute of a small fleet, a few seconds of a large one.
SIZE = 300
# A request that retries through a three-step chain writes about 15 lines at debug.
LINES = 40
MAX_OPEN = 4096
MAX_LINE_CHARS = 2000


@dataclass(slots=True)
class RecentRequest:
    id: str
    started: float  # wall clock
    path: str
    # The log records themselves: formatted only when someone reads the story.
    records: list[logging.LogRecord] = field(default_factory=list)
    model: str = "-"
    tenant: str = "-"
    agent: str = ""
    step: str = ""
    status: int = 0
    latency_ms: float = 0.0
    tries: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "time": _rfc3339(self.started),
            "path": self.path,
            "model": self.model,
            "tenant": self.tenant,
            "agent": self.agent or None,
            "status": self.status,
            "latency_ms": round(self.latency_ms, 1),
            "tries": self.tries,
        }


class RecentRequests:
    def __init__(self, size: int = SIZE, lines: int = LINES) -> None:
        self.size = size
        self.lines = lines
        self._ring: deque[RecentRequest] = deque()
        self._by_id: dict[str, RecentRequest] = {}
        self._open: dict[str, RecentRequest] = {}

    def __repr__(self) -> str:
        return f"<RecentRequests {len(self._ring)}/{self.size}, {len(self._open)} open>"

    def begin(self, rid: str, path: str) -> RecentRequest:
        entry = RecentRequest(rid, time.time(), path)
        if len(self._open) < MAX_OPEN:
            self._open[rid] = entry
        return entry

    def end(self, entry: RecentRequest) -> None:
        # Only its own entry: a client-chosen ID may be in flight twice at once (an
        # idempotent retry joins the first), and the other keeps its story.
        if self._open.get(entry.id) is entry:
            del self._open[entry.id]
        ring = self._ring
        if len(ring) >= self.size:
            old = ring.popleft()
            if self._by_id.get(old.id) is old:
                del self._by_id[old.id]
        ring.append(entry)
        self._by_id[entry.id] = entry

    def record(self, rid: str, record: logging.LogRecord) -> None:
        entry = self._open.get(rid) or self._by_id.get(rid)
        if entry is not None and len(entry.records) < self.lines:
            entry.records.append(record)

    def get(self, rid: str) -> RecentRequest | None:
        return self._by_id.get(rid) or self._open.get(rid)

    def list(self, filters: dict[str, str], limit: int) -> list[dict[str, Any]]:
        """Newest first; each filter a substring of its field (`status` a prefix)."""
        out = []
        for entry in reversed(self._ring):
            row = entry.summary()
            if _matches(row, filters):
                out.append(row)
                if len(out) >= limit:
                    break
        return out


FILTERS = ("id", "model", "tenant", "agent", "status", "path")


def _matches(row: dict[str, Any], filters: dict[str, str]) -> bool:
    for name, want in filters.items():
        got = "" if row.get(name) is None else str(row[name])
        if name == "status":
            if not got.startswith(want):
                return False
        elif want.lower() not in got.lower():
            return False
    return True


class StoryHandler(logging.Handler):
    """Every log line of a kept request, into its story.

    Attached to the root logger, so it sees each line the router's levels let through.
    The router's request lines are `req=%s …` with the ID as their first argument (the
    exhaustion and shed lines are one preformatted `%s` that starts the same way); any
    other line is passed over after one string comparison.
    """

    def __init__(self, recent: RecentRequests) -> None:
        super().__init__(logging.DEBUG)
        self.recent = recent

    def handle(self, record: logging.LogRecord) -> bool:
        # No handler lock: the router's lines all come from its one trio thread, and a
        # line from another thread appends to a list, which the GIL keeps whole.
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        args = record.args
        if not isinstance(msg, str) or not isinstance(args, tuple) or not args:
            return
        first = args[0]
        if msg.startswith("req="):
            rid = first
        elif msg == "%s" and isinstance(first, str) and first.startswith("req="):
            rid = first[4:].split(" ", 1)[0]
        else:
            return
        if isinstance(rid, str):
            self.recent.record(rid, record)


def story(records: list[logging.LogRecord]) -> list[str]:
    """A request's records as the router's text log lines."""
    lines = []
    for record in records:
        try:
            text = record.getMessage()
        except Exception:  # a line that cannot be formatted is the logger's to report
            continue
        at = time.strftime("%H:%M:%S", time.gmtime(record.created))
        level = record.levelname.lower()
        line = f"{at}.{int(record.msecs):03d}Z level={level} subsystem={record.name} {text}"
        lines.append(line[:MAX_LINE_CHARS])
    return lines


def _rfc3339(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"
