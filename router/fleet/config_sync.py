"""One configuration for every router that shares a `--state-url`.

Each reloadable document (the policy, the auth file; a per-model policy would be one
more `DocumentStore` under its own kind) lives in Redis as a hash
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
has none yet. Without `--state-url` nothing here runs.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
import trio

from protocol.logs import quote
from router.documents import DocumentStore

log = logging.getLogger("fleet")

# A change reaches every router within this period plus one Redis round trip.
POLL_INTERVAL = 0.2
CALL_TIMEOUT = 0.5
KEY = "hivenet:config:"
FLEET_ORIGIN = "fleet"
# The same bound as a PUT body (router/http/admin.py): Redis is no way around it.
MAX_DOCUMENT_BYTES = 1024 * 1024


class ConfigSync:
    def __init__(self, client: redis.Redis, router_id: str) -> None:
        self.client = client
        self.router_id = router_id
        self.stores: dict[str, DocumentStore[Any]] = {}
        # Versions this router rejected: logged once, not re-validated every poll.
        self.rejected: dict[str, str] = {}
        self._outbox_send, self._outbox = trio.open_memory_channel[str](64)
        self.available = True

    def __repr__(self) -> str:
        versions = ", ".join(f"{k}={s.version()}" for k, s in self.stores.items())
        return f"<ConfigSync {versions}>"

    def add(self, store: DocumentStore[Any]) -> None:
        """Keep `store`'s document the same on every router."""
        self.stores[store.kind] = store

        def replaced(origin: str) -> None:
            if origin != FLEET_ORIGIN:
                # A full outbox drops nothing that matters: the text is read at send time.
                try:
                    self._outbox_send.send_nowait(store.kind)
                except trio.WouldBlock:
                    log.warning("config_publish_backlog kind=%s", store.kind)

        store.on_replaced.append(replaced)

    async def run(self) -> None:
        await self._start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._publish_loop)
            while True:
                await trio.sleep(POLL_INTERVAL)
                await self._poll()

    async def _start(self) -> None:
        published = await self._call(self._versions)
        for kind, version in (published or {}).items():
            if version is None:
                await self._publish(kind)
        await self._poll()

    async def _publish_loop(self) -> None:
        async for kind in self._outbox:
            await self._publish(kind)

    async def _publish(self, kind: str) -> None:
        store = self.stores[kind]
        version, text = store.version(), store.source()
        mapping = {"version": version, "text": text, "router": self.router_id}
        done = await self._call(lambda: self.client.hset(KEY + kind, mapping=mapping))
        if done is not None:
            log.info("config_published kind=%s version=%s", kind, version)

    async def _poll(self) -> None:
        published = await self._call(self._versions)
        if published is None:
            return
        for kind, version in published.items():
            store = self.stores[kind]
            if version is None or version == store.version() or self.rejected.get(kind) == version:
                continue
            fetched = await self._call(lambda k=kind: self.client.hmget(KEY + k, "text", "router"))
            if fetched is None or fetched[0] is None:
                continue
            raw, source = fetched[0], (fetched[1] or b"?").decode("utf-8", "replace")
            if len(raw) > MAX_DOCUMENT_BYTES:
                errors = store.reject(
                    [f"{kind} text in Redis is {len(raw)} bytes, over 1 MiB"], FLEET_ORIGIN
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
                log.warning("config_sync_unavailable error=%s", quote(str(exc)))
            return None
        if not self.available:
            self.available = True
            log.info("config_sync_restored")
        return result
