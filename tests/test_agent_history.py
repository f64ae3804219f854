"""The Go router's `--disk-db-*` flags drive the one per-agent history (router/lifetime.py)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import trio

from protocol import messages as m
from protocol.tokens import issue_token
from router.cli import build_parser, settings_from
from router.lifetime import FILE_NAME, HistoryUnwritable, LifetimeStore, history_path
from router.link import AgentLink, AgentSession, LinkSettings
from router.metrics import RouterMetrics
from router.peers import Peer, PeerTable
from router.settings import RouterSettings
from tests.fleet import SECRET, Fleet
from tests.test_link import METADATA
from tests.test_link_fuzz import PEER, RecordingStream
from tests.test_session import make_peer


def _settings(*flags: str) -> RouterSettings:
    return settings_from(build_parser().parse_args(["serve", *flags]))


def test_the_history_file_is_where_the_flags_say(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "k")
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 32)
    key = tmp_path / "id.key"
    assert history_path(_settings("--identity-path", str(key))) == str(tmp_path / FILE_NAME)
    db = tmp_path / "db"
    assert history_path(_settings("--disk-db-path", str(db))) == str(db / FILE_NAME)
    named = tmp_path / "h.sqlite3"
    assert history_path(_settings("--disk-db-path", str(db), "--history-path", str(named))) == str(
        named
    )
    assert _settings().universal_flush_interval == 5.0


def test_each_worker_keeps_its_own_history_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each worker has its own session with every agent and its own counts for it."""
    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "k")
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 32)
    key = str(tmp_path / "id.key")

    def worker(i: int, *flags: str) -> str:
        both = ("--identity-path", key, "--worker-index", str(i), "--worker-count", "2")
        return history_path(_settings(*both, *flags))

    assert worker(0) == str(tmp_path / FILE_NAME)
    assert worker(1) == str(tmp_path / FILE_NAME) + ".worker1"
    named = str(tmp_path / "h.sqlite3")
    assert worker(1, "--history-path", named) == named + ".worker1"


async def _saved(path: Path, peer_id: str) -> None:
    table = PeerTable()
    peer = make_peer(peer_id)
    peer.stats.record_success(probe=False)
    peer.stats.record_rtt(40.0)
    table.add(peer)
    store = LifetimeStore(str(path), table)
    store.load()
    await store.write()
    store.close()


async def test_ttl_drops_old_rows_and_reset_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "db" / FILE_NAME  # the directory is made when missing
    await _saved(path, "A")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE agent_history SET updated_at = ?", (time.time() - 31 * 86400,))

    kept = LifetimeStore(str(path), PeerTable(), ttl_days=0)
    kept.load()
    restored = kept.restore("A")
    assert restored is not None and restored.successes == 1 and restored.srtt_ms == 40.0
    kept.close()

    expired = LifetimeStore(str(path), PeerTable(), ttl_days=30)
    expired.load()
    assert expired.restore("A") is None
    expired.close()

    await _saved(path, "B")
    fresh = LifetimeStore(str(path), PeerTable(), reset=True)
    fresh.load()
    assert fresh.restore("B") is None and fresh.rows == 0
    fresh.close()


def test_a_restarted_router_knows_a_returning_agent(fleet: Fleet, tmp_path: Path) -> None:
    db = tmp_path / "db"
    router = fleet.router("--disk-db-path", str(db), "--universal-flush-interval", "0.2s")
    agent = fleet.agent(router, "m1")
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    router.stop()
    assert (db / FILE_NAME).exists()
    router.start()
    joined = router.wait_agent(agent.peer_id, timeout=30)
    # Before any request of this run, the agent's round-trip time is already known.
    assert joined["universal"]["srtt"] is not None
    assert joined["universal"]["success_rate"] == 1.0


async def test_an_agent_removed_and_back_keeps_its_history(tmp_path: Path) -> None:
    """Silent past --remove-after, the agent leaves the table; when it comes back to the
    same router its history is its own, not a blank that then overwrites its row."""
    path = tmp_path / FILE_NAME
    table = PeerTable()
    store = LifetimeStore(str(path), table)
    store.load()
    settings = LinkSettings(SECRET.encode(), 5.0, 15.0, 30.0, "r")
    link = AgentLink(table, RouterMetrics(), settings, lifetime=store)

    def join() -> Peer:
        session = AgentSession(link, RecordingStream(), PEER)  # type: ignore[arg-type]
        session.on_message(m.hello(issue_token(SECRET.encode(), PEER, 60), METADATA))
        assert session.peer is not None
        return session.peer

    first = join()
    first.stats.record_success(probe=False)
    first.stats.record_rtt(40.0)
    link._sweep_table(trio.current_time() + 31.0)
    assert table.get(PEER) is None
    await store.write()  # the removed agent's last counts reach the file
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT successes FROM agent_history").fetchall() == [(1,)]
    db.close()

    back = join()
    assert (back.stats.successes, back.stats.srtt_ms) == (1, 40.0)
    back.stats.record_success(probe=False)
    await store.write()
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT successes FROM agent_history").fetchall() == [(2,)]
    db.close()


async def test_a_reset_the_file_refuses_resets_nothing(tmp_path: Path) -> None:
    """A reset cleared in memory but not on disk would come back at the next restart;
    it is refused whole, with the file's reason."""
    path = tmp_path / FILE_NAME
    await _saved(path, "A")
    table = PeerTable()
    store = LifetimeStore(str(path), table)
    store.load()
    peer = make_peer("A")
    stats = store.restore("A")
    assert stats is not None
    peer.stats = stats
    table.add(peer)
    holder = sqlite3.connect(path)  # another process's write lock, say a backup's
    holder.execute("BEGIN EXCLUSIVE")
    assert store._db is not None
    store._db.execute("PRAGMA busy_timeout = 0")  # not the 5 s wait for the lock
    with pytest.raises(HistoryUnwritable, match="locked"):
        await store.reset()
    holder.rollback()
    holder.close()
    assert peer.stats.successes == 1
    assert store.storage()["last_error"] == "database is locked"
    await store.reset()
    assert peer.stats.successes == 0
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM agent_history").fetchone() == (0,)
    db.close()


async def test_a_write_that_keeps_failing_is_said_once_and_its_counts_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A locked (or full, or read-only) file: one warning for the outage, not one every
    5 s, and the counts are written once it takes them."""
    caplog.set_level("INFO", logger="history")
    path = tmp_path / FILE_NAME
    table = PeerTable()
    store = LifetimeStore(str(path), table)
    store.load()
    assert store._db is not None
    store._db.execute("PRAGMA busy_timeout = 0")  # not the 5 s wait for the lock
    peer = make_peer("A")
    table.add(peer)
    holder = sqlite3.connect(path)
    holder.execute("BEGIN EXCLUSIVE")
    for _ in range(3):
        peer.stats.record_success(probe=False)
        await store.write()
    assert store.storage()["last_error"] == "database is locked"
    holder.rollback()
    holder.close()
    await store.write()
    store.close()
    said = [r.getMessage().split()[0] for r in caplog.records]
    assert said.count("history_write_failed") == 1
    assert said[-1] == "history_write_recovered"
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT successes FROM agent_history").fetchall() == [(3,)]
    db.close()
