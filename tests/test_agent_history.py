"""`--disk-db-path`: agents' router-side history across router restarts (issue 19)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.history import FILE, AgentHistory
from router.peers import PeerTable
from tests.fleet import Fleet, wait_until
from tests.test_session import make_peer


async def test_history_survives_a_restart_and_expires(tmp_path: Path, autojump_clock: Any) -> None:
    table = PeerTable()
    peer = make_peer("A")
    peer.stats.record_success(probe=False)
    peer.stats.record_rtt(40.0)
    table.add(peer)
    AgentHistory(str(tmp_path), 30, 1.0, reset=False).flush(table)
    restored = AgentHistory(str(tmp_path), 30, 1.0, reset=False).restore("A")
    assert restored is not None and restored.successes == 1 and restored.srtt_ms == 40.0
    assert "probe_at" not in (tmp_path / FILE).read_text()  # this process's clock
    assert AgentHistory(str(tmp_path), 30, 1.0, reset=False).restore("B") is None

    # An entry not seen for --disk-db-ttl days is dropped at load; 0 keeps it.
    saved = json.loads((tmp_path / FILE).read_text())
    saved["A"]["seen"] = time.time() - 31 * 86400
    (tmp_path / FILE).write_text(json.dumps(saved))
    assert AgentHistory(str(tmp_path), 30, 1.0, reset=False).restore("A") is None
    assert AgentHistory(str(tmp_path), 0, 1.0, reset=False).restore("A") is not None
    # --reset-disk-db starts empty.
    assert AgentHistory(str(tmp_path), 0, 1.0, reset=True).restore("A") is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff"])
def test_an_unreadable_history_is_a_startup_error(tmp_path: Path, text: str) -> None:
    (tmp_path / FILE).write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match="--disk-db-path"):
        AgentHistory(str(tmp_path), 30, 1.0, reset=False)


def test_hostile_entries_are_skipped(tmp_path: Path) -> None:
    (tmp_path / FILE).write_text(
        json.dumps(
            {
                "A": 5,
                "B": {"stats": {"successes": "x", "bogus": 1}, "seen": 1e18},
                "C": {"stats": {"nope": 1}, "seen": 1e18},
            }
        )
    )
    history = AgentHistory(str(tmp_path), 0, 1.0, reset=False)
    assert history.restore("A") is None
    assert history.restore("B") is None  # a string where a count belongs
    assert history.restore("C") is not None  # unknown fields dropped: a fresh record


def test_a_restarted_router_knows_a_returning_agent(fleet: Fleet, tmp_path: Path) -> None:
    db = tmp_path / "db"
    router = fleet.router("--disk-db-path", str(db), "--universal-flush-interval", "0.2s")
    agent = fleet.agent(router, "m1")
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    router.stop()
    router.start()
    joined = router.wait_agent(agent.peer_id, timeout=30)
    # Before any request of this run, the agent's round-trip time is already known.
    assert joined["universal"]["srtt"] is not None
    assert joined["universal"]["success_rate"] == 1.0
    wait_until(lambda: (db / FILE).exists(), what="history file")
