"""An engine without `/v1/completions` or `/v1/responses` (issue 47 item 3): a llama.cpp
build from before its `/v1/responses`, here the sim as llama-server answering its own
404 for both. The client gets 404 `endpoint_not_supported` (docs/api/client.md), the agent is
charged nothing, the router remembers the agent lacks the path and sends the next
requests for it to the model's other agents without asking it again."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.fleet import Agent, Fleet, Router, sim_process, wait_until

PATHS = {
    "/v1/completions": {"model": "m1", "prompt": "hello", "max_tokens": 4},
    "/v1/responses": {"model": "m1", "input": "hello", "max_output_tokens": 4},
}


@pytest.fixture
def old_llamacpp() -> Iterator[str]:
    """`python -m sim --kind llamacpp` without the two routes; its URL."""
    flags = ["--kind", "llamacpp", "--model", "m1"]
    for path in PATHS:
        flags += ["--missing-route", path]
    with sim_process(*flags) as url:
        # The engine itself answers its own 404 for them, as llama-server does.
        missing = httpx.post(url + "/v1/responses", json=PATHS["/v1/responses"], timeout=5)
        assert missing.status_code == 404 and "File Not Found" in missing.text
        yield url


def post(router: Router, path: str) -> httpx.Response:
    return httpx.post(router.url + path, json=PATHS[path], timeout=30)


def universal(router: Router, agent: Agent) -> dict:
    view = router.agent(agent.peer_id)
    assert view is not None
    return view["universal"]


def forward_errors(router: Router, agent: Agent) -> int:
    return router.log().count(f"peer={agent.peer_id} code=endpoint_not_supported")


def test_an_engine_without_the_route_is_not_charged_and_is_remembered(
    fleet: Fleet, old_llamacpp: str
) -> None:
    router = fleet.router()
    old = fleet.agent(router, "m1", "--backend-url", old_llamacpp, engine="llamacpp")
    before = universal(router, old)

    # Alone: the client hears that no agent serves the endpoint, not a backend error.
    for path in PATHS:
        for _ in range(2):
            r = post(router, path)
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert error["code"] == "endpoint_not_supported", error
            assert path in error["message"]
    # The engine was asked once per path: the agent learned it, and the router
    # remembers the agent lacks it (the second request never reached the agent).
    assert old.log().count("engine_route_missing") == len(PATHS)
    assert forward_errors(router, old) == len(PATHS)
    # Nothing charged: no failure in the agent's history, its breaker untouched.
    now = universal(router, old)
    assert now["consecutive_failures"] == 0
    assert now["success_rate"] == before["success_rate"]
    # What the engine serves still goes to it.
    chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200

    # Another agent of the model that serves them: it gets every such request, the old
    # one is not asked again nor charged.
    new = fleet.agent(router, "m1")
    for path in PATHS:
        for _ in range(3):
            r = post(router, path)
            assert r.status_code == 200, r.text
    assert forward_errors(router, old) == len(PATHS)
    assert old.log().count("engine_route_missing") == len(PATHS)
    assert universal(router, old)["consecutive_failures"] == 0
    wait_until(
        lambda: new.sim_state()["requests_total"] >= 2 * len(PATHS), 10, "served by the new one"
    )
