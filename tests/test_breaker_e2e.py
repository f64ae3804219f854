"""Strangers cannot lock out a healthy agent, and a locked-out agent finds its way back
(issue 17 #3), with a real router, a real agent and the simulated engine.

Under the seeds' "protect response quality" policy (`success_rate lt 0.95`,
`consecutive_failures gte 3`), requests the client got wrong are refused or relayed
without touching the agent's history; real engine failures do exclude it, and after
`--failure-cooldown` one request probes it and its success brings it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.fleet import Agent, Fleet, Router, wait_until

POLICY = Path(__file__).parent.parent / "configs/policies/protect-response-quality.yaml"
COOLDOWN_S = 6
HI = [{"role": "user", "content": "hi"}]
GOOD = 60


def chat(router: Router, **extra: Any) -> httpx.Response:
    body = {"model": "m1", "messages": HI, "max_tokens": 8, **extra}
    return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)


def history(router: Router, agent: Agent) -> tuple[float | None, int]:
    view = router.agent(agent.peer_id)
    assert view is not None
    universal = view["universal"]
    return universal["success_rate"], universal["consecutive_failures"]


def test_strangers_cannot_lock_out_an_agent_and_a_locked_out_one_is_probed_back(
    fleet: Fleet,
) -> None:
    router = fleet.router("--policy-file", str(POLICY), "--failure-cooldown", f"{COOLDOWN_S}s")
    agent = fleet.agent(router, "m1")
    # A track record: after 60 successes three failures leave success_rate at 0.95
    # (not below), so consecutive_failures is the gate that acts.
    with httpx.Client(timeout=30) as client:
        for _ in range(GOOD):
            body = {"model": "m1", "messages": HI, "max_tokens": 1}
            assert client.post(router.url + "/v1/chat/completions", json=body).status_code == 200
    assert history(router, agent) == (1.0, 0)

    # Strangers: types the router refuses, and requests the engine refuses (400).
    for _ in range(3):
        for stream in ("yes", 1):
            r = chat(router, stream=stream)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "request_invalid"
        r = chat(router, max_tokens=5000)  # over the simulated engine's 4096-word context
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    agent.sim_state(fail_status=400, fail_count=3, fail_body={"error": {"message": "bad n"}})
    for _ in range(3):
        r = chat(router)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_parameter"
    assert history(router, agent) == (1.0, 0)
    assert chat(router).status_code == 200

    # The engine itself fails three times in a row: the policy excludes the agent.
    agent.sim_state(fail_status=500, fail_count=3, fail_body=None)
    for _ in range(3):
        assert chat(router).status_code == 502
    assert history(router, agent) == ((GOOD + 1) / (GOOD + 4), 3)
    locked = chat(router)
    assert locked.status_code == 503, locked.text
    assert locked.json()["error"]["code"] == "no_agents_available"
    assert "gate[7] exclude_if" in locked.json()["error"]["message"]
    assert agent.sim_state()["requests_total"] == GOOD + 10

    # After the cool-down one request probes the agent; its success lets it back in.
    probe = wait_until(
        lambda: (r := chat(router)).status_code == 200 and r,
        timeout=COOLDOWN_S + 30,
        what="the probe after the cool-down",
    )
    assert probe.json()["choices"][0]["message"]["content"]
    assert history(router, agent) == ((GOOD + 2) / (GOOD + 5), 0)
    for _ in range(3):
        assert chat(router).status_code == 200
    assert history(router, agent) == ((GOOD + 5) / (GOOD + 8), 0)
    assert agent.sim_state()["requests_total"] == GOOD + 14
