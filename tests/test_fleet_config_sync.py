"""router/fleet/config_sync.py against unlucky timing and a Redis that goes away: a
change made on a router is never replaced by the fleet's older text, nor lost.

Redis is an in-memory stand-in whose calls run inline (not in a worker thread), so
the virtual clock decides every interleaving."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis
import trio
import trio.testing
from prometheus_client import Counter

from router.documents import Contended, DocumentStore, PreconditionFailed, matches, version_of
from router.fleet import config_sync
from router.fleet.config_sync import KEY, NAMED, ConfigSync
from router.metrics import RouterMetrics
from router.policy.store import PolicyStore


class TextStore(DocumentStore[str]):
    """A document that is its text; any text is valid."""

    kind = "policy"
    noun = title = "policy"

    def __init__(self, text: str) -> None:
        reloads = Counter("test_reloads", "reloads", ["result"], registry=None)
        super().__init__(reloads, logging.getLogger("test"), None)
        self.text = text

    def parse(self, text: str) -> str:
        return text

    def source(self) -> str:
        return self.text

    def text_of(self, value: str) -> str:
        return value

    def install(self, value: str) -> str:
        self.text = value
        return ""


class FakeRedis:
    """The calls ConfigSync makes; `down` makes each one fail as a lost Redis does, and
    `on_read` runs inside the next version read (what happens meanwhile elsewhere)."""

    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, bytes]] = {}
        self.sets: dict[str, set[bytes]] = {}
        self.down = False
        self.on_read: Callable[[], None] | None = None
        self.on_fetch: Callable[[], None] | None = None
        # Runs just before the next compare-and-swap (another router's write landing).
        self.on_swap: Callable[[], None] | None = None

    def _up(self) -> None:
        if self.down:
            raise redis.ConnectionError("Connection refused")

    def hget(self, key: str, field: str) -> bytes | None:
        self._up()
        if field == "version" and self.on_read is not None:
            hook, self.on_read = self.on_read, None
            hook()
        return self.hashes.get(key, {}).get(field)

    def hmget(self, key: str, *fields: str) -> list[bytes | None]:
        self._up()
        if self.on_fetch is not None:
            hook, self.on_fetch = self.on_fetch, None
            hook()
        return [self.hashes.get(key, {}).get(f) for f in fields]

    def hset(self, key: str, mapping: dict[str, str]) -> None:
        self._up()
        self.hashes.setdefault(key, {}).update({k: v.encode() for k, v in mapping.items()})

    def sadd(self, key: str, member: str) -> None:
        self._up()
        self.sets.setdefault(key, set()).add(member.encode())

    def smembers(self, key: str) -> set[bytes]:
        self._up()
        return set(self.sets.get(key, set()))

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return FakePipeline(self)

    def register_script(self, script: str) -> Callable[..., int]:
        """The compare-and-swap of config_sync's `_SWAP`, the one script it runs."""

        def swap(keys: list[str], args: list[str]) -> int:
            self._up()
            if self.on_swap is not None:
                hook, self.on_swap = self.on_swap, None
                hook()
            base, version, text, router, kind = args
            if self.hashes.get(keys[0], {}).get("version", b"").decode() != base:
                return 0
            self.hset(keys[0], {"version": version, "text": text, "router": router})
            self.sadd(keys[1], kind)
            return 1

        return swap


class FakePipeline:
    def __init__(self, client: FakeRedis) -> None:
        self.client = client
        self.calls: list[Callable[[], Any]] = []

    def __enter__(self) -> FakePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        method = getattr(self.client, name)
        return lambda *a, **kw: self.calls.append(lambda: method(*a, **kw))

    def execute(self) -> list[Any]:
        self.client._up()
        return [call() for call in self.calls]


async def _inline(fn: Callable[[], Any], abandon_on_cancel: bool = False) -> Any:
    await trio.lowlevel.checkpoint()
    return fn()


@pytest.fixture(autouse=True)
def _calls_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trio.to_thread, "run_sync", _inline)


def fleet_text(client: FakeRedis) -> str:
    return client.hashes[KEY + "policy"]["text"].decode()


def router(client: FakeRedis, name: str, text: str) -> tuple[ConfigSync, TextStore]:
    store = TextStore(text)
    sync = ConfigSync(client, name)  # type: ignore[arg-type]
    sync.add(store)
    return sync, store


def run(main: Callable[[], Any]) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_change_made_while_redis_is_down_reaches_the_fleet_when_it_is_back() -> None:
    client = FakeRedis()
    (sync_a, a), (sync_b, b) = router(client, "A", "one"), router(client, "B", "from B's file")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_a.run)
            await trio.sleep(1)
            nursery.start_soon(sync_b.run)
            await trio.sleep(1)
            assert b.text == "one"  # B adopts what the fleet runs
            client.down = True
            assert a.replace("two", "admin") == []
            await trio.sleep(5)
            client.down = False
            await trio.sleep(1)
            nursery.cancel_scope.cancel()

    run(main)
    assert (a.text, b.text, fleet_text(client)) == ("two", "two", "two")
    # Written, so no longer held against the fleet's next change.
    assert sync_a.unpublished == sync_b.unpublished == set()


def test_a_redis_that_lost_its_data_gets_the_routers_documents_back() -> None:
    client = FakeRedis()
    sync_a, _ = router(client, "A", "one")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_a.run)
            await trio.sleep(1)
            assert fleet_text(client) == "one"
            client.hashes.clear()  # restarted without persistence
            await trio.sleep(1)
            nursery.cancel_scope.cancel()

    run(main)
    assert fleet_text(client) == "one"


def test_a_change_made_while_a_poll_reads_redis_is_not_undone_by_it() -> None:
    client = FakeRedis()
    sync_a, a = router(client, "A", "one")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_a.run)
            await trio.sleep(1)
            # A PUT answered while the poll's read of the versions is in flight: the
            # read says "one", which is now the older text.
            client.on_read = lambda: a.replace("two", "admin")
            await trio.sleep(1)
            nursery.cancel_scope.cancel()

    run(main)
    assert client.on_read is None
    assert (a.text, fleet_text(client)) == ("two", "two")


def named_policy(strategy: str) -> str:
    return f"models: [m1]\nrouting_policy:\n  strategy: {strategy}\n"


def test_a_model_policy_changed_while_a_poll_fetches_the_fleets_is_not_undone() -> None:
    client = FakeRedis()
    store = PolicyStore(RouterMetrics())
    sync = ConfigSync(client, "A")  # type: ignore[arg-type]
    sync.add(store)
    sync.add_named_policies(store)
    key = KEY + NAMED + "one"

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync.run)
            assert store.put_named("one", named_policy("least-loaded"), "admin") == []
            await trio.sleep(1)
            assert client.hashes[key]["text"].decode() == named_policy("least-loaded")
            # Another router writes its version; this router's PUT is answered while
            # the poll fetches that text.
            other = named_policy("round-robin")
            client.hset(key, {"version": version_of(other), "text": other, "router": "B"})
            client.on_fetch = lambda: store.put_named("one", named_policy("lowest-srtt"), "admin")
            await trio.sleep(1)
            nursery.cancel_scope.cancel()

    run(main)
    assert client.on_fetch is None
    assert store.models.named["one"].policy.source == named_policy("lowest-srtt")
    assert client.hashes[key]["text"].decode() == named_policy("lowest-srtt")


def test_a_write_that_another_routers_write_overtakes_is_built_again_on_it() -> None:
    client = FakeRedis()
    sync_a, a = router(client, "A", "one")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_a.run)
            await trio.sleep(1)

            # Router B's write lands after A read the fleet's version, before A's swap.
            def other() -> None:
                client.hset(KEY + "policy", {"version": version_of("one+B"), "text": "one+B"})

            client.on_swap = other
            assert await a.change(lambda: a.text + "+A", "admin") == []
            nursery.cancel_scope.cancel()

    run(main)
    # Neither write lost: A's was made again from B's document.
    assert (a.text, fleet_text(client)) == ("one+B+A", "one+B+A")


def test_if_match_is_checked_against_the_fleets_version() -> None:
    client = FakeRedis()
    sync_a, a = router(client, "A", "one")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_a.run)
            await trio.sleep(1)
            seen = a.version()
            client.hset(KEY + "policy", {"version": version_of("two"), "text": "two"})
            # Before any poll: the tag this router showed is stale in the fleet.
            with pytest.raises(PreconditionFailed) as stale:
                await a.change(lambda: "three", "admin", f'"{seen}"')
            assert stale.value.current == version_of("two") == a.version()
            assert await a.change(lambda: "three", "admin", f'"{a.version()}"') == []
            nursery.cancel_scope.cancel()

    run(main)
    assert fleet_text(client) == "three"


def test_if_match_headers_are_read_as_rfc_9110_says() -> None:
    version = version_of("one")
    assert matches(None, version)
    assert matches("*", version)
    assert matches(f'"{version}"', version)
    assert matches(f'"other", "{version}"', version)
    for stale in (version, f'W/"{version}"', '"other"', "", ",,,", '"' * 10_000):
        assert not matches(stale, version)


def test_without_redis_if_match_is_checked_against_the_routers_own_document() -> None:
    store = TextStore("one")

    async def main() -> None:
        with pytest.raises(PreconditionFailed):
            await store.change(lambda: "two", "admin", '"stale"')
        assert await store.change(lambda: "two", "admin", f'"{version_of("one")}"') == []

    trio.run(main)
    assert store.text == "two"


def test_a_write_that_loses_every_try_is_contended_not_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = FakeRedis()
    sync_a, a = router(client, "A", "one")
    monkeypatch.setattr(config_sync, "MAX_TRIES", 3)
    others = iter(range(1_000))

    def busy_fleet() -> None:
        text = f"other-{next(others)}"
        client.hset(KEY + "policy", {"version": version_of(text), "text": text})
        client.on_swap = busy_fleet  # and again at the next try

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_a.run)
            await trio.sleep(1)
            client.on_swap = busy_fleet
            with pytest.raises(Contended):
                await a.change(lambda: a.text + "+A", "admin")
            client.on_swap = None
            nursery.cancel_scope.cancel()

    run(main)
    assert "+A" not in fleet_text(client)
