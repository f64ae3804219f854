"""Both daemons collect their young generation less often (protocol/collector.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from agent import cli as agent_cli
from protocol.collector import YOUNG_THRESHOLD, tune_collector
from router import cli


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_tune_collector_raises_only_the_young_threshold(
    thresholds: tuple[int, int, int],
) -> None:
    gc.set_threshold(700, 10, 10)
    tune_collector()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)


def test_serve_runs_the_daemon_with_the_raised_threshold(
    thresholds: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gc.set_threshold(700, 10, 10)
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(trio, "run", lambda *_: seen.append(gc.get_threshold()))
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 40)
    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "admin-key")
    status = cli.main(
        [
            "serve",
            "--http-port",
            "127.0.0.1:0",
            "--identity-path",
            str(tmp_path / "router.key"),
            "--history-path",
            str(tmp_path / "history.sqlite3"),
        ]
    )
    assert status == 0
    assert seen == [(YOUNG_THRESHOLD, 10, 10)]


def test_the_agent_runs_its_daemon_with_the_raised_threshold(
    thresholds: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gc.set_threshold(700, 10, 10)
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(trio, "run", lambda *_: seen.append(gc.get_threshold()))
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 40)
    router = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGQaEXi5zdK6sv4u1rjM8EQrfH3GnjJb8GrmyrXrU2yZ8"
    argv = ["--router", router, "--model", "m", "--backend-url", "http://127.0.0.1:9"]
    status = agent_cli.main([*argv, "--identity-path", str(tmp_path / "agent.key")])
    assert status == 0
    assert seen == [(YOUNG_THRESHOLD, 10, 10)]
