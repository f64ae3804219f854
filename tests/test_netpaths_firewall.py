"""The list of ports to open on the router host (docs/deploy/bare-metal.md), checked: a
router whose namespace drops every inbound packet but those to the listed ports runs a whole fleet
check, and what is not listed (the metrics port) is unreachable from outside."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.fleet import ADMIN_KEY
from tests.netns import HTTP_PORT, METRICS_PORT, P2P_PORT, AgentIn, RouterIn, lab, require_netns

pytestmark = pytest.mark.netpaths

PAGE = Path(__file__).resolve().parent.parent / "docs" / "deploy" / "bare-metal.md"
CLIENT_SIDE_IP, ROUTER_CLIENT_IP = "10.77.1.9", "10.77.1.1"
ROUTER_AGENT_IP, AGENT_IP = "10.77.4.1", "10.77.4.2"
WS_PORT = 9001


def ports_to_open(ports: dict[str, int]) -> list[int]:
    """The ports the page's "Inbound on the router host, open only:" sentence names,
    as this router runs them (`ports`: each name the sentence may use, to its port)."""
    section = PAGE.read_text().split("## What runs where, and which ports are open")[1]
    sentence = section.split("Inbound on the router host, open only:")[1].split("\n")[0]
    names = re.findall(r"`([^`]+)`", sentence)
    unknown = [n for n in names if n not in ports]
    assert not unknown, f"the page names ports this test does not know: {unknown}"
    return [ports[n] for n in names if ports[n]]


def test_router_host_firewall_opens_only_the_readme_ports(tmp_path: Path) -> None:
    require_netns()
    opened = ports_to_open(
        {
            "HIVENET_ROUTER_HTTP_PORT": HTTP_PORT,
            "HIVENET_ROUTER_P2P_PORT": P2P_PORT,
            "--p2p-ws-port": WS_PORT,
            "--p2p-wss-port": 0,
        }
    )
    assert sorted(opened) == sorted([HTTP_PORT, P2P_PORT, WS_PORT])
    with lab(tmp_path) as the_lab:
        router_ns, clients, agents = the_lab.netns("r"), the_lab.netns("c"), the_lab.netns("a")
        the_lab.link(router_ns, f"{ROUTER_CLIENT_IP}/24", clients, f"{CLIENT_SIDE_IP}/24")
        the_lab.link(router_ns, f"{ROUTER_AGENT_IP}/24", agents, f"{AGENT_IP}/24")
        router_ns.iptables("-P", "INPUT", "DROP")
        router_ns.iptables("-A", "INPUT", "-i", "lo", "-j", "ACCEPT")
        router_ns.iptables(
            "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"
        )  # fmt: skip
        for port in opened:
            router_ns.iptables("-A", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "ACCEPT")

        # Metrics on every interface, the flag's default: only the firewall keeps it private.
        router = RouterIn(
            router_ns,
            "0.0.0.0",
            *("--p2p-ws-port", str(WS_PORT), "--metrics-port", f":{METRICS_PORT}"),
        )
        tcp_agent = AgentIn(
            agents, [f"/ip4/{ROUTER_AGENT_IP}/tcp/{P2P_PORT}/p2p/{router.peer_id}"], "m-tcp"
        )
        ws_agent = AgentIn(
            agents, [f"/ip4/{ROUTER_AGENT_IP}/tcp/{WS_PORT}/ws/p2p/{router.peer_id}"], "m-ws"
        )
        router.wait_agent(tcp_agent.peer_id)
        router.wait_agent(ws_agent.peer_id)

        relay = clients.relay(ROUTER_CLIENT_IP, HTTP_PORT)
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(relay)), timeout=30)
        client = openai.OpenAI(base_url="http://router/v1", api_key="-", http_client=http)
        assert {m.id for m in client.models.list()} == {"m-tcp", "m-ws"}
        for model in ("m-tcp", "m-ws"):
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"via {model}"}]
            )
            assert reply.choices[0].message.content == f"Echo: via {model}"
        health = http.get(
            "http://router/admin/health", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).json()
        assert (health["total_agents"], health["healthy_agents"]) == (2, 2)

        # On the host itself the metrics scrape; from the clients' network they are
        # listened on (0.0.0.0) but dropped, not refused.
        assert router.metric("hivenet_router_routing_requests_routed_total") == 2
        assert f"0.0.0.0:{METRICS_PORT}" in router_ns.sh("ss", "-ltn").stdout
        probe = clients.sh(
            sys.executable, "-c",
            "import socket, sys\n"
            "try:\n"
            f"    socket.create_connection(({ROUTER_CLIENT_IP!r}, {METRICS_PORT}), timeout=2)\n"
            "except TimeoutError:\n"
            "    sys.exit(3)\n",
            check=False,
        )  # fmt: skip
        assert probe.returncode == 3, probe.stderr
        router.close()
