"""Attacks on the hello's token against one real router, from in-process libp2p peers.

tests/test_link.py covers a wrong secret, `alg: none`, expiry, not-yet-valid and a
subject of another peer; this module covers what an attacker without the secret would
try next: replaying a peer's valid token, algorithm and header tricks, mangled and
oversized tokens, tokens of the wrong type. Each is refused (or, for a message that is
not a valid hello at all, the session is ended) and nobody joins; afterwards a valid
agent still joins and is served.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from protocol import messages as m
from protocol.frames import encode_frame
from protocol.tokens import issue_token
from tests.fleet import SECRET, Fleet, Router, wait_until
from tests.test_link import METADATA, first_reply, raw_session

KEY = SECRET.encode()
# Peers that present a valid token of their own; no other peer may ever join.
LEGITIMATE: set[str] = set()


@pytest.fixture(scope="module")
def fleet_and_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Router]]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("token-attacks")))
    try:
        yield fleet, fleet.router()
    finally:
        fleet.close()


@pytest.fixture
def router(fleet_and_router: tuple[Fleet, Router]) -> Router:
    return fleet_and_router[1]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forged(header: dict, claims: dict, key: bytes, digest: Any = hashlib.sha256) -> str:
    """A JWT with exactly this header, HMAC-signed with `key` whatever the header says."""
    head = b64(json.dumps(header).encode())
    body = b64(json.dumps(claims).encode())
    mac = hmac.new(key, f"{head}.{body}".encode(), digest).digest()
    return f"{head}.{body}.{b64(mac)}"


def claims_for(peer_id: str) -> dict:
    now = int(time.time())
    return {"sub": peer_id, "iat": now, "nbf": now, "exp": now + 600}


# Each attack makes the token an attacker with peer ID `pid` presents (it lacks the
# shared secret), and the refusal reason the router must give.
ATTACKS: dict[str, tuple[Callable[[str], Any], str]] = {
    "hs512 with the shared secret": (
        lambda pid: forged({"alg": "HS512", "typ": "JWT"}, claims_for(pid), KEY, hashlib.sha512),
        "algorithm 'HS512' refused",
    ),
    "hs384 with the shared secret": (
        lambda pid: forged({"alg": "HS384", "typ": "JWT"}, claims_for(pid), KEY, hashlib.sha384),
        "algorithm 'HS384' refused",
    ),
    "rs256 header, hmac signature": (
        lambda pid: forged({"alg": "RS256", "typ": "JWT"}, claims_for(pid), KEY),
        "algorithm 'RS256' refused",
    ),
    "alg None, capitalised, no signature": (
        lambda pid: forged({"alg": "None"}, claims_for(pid), b"").rsplit(".", 1)[0] + ".",
        "algorithm 'None' refused",
    ),
    "alg NONE": (
        lambda pid: forged({"alg": "NONE"}, claims_for(pid), b"").rsplit(".", 1)[0] + ".",
        "algorithm 'NONE' refused",
    ),
    "alg missing": (
        lambda pid: forged({"typ": "JWT"}, claims_for(pid), KEY),
        "algorithm None refused",
    ),
    "alg lowercase hs256": (
        lambda pid: forged({"alg": "hs256"}, claims_for(pid), KEY),
        "algorithm 'hs256' refused",
    ),
    "kid pointing at an empty file": (
        lambda pid: forged(
            {"alg": "HS256", "kid": "../../../../../../dev/null"}, claims_for(pid), b""
        ),
        "bad token signature",
    ),
    "kid sql injection": (
        lambda pid: forged(
            {"alg": "HS256", "kid": "x' UNION SELECT 'attacker-key"},
            claims_for(pid),
            b"attacker-key",
        ),
        "bad token signature",
    ),
    "embedded jwk with the attacker's key": (
        lambda pid: forged(
            {"alg": "HS256", "jwk": {"kty": "oct", "k": b64(b"attacker-key")}},
            claims_for(pid),
            b"attacker-key",
        ),
        "bad token signature",
    ),
    "jku pointing elsewhere": (
        lambda pid: forged(
            {"alg": "HS256", "jku": "https://attacker.example/keys"}, claims_for(pid), b"k" * 32
        ),
        "bad token signature",
    ),
    "typ JWE, wrong key": (
        lambda pid: forged({"alg": "HS256", "typ": "JWE"}, claims_for(pid), b"k" * 32),
        "bad token signature",
    ),
    "unknown crit extension": (
        lambda pid: forged({"alg": "HS256", "crit": ["exp"]}, claims_for(pid), b"k" * 32),
        "malformed token",
    ),
    "signature stripped": (
        lambda pid: issue_token(KEY, "12D3KooWsomeoneelse", 60).rsplit(".", 1)[0] + ".",
        "bad token signature",
    ),
    "claims swapped under a valid signature": (
        lambda pid: ".".join(
            [
                issue_token(KEY, "12D3KooWsomeoneelse", 60).split(".")[0],
                b64(json.dumps(claims_for(pid)).encode()),
                issue_token(KEY, "12D3KooWsomeoneelse", 60).split(".")[2],
            ]
        ),
        "bad token signature",
    ),
    "secret as key material, sha1": (
        lambda pid: forged({"alg": "HS256"}, claims_for(pid), KEY, hashlib.sha1),
        "bad token signature",
    ),
    "truncated signature": (
        lambda pid: issue_token(KEY, "12D3KooWsomeoneelse", 60)[:-6],
        "token",
    ),
    "two segments": (
        lambda pid: ".".join(issue_token(KEY, pid, 60).split(".")[:2]),
        "malformed token",
    ),
    "empty": (lambda pid: "", "malformed token"),
    "dots only": (lambda pid: "..", "malformed token"),
    # As large as a hello may be before it is welcomed (64 KiB in all): larger ones
    # are refused at their length, unread (below).
    "huge (60 KiB)": (lambda pid: "a" * (60 << 10), "malformed token"),
    "deeply nested header": (
        lambda pid: ".".join([b64(b'{"alg":"HS256","x":' + b"[" * 40_000), b64(b"{}"), "x"]),
        "malformed token",
    ),
    "huge base64 segments": (
        lambda pid: ".".join([b64(b"{" * 20_000), b64(b"[" * 20_000), "x" * 1000]),
        "malformed token",
    ),
}


@pytest.mark.parametrize("name", list(ATTACKS))
async def test_forged_tokens_are_refused(router: Router, name: str) -> None:
    make, reason = ATTACKS[name]
    async with raw_session(router) as (stream, peer_id):
        await stream.write(encode_frame(m.hello(make(peer_id), METADATA)))
        reply = await first_reply(stream)
        assert reply["type"] == m.REFUSAL, (name, reply)
        assert reason in reply["reason"], (name, reply["reason"])
        joined = {a["peer_id"] for a in router.agents()}
        assert peer_id not in joined


@pytest.mark.parametrize("size", [(64 << 10) + 1, 1 << 20, 15 << 20])
async def test_hellos_over_the_hello_bound_end_the_session_unread(
    router: Router, size: int
) -> None:
    async with raw_session(router) as (stream, peer_id):
        hello = encode_frame(m.hello("a" * size, METADATA))
        with trio.fail_after(10), pytest.raises(Exception):  # noqa: B017 - reset by the router
            await stream.write(hello[:65536])
            while True:
                await stream.read(65536)
        assert peer_id not in {a["peer_id"] for a in router.agents()}
    router.wait_log(rf"session_closed_before_join peer={peer_id} .*oversized frame")


@pytest.mark.parametrize(
    "token",
    [12345, None, ["a.b.c"], {"token": "a.b.c"}, b"a.b.c", True, 1.5],
    ids=["int", "null", "list", "map", "bytes", "bool", "float"],
)
async def test_tokens_of_the_wrong_type_end_the_session(router: Router, token: Any) -> None:
    """Not a hello at all: the session ends with a logged reason, nobody joins."""
    async with raw_session(router) as (stream, peer_id):
        await stream.write(encode_frame({"type": m.HELLO, "token": token, "metadata": METADATA}))
        with trio.fail_after(10), pytest.raises(Exception):  # noqa: B017 - reset by the router
            while True:
                await stream.read(65536)
        assert peer_id not in {a["peer_id"] for a in router.agents()}
    router.wait_log(rf"session_closed_before_join peer={peer_id} .*field 'token'")


async def test_a_token_replayed_by_another_peer_is_refused(router: Router) -> None:
    """Peer A joins with its own valid token; peer B, holding A's token, is refused and
    A's session is untouched."""
    seed_a = os.urandom(32)
    async with raw_session(router, seed_a) as (stream_a, peer_a):
        LEGITIMATE.add(peer_a)
        token_a = issue_token(KEY, peer_a, 600)
        await stream_a.write(encode_frame(m.hello(token_a, METADATA)))
        assert (await first_reply(stream_a))["type"] == m.WELCOME
        async with raw_session(router) as (stream_b, peer_b):
            await stream_b.write(encode_frame(m.hello(token_a, METADATA)))
            reply = await first_reply(stream_b)
        assert reply["type"] == m.REFUSAL
        assert f"token subject {peer_a} is not the connecting peer {peer_b}" in reply["reason"]
        agents = {a["peer_id"]: a for a in router.agents()}
        assert peer_b not in agents
        assert agents[peer_a]["status"]["connected"]
        # A's session still works: it answers link pings, so it stays connected.
        await stream_a.write(encode_frame(m.heartbeat(time.time(), True, {}, {})))
        await trio.sleep(0.2)
        assert router.agent(peer_a)["status"]["healthy"]


async def test_a_valid_agent_still_joins_and_is_served_after_the_attacks(
    fleet_and_router: tuple[Fleet, Router],
) -> None:
    fleet, router = fleet_and_router
    assert router.alive()
    async with raw_session(router) as (stream, peer_id):
        LEGITIMATE.add(peer_id)
        await stream.write(encode_frame(m.hello(issue_token(KEY, peer_id, 60), METADATA)))
        assert (await first_reply(stream))["type"] == m.WELCOME
    agent = await trio.to_thread.run_sync(lambda: fleet.agent(router, "m1"))
    LEGITIMATE.add(agent.peer_id)

    def ask() -> httpx.Response:
        return httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "still safe"}]},
            timeout=20,
        )

    answer = await trio.to_thread.run_sync(ask)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "Echo: still safe"
    # Whatever ran before in this module, only peers with their own valid token joined.
    joined = set(re.findall(r"agent_joined peer=(\S+)", router.log()))
    assert joined and joined <= LEGITIMATE, joined - LEGITIMATE
    wait_until(lambda: router.agent(agent.peer_id)["status"]["healthy"], 10, "agent healthy")
