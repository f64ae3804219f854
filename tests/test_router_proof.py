"""`--router` without `/p2p/<peer-id>` (the Go agent's `--router-grpc host:port`): the
agent learns the router's peer ID from the handshake and requires the router's proof of
the shared secret in its welcome, so no impostor takes the router's place (issue 19)."""

from __future__ import annotations

import httpx
import pytest
import trio

from protocol import messages as m
from protocol.frames import encode_frame
from protocol.router_proof import MAX_CHALLENGE, new_challenge, proof_valid, router_proof
from tests.fleet import SECRET, Fleet
from tests.link_peers import fake_router
from tests.test_link import METADATA, first_reply, raw_session, token_with

KEY = SECRET.encode()


def test_the_proof_binds_the_secret_both_peers_and_the_challenge() -> None:
    challenge = new_challenge()
    proof = router_proof(KEY, "router", "agent", challenge)
    assert proof_valid(KEY, "router", "agent", challenge, proof)
    assert not proof_valid(b"x" * 40, "router", "agent", challenge, proof)
    # A relay in the middle has another peer ID than the router whose proof it relays.
    assert not proof_valid(KEY, "relay", "agent", challenge, proof)
    assert not proof_valid(KEY, "router", "other-agent", challenge, proof)
    assert not proof_valid(KEY, "router", "agent", new_challenge(), proof)
    assert not proof_valid(KEY, "router", "agent", challenge, None)
    assert not proof_valid(KEY, "router", "agent", challenge, "\udcff")


def unpinned(address: str) -> str:
    return address.split("/p2p/")[0]


def test_an_agent_given_only_the_routers_address_joins_and_serves(fleet: Fleet) -> None:
    router = fleet.router()
    # The router's address alone, as a Go agent's --router-grpc host:port.
    address = f"/ip4/127.0.0.1/tcp/{router.p2p_port}"
    plain = fleet.agent([], "m1", "--router", address)
    router.wait_agent(plain.peer_id)
    plain.wait_log(f"router_joined router={router.peer_id}")
    reply = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert reply.status_code == 200


async def test_an_impostor_without_the_secret_is_refused(fleet: Fleet) -> None:
    # A libp2p peer that welcomes every hello, as an impostor at the router's address
    # would: it cannot prove the secret, so the agent leaves before serving anything.
    async with fake_router() as impostor:
        agent = fleet.agent([], "m1", "--router", unpinned(impostor.multiaddr), wait=False)
        await impostor.joined.wait()
        hello = next(f for f in impostor.frames if f["type"] == m.HELLO)
        assert len(hello["challenge"]) == 32
        # The fake router's host runs in this trio loop: poll without blocking it.
        with trio.fail_after(20):
            while True:
                if "did not prove the shared secret" in agent.log():
                    break
                await trio.sleep(0.1)
        assert "router_refused" in agent.log(), agent.log()
        assert not [f for f in impostor.frames if f["type"] == m.HEARTBEAT]


async def test_the_router_proves_the_secret_and_refuses_a_hostile_challenge(
    fleet: Fleet,
) -> None:
    router = fleet.router()
    token = token_with(KEY)
    challenge = new_challenge()
    async with raw_session(router) as (stream, peer_id):
        await stream.write(encode_frame(m.hello(token(peer_id), METADATA, challenge)))
        welcome = await first_reply(stream)
        assert welcome["type"] == m.WELCOME
        assert proof_valid(KEY, router.peer_id, peer_id, challenge, welcome["proof"])
    async with raw_session(router) as (stream, peer_id):
        hostile = "a" * (MAX_CHALLENGE + 1)
        await stream.write(encode_frame(m.hello(token(peer_id), METADATA, hostile)))
        refusal = await first_reply(stream)
        assert refusal["type"] == m.REFUSAL and "challenge longer than" in refusal["reason"]
    assert "router_ready" in router.log()


@pytest.mark.parametrize(
    "address",
    [
        "/ip4/127.0.0.1",
        "not-an-address",
        "/ip4/1.2.3.4/udp/9",
        # With the router's peer ID too: the agent has no QUIC, and dials no /dnsaddr.
        "/ip4/1.2.3.4/udp/9/quic-v1/p2p/12D3KooWGQaEXi5zdK6sv4u1rjM8EQrfH3GnjJb8GrmyrXrU2yZ8",
        "/dnsaddr/router.example/p2p/12D3KooWGQaEXi5zdK6sv4u1rjM8EQrfH3GnjJb8GrmyrXrU2yZ8",
    ],
)
def test_a_router_address_without_a_tcp_port_is_a_startup_error(address: str) -> None:
    from agent.router_identity import parse_router

    with pytest.raises(ValueError, match="is not a router multiaddr"):
        parse_router(address)
