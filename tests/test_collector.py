"""Both daemons collect their young generation less often, and the router keeps what
survives a full collection out of the next ones (protocol/collector.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import trio

from agent import cli as agent_cli
from protocol.collector import YOUNG_THRESHOLD, OldFreezer, tune_collector
from router import cli as router_cli

ROUTER_ADDR = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGQaEXi5zdK6sv4u1rjM8EQrfH3GnjJb8GrmyrXrU2yZ8"


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_tune_collector_raises_only_the_young_threshold(thresholds: None) -> None:
    tune_collector()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)


def router_argv(tmp_path: Path) -> list[str]:
    return [
        "serve",
        "--http-port",
        "127.0.0.1:0",
        "--identity-path",
        str(tmp_path / "router.key"),
        "--history-path",
        str(tmp_path / "history.sqlite3"),
    ]


def agent_argv(tmp_path: Path) -> list[str]:
    return [
        *("--router", ROUTER_ADDR, "--model", "m", "--backend-url", "http://127.0.0.1:9"),
        *("--identity-path", str(tmp_path / "agent.key")),
    ]


@pytest.mark.parametrize(
    ("main", "argv"),
    [(router_cli.main, router_argv), (agent_cli.main, agent_argv)],
    ids=["router", "agent"],
)
def test_the_daemon_runs_with_the_raised_threshold(
    thresholds: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    main: Callable[[Sequence[str]], int],
    argv: Callable[[Path], list[str]],
) -> None:
    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(trio, "run", lambda *_: seen.append(gc.get_threshold()))
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", "s" * 40)
    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "admin-key")
    assert main(argv(tmp_path)) == 0
    assert seen == [(YOUNG_THRESHOLD, 10, 10)]


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_survivors_of_a_full_pass_are_frozen_and_thawed_when_grown(unfrozen: None) -> None:
    freezer = OldFreezer()
    freezer.install()
    try:
        freezer.tick()  # no full pass yet: nothing to do
        assert gc.get_freeze_count() == 0
        # A cycle alive at the first full pass is frozen with the rest.
        a, b = Node(), Node()
        a.other, b.other = b, a
        dead = weakref.ref(a)
        gc.collect()
        freezer.tick()
        assert gc.get_freeze_count() > 0
        assert freezer.baseline == gc.get_freeze_count()
        del a, b
        gc.collect()
        freezer.tick()
        assert dead() is not None, "a frozen cycle waits for a thaw"
        assert freezer.thaws == 0
        # The frozen set grows by more than a quarter: it is thawed, and the next full
        # pass, complete, frees the cycle; its survivors are the new baseline.
        grown = [[i] for i in range(int(freezer.baseline * 0.3) + 1)]
        gc.collect()
        freezer.tick()
        assert freezer.thaws == 1
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert dead() is None
        freezer.tick()
        assert freezer.baseline == gc.get_freeze_count() > len(grown)
    finally:
        freezer.uninstall()
    assert freezer.on_gc not in gc.callbacks


def test_young_passes_change_nothing(unfrozen: None) -> None:
    freezer = OldFreezer()
    freezer.install()
    try:
        gc.collect(0)
        gc.collect(1)
        freezer.tick()
        assert gc.get_freeze_count() == 0
    finally:
        freezer.uninstall()
