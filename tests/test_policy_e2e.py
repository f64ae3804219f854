"""A fallback chain in action with real router and agent processes.

The primary step wants vLLM (the agents are sim engines: drained by `match`), the first
fallback wants a cool KV cache in the EU (drained by `exclude_if` once the EU agent's
cache is forced to 0.95), the second fallback takes the US agent. Then the US agent
stops, everything drains, and the router says so in the seeds' words and counters.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import httpx

from tests.fleet import Agent, Fleet, Router, wait_until

MODEL = "m1"
API_KEY = "client-key-1"
TENANT = "chaintrust"

POLICY = """\
routing_policy:
  match:
    engine: vllm
  strategy: least-loaded
  max_tries: 3

fallback_chain:
  - name: eu-cool-cache
    match:
      region: EU
    exclude_if:
      kv_cache_utilization:
        gt: 0.85
    strategy: least-loaded
    max_tries: 2

  - name: us
    match:
      region: US
    strategy: least-loaded
    max_tries: 2
"""


def chat(router: Router, rid: str | None = None, content: str = "hello") -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if rid is not None:
        headers["X-Request-ID"] = rid
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}]},
        headers=headers,
        timeout=30,
    )


def served_counts(*agents: Agent) -> list[int]:
    return [a.sim_state()["requests_total"] for a in agents]


def policy_counters(router: Router) -> dict[str, float]:
    return {
        name: router.metric(f"hivenet_router_{name}_total", model=MODEL)
        for name in (
            "routing_requests_routed",
            "policy_primary_routed",
            "policy_fallback_routed",
            "policy_exhausted",
        )
    }


def test_primary_drained_by_match_first_fallback_by_exclude_if_second_serves(
    fleet: Fleet, tmp_path: Path
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY)
    router = fleet.router(
        "--policy-file",
        str(policy_file),
        "--heartbeat-interval",
        "1s",
        env={"HIVENET_ROUTER_API_KEYS": f"{API_KEY}:{TENANT}"},
    )
    eu = fleet.agent(router, MODEL, "--region", "EU", "--heartbeat-interval", "1s", wait=False)
    us = fleet.agent(router, MODEL, "--region", "US", "--heartbeat-interval", "1s", wait=False)
    fleet.join(eu, us)

    # The EU agent's cache is cool: the first fallback serves.
    r = chat(router)
    assert r.status_code == 200, r.text
    assert served_counts(eu, us) == [1, 0]
    assert policy_counters(router) == {
        "routing_requests_routed": 1,
        "policy_primary_routed": 0,
        "policy_fallback_routed": 1,
        "policy_exhausted": 0,
    }

    # Its cache fills up: once the router sees it (engine samples every 500 ms), the
    # first fallback drains by exclude_if and the second one serves.
    eu.sim_state(kv_cache_utilization=0.95)
    wait_until(
        lambda: router.agent(eu.peer_id)["engine"]["kv_cache_utilization"] == 0.95,
        30,
        "the EU agent's KV cache at 0.95 in the routing table",
    )
    for i in range(3):
        r = chat(router, content=f"to the US {i}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == f"Echo: to the US {i}"
    assert served_counts(eu, us) == [1, 3]
    assert policy_counters(router) == {
        "routing_requests_routed": 4,
        "policy_primary_routed": 0,
        "policy_fallback_routed": 4,
        "policy_exhausted": 0,
    }
    assert "policy_exhausted" not in router.log()

    # The US agent goes away: every step drains, and the router says how.
    us.stop()
    wait_until(
        lambda: (
            not (router.agent(us.peer_id) or {"status": {"healthy": False}})["status"]["healthy"]
        ),
        30,
        "the US agent out of the routing pool",
    )
    rid = str(uuid.uuid4())
    r = chat(router, rid)
    assert r.status_code == 503, r.text
    assert r.headers["x-request-id"] == rid
    error = r.json()["error"]
    assert error["code"] == "no_agents_available"
    assert error["source"] == "router"
    expected = (
        f'req={rid} model="{MODEL}" capability="llm" tenant={TENANT} policy_exhausted '
        "chain=[routing_policy→eu-cool-cache→us] tried=3/3 "
        'reason="routing_policy: gate[4] match [engine(got=\\"sim\\",want=\\"vllm\\")=1]'
        " | eu-cool-cache: gate[7] exclude_if [kv_cache_utilization=1]"
        ' | us: gate[4] match [region(got=\\"EU\\",want=\\"US\\")=1]"'
    )
    line = router.wait_log(rf"level=warn subsystem=policy req={rid} [^\n]*").group(0)
    assert line.endswith(expected), line
    assert len(re.findall(rf"req={rid} [^\n]*policy_exhausted", router.log())) == 1
    assert policy_counters(router) == {
        "routing_requests_routed": 4,
        "policy_primary_routed": 0,
        "policy_fallback_routed": 4,
        "policy_exhausted": 1,
    }
    assert served_counts(eu) == [1]


def test_a_retryable_failure_is_served_by_another_agent_in_the_same_step(
    fleet: Fleet,
) -> None:
    router = fleet.router()
    agents = [fleet.agent(router, MODEL, wait=False), fleet.agent(router, MODEL, wait=False)]
    fleet.join(*agents)
    # Equal load: the lowest peer ID is tried first, so make that one fail.
    first, second = sorted(agents, key=lambda a: a.peer_id)
    first.sim_state(fail_status=503, fail_count=1)
    rid = str(uuid.uuid4())
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "retry me"}]},
        headers={"X-Request-ID": rid},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Echo: retry me"
    assert served_counts(first, second) == [1, 1]
    failures = "hivenet_router_forward_failures_total"
    assert router.metric(failures, model=MODEL, code="backend_unavailable") == 1
    assert router.metric(failures, model=MODEL) == 1
    # Served by the primary step: the failure cost a try, not a fallback.
    assert policy_counters(router) == {
        "routing_requests_routed": 1,
        "policy_primary_routed": 1,
        "policy_fallback_routed": 0,
        "policy_exhausted": 0,
    }
    log = router.log()
    assert re.search(
        rf"req={rid} forward_error step=routing_policy peer={first.peer_id} "
        r"code=backend_unavailable",
        log,
    )
    assert "policy_exhausted" not in log
    # The failure is in the agent's history; the retry's success in the other's.
    assert router.agent(first.peer_id)["universal"]["success_rate"] == 0.0
    assert router.agent(second.peer_id)["universal"]["success_rate"] == 1.0
