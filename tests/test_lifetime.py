"""Per-agent lifetime history (router/lifetime.py) through a real router restart, with
/admin/storage, POST /admin/metrics/reset and the per-agent series on /metrics."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx

from tests.fleet import ADMIN_KEY, Agent, Fleet, Proc, Router, wait_until

AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _chat(router: Router) -> dict:
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hello there"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _restart(router: Router) -> None:
    router.stop()
    ready = router.log().count("router_ready")
    router.start()
    wait_until(lambda: router.log().count("router_ready") > ready, what="router restarted")


def _universal(router: Router, agent: Agent) -> dict:
    return router.wait_agent(agent.peer_id)["universal"]


def _setup(fleet: Fleet, tmp_path: Path) -> tuple[Router, Agent, Path]:
    history = tmp_path / "history.sqlite3"
    # An audit log makes the agents report each answer's token usage.
    router = fleet.router(
        "--history-path", str(history), "--audit-log", str(tmp_path / "audit.log")
    )
    agent = fleet.agent(
        router,
        "m1",
        "--heartbeat-interval",
        "1s",
        "--deployment-id",
        "d1",
        "--organization",
        "org1",
        "--machine",
        "gpu-7",
        "--capacity",
        "6",
    )
    return router, agent, history


def test_lifetime_stats_survive_a_router_restart(fleet: Fleet, tmp_path: Path) -> None:
    router, agent, history = _setup(fleet, tmp_path)
    usages = [_chat(router), _chat(router)]
    before = _universal(router, agent)
    assert before["successful_requests_total"] == 2
    assert before["failed_requests_total"] == 0
    assert before["input_tokens_total"] == sum(u["prompt_tokens"] for u in usages) > 0
    assert before["output_tokens_total"] == sum(u["completion_tokens"] for u in usages) > 0
    assert before["latency_state"] == "KNOWN"
    assert before["rttvar_ms"] is not None

    # Written in the background within WRITE_INTERVAL (5 s), off the request path.
    storage = wait_until(
        lambda: (s := router.admin("/admin/storage"))["rows"] == 1 and s,
        what="the history written",
    )
    assert storage["path"] == str(history)
    assert storage["size_bytes"] > 0
    assert storage["last_write"].endswith("Z")

    _restart(router)
    after = _universal(router, agent)
    for key in (
        "successful_requests_total",
        "input_tokens_total",
        "output_tokens_total",
        "srtt_ms",
        "rttvar_ms",
        "success_rate",
    ):
        assert after[key] == before[key], key
    _chat(router)
    assert _universal(router, agent)["successful_requests_total"] == 3
    assert router.metric("hivenet_router_agent_requests_success_total", peer_id=agent.peer_id) == 3
    # Upstream's labels of a registered agent, which its dashboards filter on, too.
    upstream = {"organization": "org1", "machine": "gpu-7", "capacity": "6"}
    info = {"peer_id": agent.peer_id, "deployment_id": "d1", **upstream}
    assert router.metric("hivenet_router_agent_info", **info) == 1


def test_metrics_reset_clears_memory_and_disk(fleet: Fleet, tmp_path: Path) -> None:
    router, agent, history = _setup(fleet, tmp_path)
    _chat(router)
    wait_until(lambda: router.admin("/admin/storage")["rows"] == 1, what="the history written")

    url = router.url + "/admin/metrics/reset"
    assert httpx.post(url, timeout=10).status_code == 401
    assert httpx.get(url, headers=AUTH, timeout=10).status_code == 405
    r = httpx.post(url, headers=AUTH, timeout=10)
    assert r.status_code == 200
    assert r.json()["status"] == "metrics reset"

    cleared = _universal(router, agent)
    assert cleared["successful_requests_total"] == 0
    assert cleared["input_tokens_total"] == 0
    assert cleared["srtt_ms"] is None
    assert cleared["latency_state"] == "UNKNOWN"
    assert router.admin("/admin/storage")["rows"] == 0
    with sqlite3.connect(history) as db:
        assert db.execute("SELECT count(*) FROM agent_history").fetchone()[0] == 0

    _restart(router)
    assert _universal(router, agent)["successful_requests_total"] == 0


def test_a_disconnection_is_counted(fleet: Fleet, tmp_path: Path) -> None:
    router, agent, _ = _setup(fleet, tmp_path)
    agent.stop()
    seen = wait_until(
        lambda: (a := router.agent(agent.peer_id)) and a["universal"]["disconnections_total"],
        what="the disconnection counted",
    )
    assert seen == 1


def test_a_history_file_that_is_not_sqlite_is_a_startup_error(fleet: Fleet, tmp_path: Path) -> None:
    bad = tmp_path / "not-a-db"
    bad.write_bytes(b"this is not an SQLite database, just some text " * 100)
    router = fleet.router("--history-path", str(bad), start=False)
    Proc.start(router)  # not Router.start: no router_ready to wait for
    assert router.popen is not None
    assert router.popen.wait(30) == 2
    assert f"hivenet-router: --history-path {bad}: file is not a database" in router.log()


def test_an_answer_the_engine_refused_is_neither_a_rejection_nor_a_failure(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The client's error, not the agent's: upstream's rejections are capacity refusals
    (tests/test_session.py)."""
    router, agent, _ = _setup(fleet, tmp_path)
    agent.sim_state(fail_count=1, fail_status=400, fail_body={"error": {"message": "bad"}})
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hello"}]},
        timeout=30,
    )
    assert r.status_code == 400
    universal = _universal(router, agent)
    assert universal["rejected_requests_total"] == 0
    assert universal["failed_requests_total"] == 0
    assert router.metric("hivenet_router_agent_rejected_requests_total") == 0


def test_a_history_file_written_before_the_failure_counts_gains_them(tmp_path: Path) -> None:
    """A file from before `agent_failures`/`backend_failures` is read as it is (the two
    start at 0) and written with them from then on."""
    from router.lifetime import LifetimeStore
    from router.peers import PeerTable

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE agent_history (peer_id TEXT PRIMARY KEY, successes INTEGER NOT NULL,"
            " failures INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER"
            " NOT NULL, rejections INTEGER NOT NULL, disconnections INTEGER NOT NULL, srtt_ms"
            " REAL, rttvar_ms REAL, updated_at REAL NOT NULL)"
        )
        db.execute("INSERT INTO agent_history VALUES ('p1', 5, 1, 10, 20, 0, 2, 12.5, 3.0, 0)")
    db.close()
    store = LifetimeStore(str(path), PeerTable())
    store.load()
    stats = store.restore("p1")
    assert stats is not None
    assert (stats.successes, stats.disconnections, stats.srtt_ms) == (5, 2, 12.5)
    assert (stats.agent_failures, stats.backend_failures) == (0, 0)
    store.close()
    with sqlite3.connect(path) as db:
        columns = {row[1] for row in db.execute("PRAGMA table_info(agent_history)")}
    db.close()
    assert {"agent_failures", "backend_failures"} <= columns
