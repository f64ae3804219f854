"""A slow, lossy agent link (100 ms ± 20 ms, 1% loss), then a 30 s black hole: the
agent stays joined through the loss, streams arrive whole and in order, a request
pays the path's round trip once, and the black hole is noticed, then healed, as the
*Liveness* decision of docs/decisions.md says (TCP_USER_TIMEOUT 15 s,
--unhealthy-after 15 s)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.fleet import wait_until
from tests.netns import AgentIn, RouterIn, lab, require_netns

pytestmark = pytest.mark.netpaths

ROUTER_IP = "10.77.1.1"
AGENT_IP = "10.77.1.2"
DELAY, JITTER, LOSS = 0.100, 0.020, 0.01
BLACK_HOLE = 30.0
SAMPLES = 9


def median_latency(client: openai.OpenAI, text: str) -> float:
    """Median time for a streamed answer over SAMPLES requests, each checked whole."""
    times = []
    for i in range(SAMPLES):
        started = time.perf_counter()
        chunks = client.chat.completions.create(
            model="m-lossy",
            messages=[{"role": "user", "content": f"{text} {i}"}],
            stream=True,
        )
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        times.append(time.perf_counter() - started)
        assert answer == f"Echo: {text} {i}"
    return statistics.median(times)


def test_slow_lossy_path_then_a_black_hole(tmp_path: Path) -> None:
    require_netns()
    with lab(tmp_path) as the_lab:
        router_ns, agent_ns = the_lab.netns("r"), the_lab.netns("a")
        _, agent_if = the_lab.link(router_ns, f"{ROUTER_IP}/24", agent_ns, f"{AGENT_IP}/24")
        router = RouterIn(router_ns, ROUTER_IP)
        agent = AgentIn(agent_ns, [router.address()], "m-lossy")
        router.wait_agent(agent.peer_id)
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(router.http_socket)))
        client = openai.OpenAI(base_url="http://router/v1", api_key="-", http_client=http)
        direct = median_latency(client, "direct")

        agent_ns.slow_and_lossy(agent_if, DELAY, JITTER, LOSS)
        slow = median_latency(client, "slow")
        added = slow - direct
        # The path's worst round trip is DELAY + JITTER (only the agent's side sends
        # slowly). One request costs one round trip on the persistent session: more
        # than a 0.8 of the fastest, under three of the slowest (a handshake per
        # request, or a lost segment per request, would cost more).
        assert 0.8 * (DELAY - JITTER) < added < 3 * (DELAY + JITTER), (direct, slow)
        assert agent.joins() == 1
        assert router.wait_agent(agent.peer_id)["status"]["healthy"]

        agent_ns.black_hole(agent_if, True)
        holed_at = time.monotonic()
        agent.proc.wait_log("router_session_ended", timeout=BLACK_HOLE - 5)
        router.proc.wait_log("agent_unhealthy|link heartbeat timeout", timeout=BLACK_HOLE - 5)
        # Both sides noticed while the path was still black-holed.
        assert time.monotonic() - holed_at < BLACK_HOLE
        time.sleep(max(0.0, BLACK_HOLE - (time.monotonic() - holed_at)))
        agent_ns.black_hole(agent_if, False)

        wait_until(lambda: agent.joins() == 2, 30, "the agent rejoined after the black hole")
        router.wait_agent(agent.peer_id)
        assert "router_dial_failed" in agent.proc.log()
        healed = client.chat.completions.create(
            model="m-lossy", messages=[{"role": "user", "content": "healed"}]
        )
        assert healed.choices[0].message.content == "Echo: healed"
        router.close()
