"""`--disk-db-path`: each agent's router-side history (successes, failures, SRTT and
RTTVAR) kept on disk by peer ID, so a restarted router ranks a returning agent by what
it knew, as the Go router's BadgerDB store does.

One JSON file, `agents.json`, rewritten whole every `--universal-flush-interval`
(write to a temporary file, then rename: a crash leaves the old or the new file, never
half of one) and once more at shutdown. A fleet of 4,096 agents is about 600 KB, a few
milliseconds to write, so no database is needed. Entries not seen for `--disk-db-ttl`
days are dropped (0 keeps them); `--reset-disk-db` deletes the directory first. A file
that cannot be read is a startup error, not a silent fresh start.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import trio

from router.documents import is_number
from router.peers import PeerTable, UniversalStats

log = logging.getLogger("router")

FILE = "agents.json"
DAY = 86400.0
# The history, not the circuit breaker: its `probe_at` is on this process's clock, so a
# restarted router judges a returning agent by its history as it stands.
_FIELDS: tuple[str, ...] = ("successes", "failures", "consecutive_failures", "srtt_ms", "rttvar_ms")


class AgentHistory:
    def __init__(self, directory: str, ttl_days: int, flush_interval: float, reset: bool) -> None:
        self.directory = Path(directory)
        self.ttl = ttl_days * DAY
        self.flush_interval = flush_interval
        if reset and self.directory.exists():
            shutil.rmtree(self.directory)
            log.warning("disk_db_reset path=%s", self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / FILE
        self.saved: dict[str, dict] = self._load()

    def __repr__(self) -> str:
        return f"<AgentHistory {self.path} agents={len(self.saved)}>"

    def _load(self) -> dict[str, dict]:
        if not self.path.exists():
            return {}
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(
                f"--disk-db-path: cannot read {self.path} ({exc}); move it away or start"
                " with --reset-disk-db"
            ) from None
        if not isinstance(raw, dict):
            raise ValueError(f"--disk-db-path: {self.path} is not a JSON object")
        now = time.time()
        kept = {}
        for peer_id, entry in raw.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("stats"), dict):
                continue
            seen = entry.get("seen")
            if self.ttl and (not isinstance(seen, int | float) or now - seen > self.ttl):
                continue
            kept[str(peer_id)] = entry
        return kept

    def restore(self, peer_id: str) -> UniversalStats | None:
        """The history of a returning agent, or None for one never seen."""
        entry = self.saved.get(peer_id)
        if entry is None:
            return None
        fields = {k: v for k, v in entry["stats"].items() if k in _FIELDS}
        # The file is this router's, but a hand edit must not put a string where
        # routing adds numbers: anything odd is a fresh record.
        for name, value in fields.items():
            if name.endswith("_ms"):
                ok = value is None or (is_number(value) and math.isfinite(value) and value >= 0)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok:
                return None
        return UniversalStats(**fields)

    def flush(self, table: PeerTable) -> None:
        now = time.time()
        for peer in table.all():
            stats = {name: getattr(peer.stats, name) for name in _FIELDS}
            self.saved[peer.peer_id] = {"stats": stats, "seen": now}
        if self.ttl:
            self.saved = {k: v for k, v in self.saved.items() if now - v["seen"] <= self.ttl}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.saved, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, self.path)

    async def run(self, table: PeerTable) -> None:
        try:
            while True:
                await trio.sleep(self.flush_interval)
                self._flush_logged(table)
        finally:
            self._flush_logged(table)

    def _flush_logged(self, table: PeerTable) -> None:
        try:
            self.flush(table)
        except OSError as exc:
            # A full disk must not stop routing; the next flush tries again.
            log.warning("disk_db_flush_failed path=%s error=%s", self.path, exc)
