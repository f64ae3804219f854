"""Hostile values inside well-formed frames, against real daemons.

tests/test_link_hostile.py covers answers out of order and heads no HTTP server may
send; this module covers what passes the message checks and did harm further on:
token counts larger than any engine's, refusal reasons and error messages of any
length, a router's own error codes from an agent, GPU lists that name a GPU twice,
whole answers larger than an agent sends, repeated drains; and, against a real
router, the hello timeout and session messages out of order.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair

from protocol import messages as m
from protocol.frames import encode_frame
from protocol.p2p import FramedStream
from protocol.tokens import issue_token
from protocol.usage import MAX_TOKENS, valid_usage
from router.link import MAX_WHOLE_ANSWER
from tests.fleet import Agent, Fleet, Router, router_and_agent, wait_until
from tests.link_peers import scripted_agent
from tests.test_link import METADATA, first_reply, hello_reply, raw_session
from tests.test_link_hostile import ONLY_HOSTILE, chat
from tests.test_token_attacks import KEY, claims_for, forged

# msgpack's largest integer: a router process must survive it anywhere an agent sends one.
UINT64_MAX = 2**64 - 1


@pytest.fixture(scope="module")
def fleet_router_agent(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Fleet, Router, Agent]]:
    # The history is written often, so a value it cannot hold shows at once.
    flags = ("--universal-flush-interval", "0.1s")
    with router_and_agent(Path(tmp_path_factory.mktemp("link-audit")), *flags) as fleet:
        yield fleet


@pytest.fixture
def router(fleet_router_agent: tuple[Fleet, Router, Agent]) -> Router:
    return fleet_router_agent[1]


@pytest.fixture
def healthy(fleet_router_agent: tuple[Fleet, Router, Agent]) -> Agent:
    return fleet_router_agent[2]


def stored_successes(router: Router, peer_id: str) -> int | None:
    """The agent's successes as the router's history file holds them."""
    assert router.alive(), router.log()[-3000:]
    path = router.admin("/admin/storage")["path"]
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        row = db.execute(
            "SELECT successes FROM agent_history WHERE peer_id = ?", (peer_id,)
        ).fetchone()
    return None if row is None else row[0]


def answer_with_usage(usage: dict) -> object:
    def answer(msg: dict, fs: FramedStream) -> None:
        body = b'{"choices": [{"message": {"role": "assistant", "content": "x"}}]}'
        fs.send_nowait(m.response_head(msg["id"], 200, {"content-type": "application/json"}))
        fs.send_nowait(m.response_chunk(msg["id"], body))
        fs.send_nowait({**m.response_end(msg["id"]), "usage": usage})

    return answer


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": UINT64_MAX, "completion_tokens": 0},
        {"prompt_tokens": 1, "completion_tokens": 2**63},
    ],
    ids=["prompt", "completion"],
)
async def test_a_token_count_no_engine_could_make_is_dropped_not_stored(
    router: Router, healthy: Agent, usage: dict
) -> None:
    async with scripted_agent(router, answer_with_usage(usage), ONLY_HOSTILE) as agent:
        assert (await chat(router, "m2")).status_code == 200
        router.wait_log(f"agent_bad_usage peer={agent.peer_id}")
        # The history is written after the answer: a count it cannot hold would end
        # the router here.
        wait_until(lambda: stored_successes(router, agent.peer_id) == 1, what="history row")
        universal = router.agent(agent.peer_id)["universal"]
        assert universal["input_tokens_total"] == 0
        assert universal["output_tokens_total"] == 0
    assert router.alive()
    assert router.admin("/admin/storage")["last_error"] is None
    assert (await chat(router, "m1")).status_code == 200


def answer_with_error(code: str, message: str) -> object:
    def answer(msg: dict, fs: FramedStream) -> None:
        fs.send_nowait(m.error(msg["id"], code, message, status=500))

    return answer


@pytest.mark.parametrize("code", ["backend_error", "invalid_parameter"])
async def test_an_agent_s_error_message_is_cut_before_a_log_line_or_a_client(
    router: Router, code: str
) -> None:
    marker = f"huge-{code}-"
    message = marker + "x" * (1 << 20)
    async with scripted_agent(router, answer_with_error(code, message), ONLY_HOSTILE):
        reply = await chat(router, "m2")
    assert reply.status_code in (400, 502)
    assert len(reply.content) < 10_000
    lines = [line for line in router.log().splitlines() if marker in line]
    assert lines, "the failure is logged"
    assert all(len(line) < 10_000 for line in lines)
    assert router.alive()


async def read_until_reset(stream: object, within: float) -> None:
    """Read until the router ends the session; `within` only bounds a failing test."""
    with trio.fail_after(within), pytest.raises(Exception):  # noqa: B017 - reset or EOF
        while True:
            await stream.read(65536)  # type: ignore[attr-defined]


async def test_a_session_that_never_finishes_its_hello_is_closed(router: Router) -> None:
    async with raw_session(router) as (stream, peer_id):
        # Half of a length: the decoder waits for the rest, and only the timeout ends it.
        await stream.write(b"\x00\x00")
        await read_until_reset(stream, 60)
    router.wait_log(f'session_closed_before_join peer={peer_id} reason="no hello within 10s"')


OUT_OF_ORDER = {
    "heartbeat before the hello": (False, m.heartbeat(1.0, True, {}, {})),
    "answer before the hello": (False, m.response_end(1)),
    "a second hello": (True, None),
    "a router's message from the agent": (True, m.cancel(1)),
    "a welcome from the agent": (True, m.welcome(5.0, "x", 30.0)),
}


@pytest.mark.parametrize("name", list(OUT_OF_ORDER))
async def test_session_messages_out_of_order_end_that_session_only(
    router: Router, healthy: Agent, name: str
) -> None:
    joined, frame = OUT_OF_ORDER[name]
    async with raw_session(router) as (stream, peer_id):
        hello = m.hello(issue_token(KEY, peer_id, 60), METADATA)
        if joined:
            await stream.write(encode_frame(hello))
            assert (await first_reply(stream))["type"] == m.WELCOME
        await stream.write(encode_frame(frame or hello))
        await read_until_reset(stream, 20)
    router.wait_log(f"peer={peer_id} reason=\"ProtocolError: can't handle ")
    if joined:
        router.wait_agent(peer_id, healthy=False)
    assert (await chat(router, "m1")).status_code == 200
    assert router.agent(healthy.peer_id)["status"]["healthy"]


@dataclass
class RefusingRouter:
    multiaddr: str


@asynccontextmanager
async def refusing_router(reason: str) -> AsyncIterator[RefusingRouter]:
    """A libp2p host that answers every hello with a refusal for `reason`."""
    key_pair = create_new_key_pair(os.urandom(32))
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = new_host(key_pair=key_pair, listen_addrs=listen)

    async def handler(stream: Any) -> None:
        fs = FramedStream(stream)

        def on_message(msg: dict) -> None:
            if msg["type"] == m.HELLO:
                fs.send_nowait(m.refusal(reason))

        # A handler that raises wedges py-libp2p's connection.
        with contextlib.suppress(Exception):
            await fs.run(on_message)

    host.set_stream_handler(m.PROTOCOL_ID, handler)
    async with host.run(listen_addrs=listen):
        yield RefusingRouter(str(host.get_addrs()[0]))
        await host.close()


async def test_an_agent_logs_a_router_s_refusal_cut_short(
    fleet_router_agent: tuple[Fleet, Router, Agent],
) -> None:
    fleet = fleet_router_agent[0]
    # Within the frame limit: only the cut keeps it out of the agent's log.
    reason = "refused-by-" + "r" * 60_000
    async with refusing_router(reason) as router:
        agent = fleet.agent(router, "m1", wait=False)  # type: ignore[arg-type]
        try:
            found = await trio.to_thread.run_sync(agent.wait_log, r"router_refused .*")
            line = found.group(0)
        finally:
            agent.stop()
    assert "refused-by-" in line
    assert len(line) < 1000


def gpu_samples(router: Router, peer_id: str) -> list[str]:
    return [
        line
        for line in router.metrics().splitlines()
        if line.startswith("hivenet_router_agent_gpu_power_watts{") and peer_id in line
    ]


def beat_with_gpus(indexes: list[int]) -> dict:
    gpus = [{"index": i, "power_watts": 100.0 + n} for n, i in enumerate(indexes)]
    return m.heartbeat(1.0, True, {}, {"gpus": gpus, "age": 0.0, "interval": 2.0})


async def test_a_heartbeat_naming_a_gpu_twice_puts_no_gpu_series_out(
    router: Router, healthy: Agent
) -> None:
    answer = answer_with_error("backend_error", "unused")
    async with (
        scripted_agent(router, answer, ONLY_HOSTILE, heartbeat=beat_with_gpus([0, 1])) as good,
        scripted_agent(router, answer, ONLY_HOSTILE, heartbeat=beat_with_gpus([0, 0])) as bad,
    ):
        await trio.to_thread.run_sync(
            lambda: wait_until(lambda: len(gpu_samples(router, good.peer_id)) == 2)
        )
        assert gpu_samples(router, bad.peer_id) == []
        assert router.agent(bad.peer_id)["hardware"]["gpu"] == []
        assert router.agent(bad.peer_id)["hardware"]["gpu_power_watts"] is None


async def test_a_repeated_drain_is_logged_once(router: Router, healthy: Agent) -> None:
    async with scripted_agent(router, answer_with_error("backend_error", "x"), ONLY_HOSTILE) as a:
        for _ in range(5):
            a.fs.send_nowait(m.drain())
        # Frames are handled in order: once this one's value shows, the drains are in.
        marker = {"kv_cache_utilization": 0.123, "age": 0.0, "interval": 60.0}
        a.fs.send_nowait(m.heartbeat(1.0, True, marker, {}))
        await trio.to_thread.run_sync(
            lambda: wait_until(
                lambda: router.agent(a.peer_id)["engine"]["kv_cache_utilization"] == 0.123,
                what="the heartbeat behind the drains",
            )
        )
    assert router.log().count(f"agent_draining peer={a.peer_id}") == 1


@pytest.mark.parametrize(
    "code",
    [
        "unauthorized",
        "token_limit_exceeded",
        "rate_limit_exceeded",
        "model_forbidden",
        "request_invalid",
        "queue_full",
        "no such code",
    ],
)
async def test_an_agent_cannot_answer_with_a_router_s_own_refusal(
    router: Router, code: str
) -> None:
    async with scripted_agent(router, answer_with_error(code, "not mine"), ONLY_HOSTILE) as a:
        reply = await chat(router, "m2")
        failed = router.agent(a.peer_id)["universal"]["failed_requests_total"]
    assert reply.status_code == 502
    assert reply.json()["error"]["code"] == "backend_error"
    # Charged to the agent, as any failure of its own.
    assert failed >= 1
    router.wait_log(f"agent_bad_code peer={a.peer_id}")


async def test_a_whole_answer_larger_than_any_agent_sends_is_cut_off(router: Router) -> None:
    part = b"x" * (4 << 20)

    def answer(msg: dict, fs: FramedStream) -> None:
        fs.send_nowait(m.response_head(msg["id"], 200, {"content-type": "application/json"}))
        # Past one frame's worth in all: an agent sends a whole answer as one chunk.
        for _ in range(MAX_WHOLE_ANSWER // len(part) + 2):
            fs.send_nowait(m.response_chunk(msg["id"], part))
        fs.send_nowait(m.response_end(msg["id"]))

    async with scripted_agent(router, answer, ONLY_HOSTILE) as agent:
        reply = await chat(router, "m2")
        with trio.fail_after(10):
            await agent.cancelled.wait()
        assert router.agent(agent.peer_id)["status"]["active_requests"] == 0
    assert reply.status_code == 502
    assert reply.json()["error"]["code"] == "backend_error"
    assert len(reply.content) < 10_000
    router.wait_log(f"stream_broken reason=.*a whole answer over {MAX_WHOLE_ANSWER} bytes")
    assert router.alive()


REFUSED = "hivenet_router_agent_sessions_refused_total"


def refusal_labels(router: Router) -> dict[str, float]:
    """The refusal count by its `reason` label."""
    counts = {}
    for line in router.metrics().splitlines():
        if line.startswith(REFUSED + "{"):
            head, _, value = line.rpartition(" ")
            counts[head.split('reason="', 1)[1].rsplit('"', 1)[0]] = float(value)
    return counts


async def test_refusals_are_counted_under_fixed_reasons_whatever_the_peer_wrote(
    router: Router,
) -> None:
    before = refusal_labels(router)
    # Peers with no secret write the header; a peer with it, the metadata.
    algs = [f"{i}-{'A' * 60}" for i in range(4)] + ["B" * 30_000]
    replies = [
        await hello_reply(router, lambda pid, alg=alg: forged({"alg": alg}, claims_for(pid), KEY))
        for alg in algs
    ]
    for metadata in ({**METADATA, "capability": "c" * 5000}, {**METADATA, "capacity": -7}):
        replies.append(await hello_reply(router, lambda pid: issue_token(KEY, pid, 60), metadata))
    for reply in replies:
        assert reply["type"] == m.REFUSAL
        assert len(reply["reason"]) <= m.MAX_REFUSAL
    assert "refused; only HS256" in replies[0]["reason"]
    after = refusal_labels(router)
    assert set(after) - set(before) <= {"token algorithm", "metadata"}
    assert after["token algorithm"] - before.get("token algorithm", 0) == len(algs)
    assert after["metadata"] - before.get("metadata", 0) == 2
    assert all(len(line) < 1000 for line in router.log().splitlines() if "agent_refused" in line)


def test_link_usage_is_bounded_at_max_tokens() -> None:
    assert valid_usage({"prompt_tokens": MAX_TOKENS, "completion_tokens": MAX_TOKENS}) == {
        "prompt_tokens": MAX_TOKENS,
        "completion_tokens": MAX_TOKENS,
    }
    assert valid_usage({"prompt_tokens": MAX_TOKENS + 1, "completion_tokens": 0}) is None
    assert valid_usage({"prompt_tokens": 0, "completion_tokens": MAX_TOKENS + 1}) is None
