"""Both daemons collect their young generation less often, and the router keeps what
survives each short tick out of the next passes (protocol/collector.py)."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import trio

from agent import cli as agent_cli
from protocol.collector import YOUNG_THRESHOLD, Freezer, resident_pages, tune_collector
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


def unfrozen_objects() -> int:
    """What the collector's passes walk: every tracked object not frozen."""
    return sum(len(gc.get_objects(generation=g)) for g in range(3))


def test_a_young_pass_walks_only_what_the_last_tick_left(unfrozen: None) -> None:
    """1,000 sessions, each waiting for its next heartbeat in a chain of coroutines that
    a heartbeat rebuilds, as a router's agents do, a fifth of them heard from between
    two ticks. Net of what dies, a heartbeat allocates nothing: the raised young
    threshold is not reached, and without the ticks a pass, when one came, walked
    every session's wait (each rebuilt since the last pass); with them, a fifth's."""
    sessions, groups = 1000, 5
    group = sessions // groups
    walked: list[int] = []
    freezer = Freezer()

    async def wait_for(beat: trio.Event) -> None:
        await beat.wait()

    async def session(beats: list[trio.Event], i: int) -> None:
        while True:
            await wait_for(beats[i])

    async def main() -> None:
        beats = [trio.Event() for _ in range(sessions)]
        async with trio.open_nursery() as nursery:
            for i in range(sessions):
                nursery.start_soon(session, beats, i)
            await trio.sleep(0.01)
            freezer.tick()  # the first: one complete pass
            for r in range(2 * groups):  # two heartbeat periods
                for i in range(r % groups * group, (r % groups + 1) * group):
                    beat, beats[i] = beats[i], trio.Event()
                    beat.set()
                await trio.sleep(0.01)
                walked.append(unfrozen_objects())
                freezer.tick()
            nursery.cancel_scope.cancel()

    before = gc.get_threshold()
    tune_collector()
    try:
        trio.run(main)
    finally:
        gc.set_threshold(*before)
    assert freezer.complete_passes == 1
    # A wait is about a dozen objects; what a pass would walk is one group's waits,
    # not every group's since the last pass (all 1,000 sessions' by the fifth tick).
    assert all(group * 5 < n < group * 30 for n in walked), walked


def test_a_tick_frees_young_cycles_and_freezes_the_survivors(unfrozen: None) -> None:
    in_use = [100]
    freezer = Freezer(in_use=lambda: in_use[0])
    freezer.tick()  # the first tick: one complete pass, its survivors frozen
    assert freezer.complete_passes == 1 and freezer.baseline == 100
    assert unfrozen_objects() < 100
    frozen = gc.get_freeze_count()
    dead_young = Node()
    dead_young.other = dead_young
    young_gone = weakref.ref(dead_young)
    kept = [Node() for _ in range(50)]
    del dead_young
    freezer.tick()
    assert young_gone() is None, "a cycle that died before the tick is freed by it"
    assert gc.get_freeze_count() >= frozen + len(kept)
    assert unfrozen_objects() < 100
    assert freezer.complete_passes == 1


def test_frozen_cycles_wait_for_the_memory_to_grow_a_quarter(unfrozen: None) -> None:
    in_use = [1000]
    freezer = Freezer(in_use=lambda: in_use[0])
    freezer.tick()
    a, b = Node(), Node()
    a.other, b.other = b, a
    dead = weakref.ref(a)
    freezer.tick()  # frozen alive
    del a, b
    in_use[0] = 1250  # a quarter more: not yet
    freezer.tick()
    gc.collect()  # an automatic full pass skips what is frozen
    assert dead() is not None, "a frozen cycle waits for a complete pass"
    assert freezer.complete_passes == 1
    in_use[0] = 1251
    freezer.tick()
    assert dead() is None
    assert freezer.complete_passes == 2 and freezer.baseline == 1251
    assert gc.get_freeze_count() > 0


def test_the_memory_in_use_is_the_resident_pages_and_grows_with_it() -> None:
    """The ticks' measure of memory (read every 0.5 s, so it must be cheap: not the
    allocator's walk of its pools) is the process's resident pages, and it grows by
    what is allocated and touched."""
    before = resident_pages()
    page = os.sysconf("SC_PAGE_SIZE")
    held = bytearray(64 * 1024 * 1024)  # zeroed: every page touched
    try:
        grown = resident_pages() - before
    finally:
        del held
    assert grown * page >= 48 * 1024 * 1024, (before, grown)
    assert Freezer()._in_use is resident_pages


def test_without_proc_the_memory_in_use_is_the_allocators_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_proc(path: str, flags: int) -> int:
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "open", no_proc)
    monkeypatch.setattr("sys.getallocatedblocks", lambda: 4242)
    assert resident_pages() == 4242
