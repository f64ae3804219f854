"""`GET /admin/routing-table` is built an agent at a time (router/http/admin.py): the
same JSON as the whole table's, and other tasks run while a large fleet's is built."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from router import metrics_page
from router.http import admin
from router.peers import PeerTable
from tests.peer_tables import many_agents, turns_during

AGENTS = 300


def _table() -> PeerTable:
    table = many_agents(AGENTS)
    return table


def test_the_stepped_table_is_the_whole_tables_json(monkeypatch: pytest.MonkeyPatch) -> None:
    table = _table()
    monkeypatch.setattr(metrics_page, "STEP_SECONDS", 0.0)  # a checkpoint at every agent
    monkeypatch.setattr(admin.time, "time", lambda: 1_700_000_000.0)  # wall-clock fields

    async def main() -> tuple[bytes, bytes]:
        whole = json.dumps(admin.routing_table(table), separators=(",", ":")).encode()
        stepped, turns = await turns_during(lambda: admin.routing_table_json(table))
        assert turns >= AGENTS - 1  # the other task ran between the agents
        return whole, stepped

    whole, stepped = trio.run(main, clock=trio.testing.MockClock())  # time stands still
    assert stepped == whole
    assert json.loads(stepped)["total"] == AGENTS


def test_an_empty_table() -> None:
    body = trio.run(admin.routing_table_json, PeerTable())
    assert json.loads(body) == {"total": 0, "agents": []}
