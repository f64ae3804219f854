"""GPU hosts behind NAT, on real paths: the router in one namespace, the agent in a
second behind a third that masquerades it; then a NAT that forgets its connections and
changes the agent's public address, and a NAT with a short idle timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.netns import AgentIn, Lab, Netns, RouterIn, lab, require_netns

pytestmark = pytest.mark.netpaths

ROUTER_IP = "10.77.1.1"
NAT_PUBLIC_IP = "10.77.1.2"
NAT_SECOND_IP = "10.77.1.3"
AGENT_IP = "10.77.2.2"


@dataclass
class NatPath:
    lab: Lab
    router_ns: Netns
    nat: Netns
    agent_ns: Netns
    nat_public_if: str


def behind_nat(the_lab: Lab) -> NatPath:
    """router ── 10.77.1.0/24 ── NAT ── 10.77.2.0/24 ── agent. The router has no route
    to the agent's network; the NAT rewrites the agent's connections to its own
    public address. `nf_conntrack_tcp_loose=0` and dropping INVALID packets make it
    forget like a real NAT: a packet of a connection it no longer knows is dropped
    silently instead of passed on or answered with a reset."""
    router_ns, nat, agent_ns = the_lab.netns("r"), the_lab.netns("n"), the_lab.netns("a")
    _, public_if = the_lab.link(router_ns, f"{ROUTER_IP}/24", nat, f"{NAT_PUBLIC_IP}/24")
    the_lab.link(nat, "10.77.2.1/24", agent_ns, f"{AGENT_IP}/24")
    agent_ns.sh("ip", "route", "add", "default", "via", "10.77.2.1")
    nat.sysctl("net.ipv4.ip_forward=1")
    nat.iptables("-t", "nat", "-A", "POSTROUTING", "-o", public_if, "-j", "MASQUERADE")
    nat.sysctl("net.netfilter.nf_conntrack_tcp_loose=0")
    for chain in ("FORWARD", "INPUT"):
        nat.iptables("-A", chain, "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
    return NatPath(the_lab, router_ns, nat, agent_ns, public_if)


@pytest.fixture
def nat_path(tmp_path: Path) -> Iterator[NatPath]:
    require_netns()
    with lab(tmp_path) as the_lab:
        yield behind_nat(the_lab)


def sdk(router: RouterIn) -> openai.OpenAI:
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(router.http_socket)), timeout=60)
    return openai.OpenAI(base_url="http://router/v1", api_key="unused", http_client=client)


def test_agent_behind_nat_joins_and_serves(nat_path: NatPath) -> None:
    router = RouterIn(nat_path.router_ns, ROUTER_IP)
    assert not nat_path.router_ns.reaches(AGENT_IP)
    agent = AgentIn(nat_path.agent_ns, [router.address()], "m-nat")
    entry = router.wait_agent(agent.peer_id)
    # The router saw the NAT's address, not the agent's.
    assert entry["status"]["remote_addr"].startswith(f"{NAT_PUBLIC_IP}:")

    client = sdk(router)
    reply = client.chat.completions.create(
        model="m-nat", messages=[{"role": "user", "content": "through the NAT"}]
    )
    assert reply.choices[0].message.content == "Echo: through the NAT"
    chunks = client.chat.completions.create(
        model="m-nat", messages=[{"role": "user", "content": "streamed home"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Echo: streamed home"
    router.close()


def test_nat_that_forgets_and_moves_loses_no_request(nat_path: NatPath) -> None:
    """The NAT drops its state and maps the agent to a new public address: every
    packet of the old connection is dropped without a reset. The agent's kernel ends
    the connection after three unacknowledged heartbeat periods (TCP_USER_TIMEOUT),
    the agent redials through the new mapping, and a request sent into the dead
    session is recovered by the budget-free retry (one try per step, so no other
    retry could have saved it)."""
    router = RouterIn(
        nat_path.router_ns, ROUTER_IP, "--max-tries-per-step", "1", "--unhealthy-after", "20s"
    )
    agent = AgentIn(nat_path.agent_ns, [router.address()], "m-nat", "--heartbeat-interval", "1s")
    first = router.wait_agent(agent.peer_id)["status"]["remote_addr"]
    assert first.startswith(f"{NAT_PUBLIC_IP}:")
    client = sdk(router)
    assert (
        client.chat.completions.create(
            model="m-nat", messages=[{"role": "user", "content": "before"}]
        )
        .choices[0]
        .message.content
        == "Echo: before"
    )

    nat = nat_path.nat
    nat.sh("ip", "addr", "add", f"{NAT_SECOND_IP}/24", "dev", nat_path.nat_public_if)
    nat.iptables("-t", "nat", "-F", "POSTROUTING")
    nat.iptables(
        "-t", "nat", "-A", "POSTROUTING", "-o", nat_path.nat_public_if,
        "-j", "SNAT", "--to-source", NAT_SECOND_IP,
    )  # fmt: skip
    nat.sh("conntrack", "-F")

    # Sent into the session the NAT forgot: answered once the agent is back.
    reply = client.chat.completions.create(
        model="m-nat", messages=[{"role": "user", "content": "after the move"}]
    )
    assert reply.choices[0].message.content == "Echo: after the move"
    second = router.wait_agent(agent.peer_id)["status"]["remote_addr"]
    assert second.startswith(f"{NAT_SECOND_IP}:")
    log = agent.proc.log()
    assert "router_session_ended" in log
    assert agent.joins() == 2
    assert router.metric("hivenet_router_agent_connection_resets_total") >= 1
    router.close()


def test_short_nat_idle_timeout_does_not_cut_an_idle_agent(nat_path: NatPath) -> None:
    """A NAT that forgets an established connection after 3 s of silence: the agent's
    heartbeat (1 s here, 5 s by default) refreshes the mapping, so an idle agent keeps
    its one session through several such timeouts."""
    nat_path.nat.sysctl("net.netfilter.nf_conntrack_tcp_timeout_established=3")
    router = RouterIn(nat_path.router_ns, ROUTER_IP)
    agent = AgentIn(nat_path.agent_ns, [router.address()], "m-idle", "--heartbeat-interval", "1s")
    before = router.wait_agent(agent.peer_id)["status"]["remote_addr"]
    entries = nat_path.nat.sh("conntrack", "-L", "-p", "tcp").stdout
    assert "ESTABLISHED" in entries

    # Idle for three of the NAT's timeouts, looking at its table every second.
    for _ in range(9):
        time.sleep(1)
        assert "ESTABLISHED" in nat_path.nat.sh("conntrack", "-L", "-p", "tcp").stdout
    assert agent.joins() == 1
    assert "router_session_ended" not in agent.proc.log()
    assert router.wait_agent(agent.peer_id)["status"]["remote_addr"] == before
    reply = sdk(router).chat.completions.create(
        model="m-idle", messages=[{"role": "user", "content": "still here"}]
    )
    assert reply.choices[0].message.content == "Echo: still here"
    router.close()


def test_namespaces_left_by_a_dead_test_run_are_swept() -> None:
    """A run killed before its cleanup leaves namespaces named after its pid; the next
    run deletes them, and keeps those of test processes still alive."""
    require_netns()
    import os
    import subprocess

    from tests.netns import PREFIX, sweep_stale

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, live = f"{PREFIX}-{gone.pid}-0r", f"{PREFIX}-{os.getppid()}-0r"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert sweep_stale.__wrapped__() >= 1
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in names
        assert live in names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
