"""Per-agent lifetime history in SQLite, so a router restart keeps what it learned.

Each agent's UniversalStats (successes, failures, tokens, rejections, disconnections,
SRTT and RTTVAR) is one row keyed by peer ID. The request path never touches the
file: the link updates the in-memory stats as before, and `run` writes the rows that
changed every `--universal-flush-interval` (5 s), plus once more on shutdown. An agent
that joins a restarted router starts from its row. The Go router's flags for its
BadgerDB store name this one file: `--disk-db-path DIR` puts it in DIR, `--disk-db-ttl`
drops rows not written for that many days at startup, `--reset-disk-db` starts empty.

sqlite3 only does blocking I/O, so the reads and writes run in a worker thread through
`trio.to_thread.run_sync`, one at a time under a lock; that is the only thread here.
A batch for 1,000 agents is one transaction of at most 1,000 upserts (a few
milliseconds), so 5 s between writes loses at most 5 s of counts to a crash.
"""

from __future__ import annotations

import logging
import operator
import os
import sqlite3
import time
from dataclasses import dataclass, fields

import trio

from protocol.logs import quote
from router.peers import Peer, PeerTable, UniversalStats
from router.settings import RouterSettings

log = logging.getLogger("history")

WRITE_INTERVAL = 5.0
FILE_NAME = "router_history.sqlite3"
DAY = 86400.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS agent_history (
    peer_id TEXT PRIMARY KEY,
    successes INTEGER NOT NULL,
    failures INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    rejections INTEGER NOT NULL,
    disconnections INTEGER NOT NULL,
    srtt_ms REAL,
    rttvar_ms REAL,
    updated_at REAL NOT NULL,
    agent_failures INTEGER NOT NULL DEFAULT 0,
    backend_failures INTEGER NOT NULL DEFAULT 0
)
"""
# Columns added after files were written: (name, definition), added where missing.
_ADDED_COLUMNS = (
    ("agent_failures", "INTEGER NOT NULL DEFAULT 0"),
    ("backend_failures", "INTEGER NOT NULL DEFAULT 0"),
)


@dataclass(frozen=True)
class Lifetime:
    """The persisted part of one agent's UniversalStats."""

    successes: int
    failures: int
    input_tokens: int
    output_tokens: int
    rejections: int
    disconnections: int
    srtt_ms: float | None
    rttvar_ms: float | None
    agent_failures: int
    backend_failures: int

    def stats(self) -> UniversalStats:
        return UniversalStats(**{f.name: getattr(self, f.name) for f in fields(self)})


_COLUMNS = [f.name for f in fields(Lifetime)]
# The persisted values of one agent's stats, as a tuple in column order: read for every
# agent on every pass, so in one C call (a Lifetime built per agent made this pass a
# third of an idle fleet's heartbeat handling in bench.heartbeat).
_persisted = operator.attrgetter(*_COLUMNS)
_UPSERT = (
    f"INSERT INTO agent_history (peer_id, {', '.join(_COLUMNS)}, updated_at) "
    f"VALUES ({', '.join('?' * (len(_COLUMNS) + 2))}) "
    "ON CONFLICT(peer_id) DO UPDATE SET "
    + ", ".join(f"{c}=excluded.{c}" for c in [*_COLUMNS, "updated_at"])
)


class HistoryUnwritable(Exception):
    pass


def history_path(settings: RouterSettings) -> str:
    """`--history-path`, else the file in `--disk-db-path`, else beside the router's
    identity key: the two are the router's state."""
    if settings.history_path:
        return settings.history_path
    directory = settings.disk_db_path or os.path.dirname(os.path.abspath(settings.identity_path))
    return os.path.join(directory, FILE_NAME)


class LifetimeStore:
    def __init__(
        self,
        path: str,
        table: PeerTable,
        interval: float = WRITE_INTERVAL,
        ttl_days: int = 0,
        reset: bool = False,
    ) -> None:
        self.path = path
        self.table = table
        self.interval = interval
        self.ttl = ttl_days * DAY
        self.reset_at_start = reset
        self.rows = 0
        self.last_write: float | None = None  # wall clock
        self.last_error: str | None = None
        # What the file holds per agent, as `_persisted` reads it.
        self._written: dict[str, tuple] = {}
        # Agents not in the table, as rows: those of the file not yet rejoined, and those
        # the link removed (silent past --remove-after), which may come back. Those that
        # differ from `_written` are written on the next pass.
        self._saved: dict[str, tuple] = {}
        self._lock = trio.Lock()
        self._db: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"<LifetimeStore {self.path} {self.rows} rows, {len(self._saved)} not yet rejoined>"

    def restore(self, peer_id: str) -> UniversalStats | None:
        """The stats an agent had before the router restarted (once per agent)."""
        saved = self._saved.pop(peer_id, None)
        return Lifetime(*saved).stats() if saved is not None else None

    def retire(self, peer: Peer) -> None:
        """`peer` left the table: keep its stats for the agent's return, as a restarted
        router does, and for the next write. Without this a returning agent would
        start blank here and its row be overwritten with the blank."""
        self._saved[peer.peer_id] = _persisted(peer.stats)

    def load(self) -> None:
        """Open the file and read it, at startup before the event loop runs (so a file
        that is not a history is a startup error, exit 2, with its reason)."""
        try:
            if self.reset_at_start and os.path.exists(self.path):
                os.remove(self.path)
                log.warning("history_reset path=%s", quote(self.path))
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False)
            db.execute(_SCHEMA)
            present = {row[1] for row in db.execute("PRAGMA table_info(agent_history)")}
            for name, definition in _ADDED_COLUMNS:
                if name not in present:
                    db.execute(f"ALTER TABLE agent_history ADD COLUMN {name} {definition}")
            if self.ttl:
                db.execute(
                    "DELETE FROM agent_history WHERE updated_at < ?", (time.time() - self.ttl,)
                )
            db.commit()
            query = f"SELECT peer_id, {', '.join(_COLUMNS)} FROM agent_history"
            rows = db.execute(query).fetchall()
        except (sqlite3.Error, OSError) as exc:
            raise ValueError(f"--history-path {self.path}: {exc}") from exc
        self._saved = {row[0]: tuple(row[1:]) for row in rows}
        self._written = dict(self._saved)
        self.rows = len(rows)
        self._db = db
        log.info("history_loaded path=%s agents=%d", quote(self.path), len(rows))

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            await self.write()

    async def write(self) -> None:
        async with self._lock:
            if self._db is None:
                return
            # Taken under the lock: a reset between this snapshot and its write would
            # otherwise be undone by it.
            written = self._written
            changed = {pid: row for pid, row in self._saved.items() if written.get(pid) != row}
            # A returned agent's live stats win over what it left with.
            for peer in self.table.all():
                now = _persisted(peer.stats)
                if written.get(peer.peer_id) != now:
                    changed[peer.peer_id] = now
            if not changed:
                return
            try:
                self.rows = await trio.to_thread.run_sync(self._write, changed, time.time())
            except sqlite3.Error as exc:
                # Retried next pass: `_written` still says what the file holds.
                if self.last_error != str(exc):
                    # Once per outage and reason, not every pass of a full disk.
                    log.warning(
                        "history_write_failed path=%s reason=%s",
                        quote(self.path),
                        quote(str(exc)),
                    )
                self.last_error = str(exc)
                return
            self._written.update(changed)
            self.last_write = time.time()
            if self.last_error is not None:
                log.info("history_write_recovered path=%s", quote(self.path))
            self.last_error = None

    def _write(self, changed: dict[str, tuple], at: float) -> int:
        assert self._db is not None
        with self._db:
            self._db.executemany(_UPSERT, [(pid, *row, at) for pid, row in changed.items()])
        return self._db.execute("SELECT count(*) FROM agent_history").fetchone()[0]

    async def reset(self) -> None:
        """Forget every agent's lifetime stats, on disk and in memory.

        HistoryUnwritable when the file could not be cleared: memory is then left as it
        was, since a restart would bring the file's counts back under a cleared view."""
        async with self._lock:
            if self._db is not None:
                try:
                    await trio.to_thread.run_sync(self._delete)
                except sqlite3.Error as exc:
                    self.last_error = str(exc)
                    raise HistoryUnwritable(
                        f"{self.path} could not be cleared ({exc}); nothing was reset"
                    ) from exc
                self.rows = 0
                self.last_write = time.time()
            for peer in self.table.all():
                peer.stats.reset()
            self._saved.clear()
            self._written.clear()

    def _delete(self) -> None:
        assert self._db is not None
        with self._db:
            self._db.execute("DELETE FROM agent_history")

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def storage(self) -> dict:
        try:
            size = os.stat(self.path).st_size
        except OSError:
            size = None
        last = self.last_write
        return {
            "path": self.path,
            "size_bytes": size,
            "rows": self.rows,
            "last_write": None
            if last is None
            else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last)),
            "write_interval_seconds": self.interval,
            "last_error": self.last_error,
        }
