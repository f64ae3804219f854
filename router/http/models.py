"""`GET /v1/models[/{model}]` as the Go router answers it: only the models the
caller's key may use, the agents' display fields, and per-agent `agents.list[]` in the
detail.

A model whose every agent registered with `--hide-llm` is left out of the list (still
served, and still shown by `GET /v1/models/{model}` and the admin API): upstream keeps
such models listed, which its docs call a limitation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import trio

from router.peers import Peer
from router.tenants.config import Tenant


def allowed(card: dict, tenant: Tenant | None) -> bool:
    return tenant is None or tenant.allows_model(card["id"])


def listed(
    cards: list[dict], peers_of: dict[str, Sequence[Peer]], tenant: Tenant | None
) -> list[dict]:
    """The list endpoint's cards, filtered by the key's models and `--hide-llm`."""
    out = []
    for card in cards:
        peers = peers_of.get(card["id"], [])
        if not allowed(card, tenant) or (peers and all(p.metadata.hide_llm for p in peers)):
            continue
        out.append(with_display(card, peers))
    return out


def with_display(card: dict, peers: Sequence[Peer]) -> dict:
    """`pretty_name` and `info` from the first agent that sets them."""
    pretty = next((p.metadata.llm_pretty_name for p in peers if p.metadata.llm_pretty_name), "")
    info = next((p.metadata.llm_info for p in peers if p.metadata.llm_info), "")
    if pretty:
        card["pretty_name"] = pretty
    if info:
        card["info"] = info
    if peers and all(p.metadata.hide_llm for p in peers):
        card["hide_llm"] = True
    return card


def detail(card: dict, peers: Sequence[Peer]) -> dict:
    """The detail endpoint's card: the list's, plus one entry per agent."""
    card = with_display(card, peers)
    now, wall = trio.current_time(), time.time()
    card["agents"]["list"] = [
        {
            "peer_id": p.peer_id,
            "engine": p.metadata.engine,
            "version": p.metadata.version,
            "region": p.metadata.region,
            "organization": p.metadata.organization,
            "machine": p.metadata.machine,
            "capacity": p.metadata.capacity,
            "is_healthy": p.routable,
            "last_seen": int(wall - (now - p.last_seen)) if p.last_seen else None,
        }
        for p in sorted(peers, key=lambda p: p.peer_id)
    ]
    return card
