"""The fleet's view: which agents are on which router, and their merged statistics.

Each router with a `--state-url` writes its own entry, `hivenet:fleet:router:<peer id>`,
every REFRESH_INTERVAL with a TTL of ENTRY_TTL, and deletes it when it stops; one that
crashes leaves the view by itself when the entry expires. The entries are read only when
someone asks (`?scope=fleet` on `/admin/routing-table` and `/v1/models`), never on the
request path. An entry holds about 200 bytes per agent: at 10,000 agents the whole fleet
writes about 2 MB every 5 s, whatever the number of routers.

Statistics merge as counts: successes and failures add up (so the success rate is the
fleet's), consecutive failures take the worst router's, SRTT is each router's weighted
by the requests it sent. Without `--state-url` the fleet is this router alone.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis
import trio

from protocol.logs import quote
from router.agent_detail import amount
from router.peers import Peer, PeerTable

log = logging.getLogger("fleet")

REFRESH_INTERVAL = 5.0
ENTRY_TTL = 15
KEY = "hivenet:fleet:router:"
CALL_TIMEOUT = 0.5


def agent_entry(peer: Peer) -> dict:
    s = peer.stats
    m = peer.metadata
    return {
        "peer_id": peer.peer_id,
        "model": m.model,
        "capability": m.capability,
        "engine": m.engine,
        "region": m.region,
        "capacity": m.capacity,
        "healthy": peer.routable,
        # This router's own requests; the agent's others are in the other entries.
        "active": peer.active - peer.elsewhere,
        "successes": s.successes,
        "failures": s.failures,
        "consecutive_failures": s.consecutive_failures,
        "srtt_ms": s.srtt_ms,
    }


class FleetView:
    def __init__(self, table: PeerTable, router_id: str, client: redis.Redis | None) -> None:
        self.table = table
        self.router_id = router_id
        self.client = client

    def __repr__(self) -> str:
        where = "redis" if self.client is not None else "local"
        return f"<FleetView {self.router_id} {where}>"

    def local_entry(self) -> dict:
        agents = [agent_entry(p) for p in self.table.all()]
        return {"router": self.router_id, "at": time.time(), "agents": agents}

    async def run(self) -> None:
        if self.client is None:
            return
        client = self.client
        while True:
            entry = json.dumps(self.local_entry(), separators=(",", ":"))
            try:
                await trio.to_thread.run_sync(
                    lambda e=entry: client.set(KEY + self.router_id, e, ex=ENTRY_TTL),
                    abandon_on_cancel=True,
                )
            except redis.RedisError as exc:
                log.debug("fleet_entry_unwritten error=%s", quote(str(exc)))
            await trio.sleep(REFRESH_INTERVAL)

    async def leave(self) -> None:
        """Delete this router's entry, at a clean stop. A write the run's cancel
        abandoned in its thread may still land after the delete: the entry then expires
        as a crashed router's does."""
        if self.client is None:
            return
        client = self.client
        with trio.move_on_after(CALL_TIMEOUT * 2):
            try:
                await trio.to_thread.run_sync(
                    lambda: client.delete(KEY + self.router_id), abandon_on_cancel=True
                )
            except redis.RedisError as exc:
                log.debug("fleet_entry_undeleted error=%s", quote(str(exc)))

    async def entries(self) -> list[dict]:
        """Every router's entry, this router's current one first."""
        own = self.local_entry()
        if self.client is None:
            return [own]
        client = self.client

        def read() -> list[Any]:
            keys = sorted(client.scan_iter(match=KEY + "*", count=1000))
            return client.mget(keys) if keys else []

        try:
            raw = await trio.to_thread.run_sync(read, abandon_on_cancel=True)
        except redis.RedisError as exc:
            log.warning("fleet_view_unavailable error=%s", quote(str(exc)))
            return [own]
        others = []
        for value in raw:
            try:
                entry = json.loads(value) if value is not None else None
            except ValueError:
                continue
            # Another router's entry is read as data from elsewhere: one of another
            # shape (a corrupt value, a foreign writer) is left out, not a 500.
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("router"), str)
                and entry["router"] != self.router_id
                and isinstance(entry.get("agents", []), list)
            ):
                others.append(entry)
        return [own, *others]

    async def routing_table(self) -> dict:
        entries = await self.entries()
        merged: dict[str, dict] = {}
        for entry in entries:
            for agent in entry.get("agents", ()):
                if (
                    isinstance(agent, dict)
                    and isinstance(agent.get("peer_id"), str)
                    and isinstance(agent.get("model"), str)
                ):
                    _merge(merged, entry["router"], agent)
        routers = [
            {"router_peer_id": e["router"], "agents": len(e.get("agents", ()))} for e in entries
        ]
        agents = sorted(merged.values(), key=lambda a: (str(a["model"]), a["peer_id"]))
        return {"scope": "fleet", "routers": routers, "agents": [_public(a) for a in agents]}

    async def models(self) -> list[dict]:
        table = await self.routing_table()
        by_model: dict[str, list[dict]] = {}
        for agent in table["agents"]:
            by_model.setdefault(str(agent["model"]), []).append(agent)
        cards = []
        for model, agents in sorted(by_model.items()):
            cards.append(
                {
                    "id": model,
                    "object": "model",
                    "owned_by": "hivenet",
                    "capability": agents[0]["capability"],
                    "agents": {
                        "total": len(agents),
                        "healthy": sum(1 for a in agents if a["healthy"]),
                        "total_capacity": sum(int(a["capacity"] or 0) for a in agents),
                        "engines": sorted({a["engine"] for a in agents if a["engine"]}),
                        "regions": sorted({a["region"] for a in agents if a["region"]}),
                    },
                    "routers": sorted({r for a in agents for r in a["routers"]}),
                }
            )
        return cards


# Another router's counts are data from elsewhere: each is held under this, so that
# their sums stay finite (a JSON `1e308`, twice, is infinity, which int() refuses).
_MAX_COUNT = float(2**53)


def _number(value: object) -> float:
    """A count from another router's entry; 0 for anything but a finite, non-negative
    number."""
    number = amount(value)
    return 0.0 if number is None else min(number, _MAX_COUNT)


def _merge(merged: dict[str, dict], router: str, agent: dict) -> None:
    into = merged.get(agent["peer_id"])
    if into is None:
        into = merged[agent["peer_id"]] = {
            **{k: _text(agent.get(k)) for k in _TEXT_FIELDS},
            "capacity": _count(agent.get("capacity")),
            "healthy": False,
            "routers": [],
            "active": 0.0,
            "successes": 0.0,
            "failures": 0.0,
            "consecutive_failures": 0.0,
            "rtt_weight": 0.0,
            "rtt_sum": 0.0,
        }
    into["routers"].append(router)
    into["healthy"] = into["healthy"] or agent.get("healthy") is True
    for name in ("active", "successes", "failures"):
        into[name] += _number(agent.get(name))
    into["consecutive_failures"] = max(
        into["consecutive_failures"], _number(agent.get("consecutive_failures"))
    )
    srtt = amount(agent.get("srtt_ms"))
    if srtt is not None:
        srtt = min(srtt, _MAX_COUNT)
        weight = max(1.0, _number(agent.get("successes")) + _number(agent.get("failures")))
        into["rtt_weight"] += weight
        into["rtt_sum"] += weight * srtt


_TEXT_FIELDS = ("peer_id", "model", "capability", "engine", "region")


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int | None:
    return value if type(value) is int else None


def _public(a: dict) -> dict:
    total = a["successes"] + a["failures"]
    return {
        "peer_id": a["peer_id"],
        "model": a["model"],
        "capability": a["capability"],
        "engine": a["engine"],
        "region": a["region"],
        "capacity": a["capacity"],
        "healthy": a["healthy"],
        "routers": sorted(a["routers"]),
        "active_requests": int(a["active"]),
        "universal": {
            "requests": int(total),
            "success_rate": a["successes"] / total if total else None,
            "srtt": a["rtt_sum"] / a["rtt_weight"] if a["rtt_weight"] else None,
            "consecutive_failures": int(a["consecutive_failures"]),
        },
    }
