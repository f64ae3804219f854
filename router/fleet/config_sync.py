"""One configuration for every router that shares a `--state-url`.

Each reloadable document (the policy, the auth file, the /admin/api-keys registry,
each per-model policy as `policy/model/<name>`) lives in Redis as a hash
`hivenet:config:<kind>` of `version` (router/documents.py `version_of`), `text` and
`router`. A change made on one router (PUT, SIGHUP) is validated there first and
written only once it runs; every router reads the versions each POLL_INTERVAL and
installs a new text through the same `DocumentStore.replace` that PUT uses, so each
router validates it. A text a router rejects is logged once with the reasons
(`<kind>_reload_failed origin=fleet`) and that router keeps its running document:
never half-applied.

Why polling and not pub/sub: redis-py's pub/sub blocks a thread per router for as long
as it listens (its asyncio client does not run under trio), and a message published
while a router reconnects is lost; a poll of one small key per document every 0.2 s is
one HMGET per 0.2 s (about 30 µs of Redis time each) and never misses the last change.
At start-up a router adopts the fleet's documents, or publishes its own when the fleet
has none yet; so it does later when the fleet's copy is gone (a Redis restarted empty).
A change made here stays `unpublished` until Redis has it: the polls neither replace it
with the fleet's older text (a PUT landing while a poll reads, or while Redis is down)
nor forget it, and each poll tries the write again. Without `--state-url` nothing here
runs.

Per-model policies come and go, so their kinds are listed in the set
`hivenet:config:kinds`, and a deleted one stays as an empty text (its tombstone), which
deletes it on the routers that have it. A router finds its own changes to them (PUT,
DELETE, a SIGHUP of --policy-model-dir) by comparing each poll what it runs with what
it last had in step with the fleet (`NamedPolicies`), so no write path needs a hook.

A write through the admin API (`DocumentStore.change`: `PUT /admin/policy`, `PUT
/admin/auth`, each `/admin/api-keys` write; `PolicyStore.change_named`: each
`/admin/policy/models/<name>` PUT and DELETE) is a compare-and-swap on the fleet's copy,
so no write is lost when several routers take writes at once: the router first adopts
the fleet's version (one HGET; the text only when it differs), checks `If-Match`
against it, builds and validates the next document from it, then one Lua script
writes it only if the fleet's version is still the one it was built from. When
another router wrote in between, the write starts again from that router's document
(up to MAX_TRIES; each try lets at least one router's write land). Writes of one kind
on one router go one at a time, so three routers taking 100 key writes at once
contend three at a time. The registry's own version then only decides when a change
made while Redis was away meets the fleet's (`DocumentStore.supersedes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
import trio

from protocol.logs import quote
from router import state_url
from router.documents import (
    Contended,
    DocumentError,
    DocumentStore,
    PreconditionFailed,
    matches,
    version_of,
)
from router.policy.models import ModelConflict
from router.policy.store import PolicyStore

log = logging.getLogger("fleet")

# A change reaches every router within this period plus one Redis round trip.
POLL_INTERVAL = 0.2
CALL_TIMEOUT = 0.5
KEY = "hivenet:config:"
KINDS = KEY + "kinds"
NAMED = "policy/model/"
FLEET_ORIGIN = "fleet"
# A deleted per-model policy: no text.
TOMBSTONE = version_of("")
# Tries of one write against writes landing on other routers; each try lets at least
# one of the contending routers' writes land, so this is met only by a fleet of more
# routers than this writing the same document without pause.
MAX_TRIES = 50

# KEYS: the document's hash, the set of kinds. ARGV: the version the write was built
# from ('' for none), the new version, its text, this router, the kind. 1 when written,
# 0 when the fleet's version is another one by now.
_SWAP = """
local current = redis.call('HGET', KEYS[1], 'version') or ''
if current ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'text', ARGV[3], 'router', ARGV[4])
redis.call('SADD', KEYS[2], ARGV[5])
return 1
"""


class NamedPolicies:
    """The per-model policy documents of one PolicyStore, as kinds `policy/model/<name>`."""

    def __init__(self, store: PolicyStore) -> None:
        self.store = store
        # Name → the version this router and the fleet last agreed on; an absent name
        # agrees on "no document" (TOMBSTONE).
        self.synced: dict[str, str] = {}
        self._versions: dict[str, tuple[str, str]] = {}

    def texts(self) -> dict[str, str]:
        return {name: doc.policy.source for name, doc in self.store.models.named.items()}

    def version(self, name: str) -> str:
        named = self.store.models.named.get(name)
        text = named.policy.source if named is not None else ""
        cached = self._versions.get(name)
        if cached is None or cached[0] is not text:
            cached = self._versions[name] = (text, version_of(text))
        return cached[1]

    def install(self, name: str, text: str) -> list[str]:
        """Run the fleet's `text` for `name` (empty: delete it); ModelConflict raised."""
        if not text:
            if self.store.models.delete(name):
                self.store.log.info("policy_removed origin=fleet name=%s", quote(name))
            return []
        return self.store.put_named(name, text, FLEET_ORIGIN)


class ConfigSync:
    def __init__(self, client: redis.Redis, router_id: str) -> None:
        self.client = client
        self.router_id = router_id
        self.stores: dict[str, DocumentStore[Any]] = {}
        # Versions this router rejected: logged once, not re-validated every poll.
        self.rejected: dict[str, str] = {}
        # Kinds changed here whose text Redis may not hold yet; ours wins over the fleet's.
        # The publish loop writes them at once (woken by `_changed`), each poll again.
        self.unpublished: set[str] = set()
        self._changed = trio.Event()
        self.available = True
        self.named: NamedPolicies | None = None
        # Per-model policy versions refused for a model another document claims: said
        # once, tried again each poll (the other document may be deleted next).
        self.conflicts: dict[str, str] = {}
        # Kinds with an admin write under way here: the polls leave them to it.
        self.writing: set[str] = set()
        self._locks: dict[str, trio.Lock] = {}
        self._swap: Any = None

    def __repr__(self) -> str:
        versions = ", ".join(f"{k}={s.version()}" for k, s in self.stores.items())
        return f"<ConfigSync {versions}>"

    def add(self, store: DocumentStore[Any]) -> None:
        """Keep `store`'s document the same on every router."""
        self.stores[store.kind] = store
        store.fleet = self

        def replaced(origin: str) -> None:
            if origin != FLEET_ORIGIN:
                self.unpublished.add(store.kind)
                self._changed.set()

        store.on_replaced.append(replaced)

    def add_named_policies(self, store: PolicyStore) -> None:
        """Keep `store`'s per-model policies the same on every router."""
        self.named = NamedPolicies(store)
        store.named_fleet = self

    async def run(self) -> None:
        await self._start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._publish_loop)
            while True:
                await trio.sleep(POLL_INTERVAL)
                await self._poll()
                if self.named is not None:
                    await self._poll_named()

    async def _start(self) -> None:
        if self.named is not None:
            # What a router starts with counts as in step: the fleet's copy wins.
            self.named.synced = {n: self.named.version(n) for n in self.named.texts()}
        await self._poll()

    async def _publish_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            await self._publish_unpublished()

    async def _publish_unpublished(self) -> None:
        for kind in sorted(self.unpublished):
            if kind in self.unpublished:  # not published meanwhile (a poll's, the loop's)
                await self._publish(kind)

    async def _publish(self, kind: str) -> None:
        store = self.stores[kind]
        # The text is read now: a change made during the write marks the kind again.
        self.unpublished.discard(kind)
        if not await self._write(kind, store.version(), store.source()):
            self.unpublished.add(kind)

    async def _write(self, kind: str, version: str, text: str) -> bool:
        mapping = {"version": version, "text": text, "router": self.router_id}

        def write() -> list[Any]:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(KEY + kind, mapping=mapping)
                pipe.sadd(KINDS, kind)
                return pipe.execute()

        # `_call` says a failed call with None: the pipeline's answer is a list.
        done = await self._call(write) is not None
        if done:
            log.info("config_published kind=%s version=%s", quote(kind), version)
        return done

    async def write(
        self,
        store: DocumentStore[Any],
        prepare: Callable[[], Any],
        origin: str,
        if_match: str | None,
    ) -> list[str]:
        """`store.change` with --state-url: a compare-and-swap on the fleet's copy."""
        kind = store.kind
        lock = self._locks.setdefault(kind, trio.Lock())
        async with lock:
            self.writing.add(kind)
            try:
                for _ in range(MAX_TRIES):
                    base = await self._adopt(store)
                    if not matches(if_match, store.version()):
                        raise PreconditionFailed(store.version())
                    try:
                        value = prepare()
                    except DocumentError as exc:
                        return store.reject(exc.errors, origin)
                    text = store.text_of(value)
                    landed = None if base is None else await self._cas(kind, base, text)
                    if landed is False:
                        continue  # another router's write landed first: build on it
                    await store.before_commit(value)
                    store.commit(value, origin)
                    if landed:
                        log.info(
                            "config_published kind=%s version=%s", quote(kind), version_of(text)
                        )
                        self.unpublished.discard(kind)
                    # else Redis is away: this router runs it alone; published when back.
                    return []
                raise Contended(kind)
            finally:
                self.writing.discard(kind)

    async def write_named(
        self, name: str, text: str | None, origin: str, if_match: str | None
    ) -> list[str]:
        """`PolicyStore.change_named` with --state-url: a compare-and-swap on the
        fleet's copy of document `name`, as `write` is for the other documents."""
        named = self.named
        assert named is not None
        store, kind = named.store, NAMED + name
        lock = self._locks.setdefault(kind, trio.Lock())
        async with lock:
            self.writing.add(kind)
            try:
                for _ in range(MAX_TRIES):
                    base = await self._adopt_named(named, name)
                    current = store.named_version(name)
                    if if_match is not None and (current is None or not matches(if_match, current)):
                        raise PreconditionFailed(current or TOMBSTONE)
                    if text is None:
                        errors = store.check_removal(name)
                        if errors:
                            return store.reject(errors, origin)
                        policy = None
                    else:
                        try:
                            policy = store.check_named(name, text)
                        except DocumentError as exc:
                            return store.reject(exc.errors, origin)
                    landed = None if base is None else await self._cas(kind, base, text or "")
                    if landed is False:
                        continue  # another router's write landed first: build on it
                    if policy is None:
                        store.delete_named(name, origin)
                    else:
                        store.install_named(name, policy, origin)
                    if landed:
                        named.synced[name] = named.version(name)
                        log.info(
                            "config_published kind=%s version=%s",
                            quote(kind),
                            named.version(name),
                        )
                    # else Redis is away: the polls publish it when it is back.
                    return []
                raise Contended(kind)
            finally:
                self.writing.discard(kind)

    async def _adopt_named(self, named: NamedPolicies, name: str) -> str | None:
        """Run the fleet's copy of document `name` when it differs from this router's;
        the fleet's version ('' when it has none, None when Redis is away)."""
        kind = NAMED + name
        fetched = await self._call(lambda: self.client.hmget(KEY + kind, "version", "text"))
        if fetched is None:
            return None
        if fetched[0] is None or fetched[1] is None:
            return ""
        version = fetched[0].decode()
        if version != named.version(name) and self.rejected.get(kind) != version:
            try:
                errors = named.install(name, fetched[1].decode("utf-8", "replace"))
            except ModelConflict as exc:
                errors = named.store.reject([str(exc)], FLEET_ORIGIN)
            if not errors:
                named.synced[name] = named.version(name)
        return version

    async def _adopt(self, store: DocumentStore[Any]) -> str | None:
        """Make the fleet's copy of `store`'s document the running one, when they
        differ; the fleet's version ('' when it has none, None when Redis is away)."""
        kind = store.kind
        if kind in self.unpublished:
            # A change made here while Redis was away goes first, as the polls do.
            await self._publish(kind)
            if kind in self.unpublished:
                return None
        # In a list: a missing field is None as a failed call is.
        got = await self._call(lambda: [self.client.hget(KEY + kind, "version")])
        if got is None:
            return None
        if got[0] is None:
            return ""
        version = got[0].decode()
        if version == store.version():
            return version
        fetched = await self._call(
            lambda: self.client.hmget(KEY + kind, "version", "text", "router")
        )
        if fetched is None:
            return None
        if fetched[0] is None or fetched[1] is None:
            return ""
        version = fetched[0].decode()
        if version != store.version() and self.rejected.get(kind) != version:
            self._install(store, version, fetched[1], fetched[2])
        return version

    async def _cas(self, kind: str, base: str, text: str) -> bool | None:
        """Write `text` if the fleet's version is still `base`; None when Redis is away."""
        if self._swap is None:
            self._swap = self.client.register_script(_SWAP)
        args = [base, version_of(text), text, self.router_id, kind]
        done = await self._call(lambda: self._swap(keys=[KEY + kind, KINDS], args=args))
        return None if done is None else bool(done)

    def _install(self, store: DocumentStore[Any], version: str, raw: bytes, by: Any) -> None:
        """Run the fleet's text `raw` at `version` (validated here; a refusal logged)."""
        kind = store.kind
        source = (by or b"?").decode("utf-8", "replace")
        if len(raw) > store.max_bytes:
            errors = store.reject(
                [f"{kind} text in Redis is {len(raw)} bytes, over {store.max_bytes}"],
                FLEET_ORIGIN,
            )
        else:
            errors = store.replace(raw.decode("utf-8", "replace"), FLEET_ORIGIN)
        if errors:
            self.rejected[kind] = version
            log.warning(
                "config_rejected kind=%s version=%s from_router=%s errors=%d",
                kind,
                version,
                quote(source),
                len(errors),
            )

    async def _poll(self) -> None:
        await self._publish_unpublished()
        published = await self._call(self._versions)
        if published is None:
            return
        for kind, version in published.items():
            store = self.stores[kind]
            if kind in self.unpublished or kind in self.writing:
                continue
            if version is None:
                # The fleet has no copy (first router, or Redis lost its data): ours,
                # unless another router's lands first.
                await self._cas(kind, "", store.source())
                continue
            running = store.version()
            if version == running or self.rejected.get(kind) == version:
                continue
            fetched = await self._call(
                lambda k=kind: self.client.hmget(KEY + k, "version", "text", "router")
            )
            if (
                fetched is None
                or fetched[1] is None
                or kind in self.unpublished
                or kind in self.writing
                or store.version() != running
            ):
                # Changed here while Redis was read: the fleet's text is the older one.
                continue
            fleet = fetched[0].decode()
            if fleet == running:
                continue
            if store.supersedes(fetched[1].decode("utf-8", "replace")):
                # Newer here (a change made while Redis was away): the fleet takes it,
                # unless another router's write lands first.
                await self._cas(kind, fleet, store.source())
                continue
            self._install(store, fleet, fetched[1], fetched[2])

    async def _poll_named(self) -> None:
        named = self.named
        assert named is not None

        def read() -> dict[str, str | None]:
            kinds = [k.decode() for k in self.client.smembers(KINDS)]
            names = [k[len(NAMED) :] for k in kinds if k.startswith(NAMED)]
            with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.hget(KEY + NAMED + name, "version")
                values = pipe.execute()
            return {n: v.decode() if v else None for n, v in zip(names, values, strict=True)}

        fleet = await self._call(read)
        if fleet is None:
            return
        names = set(fleet) | set(named.texts())
        # Deletions first: a document may take a model another one just gave up.
        for name in sorted(names, key=lambda n: (fleet.get(n) != TOMBSTONE, n)):
            await self._sync_named(named, name, fleet.get(name))

    async def _sync_named(self, named: NamedPolicies, name: str, fleet: str | None) -> None:
        kind, mine = NAMED + name, named.version(name)
        if kind in self.writing:
            return  # an admin write of it is under way here: it publishes itself
        synced = named.synced.get(name, TOMBSTONE)
        if fleet == mine:
            named.synced[name] = mine
            return
        if mine != synced or fleet is None:
            # Changed here since the last agreement (or new to the fleet): publish.
            text = named.texts().get(name, "")
            if await self._write(kind, mine, text):
                named.synced[name] = mine
            return
        if self.rejected.get(kind) == fleet:
            return
        fetched = await self._call(lambda: self.client.hmget(KEY + kind, "text", "router"))
        if fetched is None or fetched[0] is None or named.version(name) != mine:
            # Changed here while Redis was read: published by the next poll.
            return
        raw, source = fetched[0], (fetched[1] or b"?").decode("utf-8", "replace")
        try:
            if len(raw) > named.store.max_bytes:
                errors = named.store.reject([f"{kind} text in Redis is over 1 MiB"], FLEET_ORIGIN)
            else:
                errors = named.install(name, raw.decode("utf-8", "replace"))
        except ModelConflict as exc:
            if self.conflicts.get(kind) != fleet:
                self.conflicts[kind] = fleet
                named.store.reject([str(exc)], FLEET_ORIGIN)
            return
        if errors:
            self.rejected[kind] = fleet
            log.warning(
                "config_rejected kind=%s version=%s from_router=%s errors=%d",
                quote(kind),
                fleet,
                quote(source),
                len(errors),
            )
            return
        self.conflicts.pop(kind, None)
        named.synced[name] = named.version(name)

    def _versions(self) -> dict[str, str | None]:
        kinds = list(self.stores)
        with self.client.pipeline(transaction=False) as pipe:
            for kind in kinds:
                pipe.hget(KEY + kind, "version")
            values = pipe.execute()
        return {
            k: v.decode() if v is not None else None for k, v in zip(kinds, values, strict=True)
        }

    async def _call(self, fn: Any) -> Any:
        """One Redis call in a worker thread; None when Redis does not answer (logged)."""
        try:
            result = await trio.to_thread.run_sync(fn, abandon_on_cancel=True)
        except redis.RedisError as exc:
            if self.available:
                self.available = False
                log.warning("config_sync_unavailable error=%s", quote(state_url.reason(exc)))
            return None
        if not self.available:
            self.available = True
            log.info("config_sync_restored")
        return result
