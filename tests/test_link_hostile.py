"""Agents and routers that break the link's rules, against real daemons.

A scripted agent (tests/link_peers.py) joins a real router beside a real sim agent and
answers out of order or with heads no HTTP server may send; a scripted router has a
real agent process dial it and reuses a live request id.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from protocol import messages as m
from protocol.p2p import FramedStream
from router.link import MAX_ERROR_BODY
from tests.fleet import Agent, Fleet, Router, router_and_agent
from tests.link_peers import Answer, fake_router, key_below, scripted_agent
from tests.test_link import METADATA

ONLY_HOSTILE = {**METADATA, "model": "m2"}


@pytest.fixture(scope="module")
def fleet_router_agent(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Fleet, Router, Agent]]:
    with router_and_agent(Path(tmp_path_factory.mktemp("link-hostile"))) as fleet:
        yield fleet


@pytest.fixture
def router(fleet_router_agent: tuple[Fleet, Router, Agent]) -> Router:
    return fleet_router_agent[1]


@pytest.fixture
def healthy(fleet_router_agent: tuple[Fleet, Router, Agent]) -> Agent:
    return fleet_router_agent[2]


async def chat(router: Router, model: str, content: str = "ok") -> httpx.Response:
    return await trio.to_thread.run_sync(
        lambda: httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": content}]},
            timeout=20,
        )
    )


def strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def answer_with_head(status: int, headers: dict[str, str]) -> Answer:
    def answer(msg: dict, fs: FramedStream) -> None:
        fs.send_nowait(m.response_head(msg["id"], status, headers))
        fs.send_nowait(m.response_chunk(msg["id"], b'{"choices": []}'))
        fs.send_nowait(m.response_end(msg["id"]))

    return answer


BAD_HEADS = {
    "status 101": (101, {"content-type": "application/json"}),
    "status 199": (199, {}),
    "status 600": (600, {}),
    "status 0": (0, {}),
    "cr lf in a value": (200, {"x-evil": "a\r\nset-cookie: stolen=1"}),
    "lf in a value": (200, {"x-evil": "a\nb"}),
    "nul in a value": (200, {"x-evil": "a\x00b"}),
    "space in a name": (200, {"bad name": "v"}),
    "colon in a name": (200, {"x-a:b": "v"}),
    "empty name": (200, {"": "v"}),
    "value with a trailing space": (200, {"x-a": "v "}),
}


@pytest.mark.parametrize("name", list(BAD_HEADS))
async def test_a_head_the_router_cannot_send_is_a_failed_try(
    router: Router, healthy: Agent, name: str
) -> None:
    # Before: the client got no bytes at all (h11 refused the head at send time) and
    # the try counted as a success.
    status, headers = BAD_HEADS[name]
    answer = answer_with_head(status, headers)
    failures = router.metric("hivenet_router_forward_failures_total", code="backend_error")
    seed = key_below(healthy.peer_id)
    async with scripted_agent(router, answer, seed=seed) as hostile:
        reply = await chat(router, "m1")
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "Echo: ok"
        assert len(hostile.requests) == 1, "the hostile agent, tried first, failed its try"
    async with scripted_agent(router, answer, ONLY_HOSTILE) as alone:
        reply = await chat(router, "m2")
        assert reply.status_code == 502, reply.text
        assert reply.json()["error"]["code"] == "backend_error"
        refused = reply.headers["x-request-id"]
        assert len(alone.requests) == 1
        # The router cancelled the try it refused.
        with trio.fail_after(5):
            await alone.cancelled.wait()
    after = router.metric("hivenet_router_forward_failures_total", code="backend_error")
    assert after - failures == 2
    assert f"req={refused} agent_bad_head" in router.log()


async def test_a_second_response_head_fails_the_request(router: Router) -> None:
    # Before: the second head was dropped silently and the client got a 200.
    in_order = answer_with_head(200, {"content-type": "application/json"})

    def answer(msg: dict, fs: FramedStream) -> None:
        if msg["id"] > 1:
            in_order(msg, fs)
            return
        fs.send_nowait(m.response_head(msg["id"], 200, {"content-type": "application/json"}))
        fs.send_nowait(m.response_chunk(msg["id"], b'{"a": '))
        fs.send_nowait(m.response_head(msg["id"], 200, {"content-type": "text/plain"}))
        fs.send_nowait(m.response_chunk(msg["id"], b"1}"))
        fs.send_nowait(m.response_end(msg["id"]))

    async with scripted_agent(router, answer, ONLY_HOSTILE) as hostile:
        reply = await chat(router, "m2")
        assert reply.status_code == 502, reply.text
        assert reply.json()["error"]["code"] == "backend_error"
        assert "can't handle response_head in state BODY" in reply.json()["error"]["message"]
        broken = reply.headers["x-request-id"]
        with trio.fail_after(5):
            await hostile.cancelled.wait()
        # The session lives on: the next answer, in order, is served on it.
        reply = await chat(router, "m2")
        assert reply.status_code == 200, reply.text
        assert len(hostile.requests) == 2
    assert f"req={broken} agent_out_of_step" in router.log()


async def test_answers_for_ids_not_live_are_dropped_and_the_session_lives(router: Router) -> None:
    def answer(msg: dict, fs: FramedStream) -> None:
        for stray in (msg["id"] + 1000, 0, -5):
            fs.send_nowait(m.response_head(stray, 200, {}))
            fs.send_nowait(m.response_chunk(stray, b"not yours"))
            fs.send_nowait(m.error(stray, "backend_error", "not yours"))
        answer_with_head(200, {"content-type": "application/json"})(msg, fs)

    async with scripted_agent(router, answer, ONLY_HOSTILE) as hostile:
        for _ in range(3):
            reply = await chat(router, "m2")
            assert reply.status_code == 200
            assert reply.content == b'{"choices": []}'
        assert router.agent(hostile.peer_id)["status"]["healthy"]


NON_FINITE = {
    "kv_cache_utilization": math.nan,
    "running_requests": math.inf,
    "waiting_requests": -math.inf,
    "avg_ttft_seconds": 0.25,
    "age": math.nan,
    "interval": math.inf,
}


async def test_non_finite_heartbeat_values_are_unknown_and_the_table_stays_json(
    router: Router, healthy: Agent
) -> None:
    # Before: the routing table carried bare NaN and Infinity, which no JSON parser takes.
    hardware = {"gpu_temperature_c": math.inf, "gpu_util_percent": math.nan, "age": -math.inf}
    beat = m.heartbeat(time.time(), True, NON_FINITE, hardware)
    async with scripted_agent(
        router, answer_with_head(200, {}), ONLY_HOSTILE, heartbeat=beat
    ) as hostile:
        text = await trio.to_thread.run_sync(
            lambda: (
                httpx.get(
                    router.url + "/admin/routing-table",
                    headers={"authorization": "Bearer test-admin-key"},
                    timeout=10,
                ).text
            )
        )
        table = strict_json(text)
        assert isinstance(table, dict)
        mine = next(a for a in table["agents"] if a["peer_id"] == hostile.peer_id)
        # `strict_json` refused any bare NaN or Infinity; the non-finite values read as
        # unknown. (Not a search of the text: a random peer ID can hold "NaN".)
        assert mine["engine"]["avg_ttft_seconds"] == 0.25
        for name in ("kv_cache_utilization", "running_requests", "waiting_requests"):
            assert mine["engine"][name] is None, name
        assert mine["hardware"]["gpu_temperature_c"] is None
        assert mine["hardware"]["gpu_util_percent"] is None
        # Still routable: unknown values are skipped by gates, not failed.
        assert (await chat(router, "m2")).status_code == 200
    assert router.agent(healthy.peer_id)["status"]["healthy"]


async def test_an_agent_refuses_a_reused_live_id_and_serves_the_first(fleet: Fleet) -> None:
    # Before: the second request replaced the first's cancel scope and both answers
    # went out under one id.
    def on_join(fs: FramedStream) -> None:
        for content in ("first", "second"):
            body = json.dumps(
                {"model": "m1", "messages": [{"role": "user", "content": content}]}
            ).encode()
            headers = {"content-type": "application/json"}
            fs.send_nowait(m.request(7, "POST", "/v1/chat/completions", headers, body, False))

    async with fake_router(on_join) as router:
        agent = fleet.agent(router, "m1", wait=False)  # type: ignore[arg-type]
        with trio.fail_after(30):
            await router.joined.wait()
            await router.wait_for(
                lambda: any(f["type"] == m.RESPONSE_END for f in router.frames_for(7))
            )
        frames = router.frames_for(7)
        kinds = [f["type"] for f in frames]
        assert kinds.count(m.ERROR) == 1, kinds
        assert kinds.count(m.RESPONSE_HEAD) == 1, kinds
        assert kinds.count(m.RESPONSE_END) == 1, kinds
        refusal = next(f for f in frames if f["type"] == m.ERROR)
        assert "its id is live" in refusal["message"]
        body = b"".join(f["data"] for f in frames if f["type"] == m.RESPONSE_CHUNK)
        assert json.loads(body)["choices"][0]["message"]["content"] == "Echo: first"
        # No X-Request-ID in this request: the link's own number stands in.
        assert "req=7 router_out_of_step id=7" in agent.log()
        assert agent.alive()


def whole_answer(status: int, headers: dict[str, str], body: bytes) -> Answer:
    def answer(msg: dict, fs: FramedStream) -> None:
        fs.send_nowait(m.response(msg["id"], status, headers, body, None))

    return answer


async def test_a_whole_answer_in_one_frame_is_served_and_checked_as_three(
    router: Router,
) -> None:
    json_head = {"content-type": "application/json", "x-engine": "e1"}
    async with scripted_agent(router, whole_answer(200, json_head, b'{"choices": []}')) as one:
        welcome = next(f for f in one.received if f["type"] == m.WELCOME)
        assert welcome["accepts"] == [m.RESPONSE]  # what lets a real agent send it
    async with scripted_agent(
        router, whole_answer(200, json_head, b'{"choices": []}'), ONLY_HOSTILE
    ):
        reply = await chat(router, "m2")
        assert reply.status_code == 200, reply.text
        assert reply.content == b'{"choices": []}'
        assert reply.headers["x-engine"] == "e1"
    # An engine's refusal inside it is classified as the head and body would be.
    refusal = b'{"error": {"message": "messages must not be empty", "type": "BadRequestError"}}'
    async with scripted_agent(router, whole_answer(400, json_head, refusal), ONLY_HOSTILE):
        reply = await chat(router, "m2")
        assert reply.status_code == 400, reply.text
        assert "messages must not be empty" in reply.json()["error"]["message"]
    # A head no HTTP server may send is a failed try, as in a response_head.
    evil = {"x-evil": "a\r\nset-cookie: stolen=1"}
    async with scripted_agent(router, whole_answer(200, evil, b"{}"), ONLY_HOSTILE) as alone:
        reply = await chat(router, "m2")
        assert reply.status_code == 502, reply.text
        assert "set-cookie" not in reply.headers
        with trio.fail_after(5):
            await alone.cancelled.wait()


async def test_an_oversized_whole_refusal_is_not_cancelled_after_its_end(
    router: Router,
) -> None:
    # Past MAX_ERROR_BODY the router stops reading a failed answer and cancels the rest;
    # a whole answer has no rest: its end came in the same frame.
    refusal = b'{"error": {"message": "' + b"x" * MAX_ERROR_BODY + b'"}}'
    head = {"content-type": "application/json"}
    async with scripted_agent(router, whole_answer(400, head, refusal), ONLY_HOSTILE) as agent:
        reply = await chat(router, "m2")
        assert reply.status_code == 400, reply.text
        # A heartbeat's round trip later, a cancel sent with the answer would be here.
        await trio.sleep(1.0)
        assert not agent.cancelled.is_set()
        assert [f["type"] for f in agent.received].count(m.CANCEL) == 0

    # The same refusal streamed with no end yet: the rest is cancelled.
    def streamed(msg: dict, fs: FramedStream) -> None:
        fs.send_nowait(m.response_head(msg["id"], 400, head))
        fs.send_nowait(m.response_chunk(msg["id"], refusal))

    async with scripted_agent(router, streamed, ONLY_HOSTILE) as agent:
        reply = await chat(router, "m2")
        assert reply.status_code == 400, reply.text
        with trio.fail_after(5):
            await agent.cancelled.wait()


async def test_a_whole_answer_after_a_head_fails_the_request(router: Router) -> None:
    def answer(msg: dict, fs: FramedStream) -> None:
        fs.send_nowait(m.response_head(msg["id"], 200, {"content-type": "application/json"}))
        fs.send_nowait(m.response(msg["id"], 200, {}, b"{}", None))

    async with scripted_agent(router, answer, ONLY_HOSTILE):
        reply = await chat(router, "m2")
        assert reply.status_code == 502, reply.text
        assert "can't handle response in state BODY" in reply.json()["error"]["message"]


@pytest.mark.parametrize("accepts", [(m.RESPONSE,), ()])
async def test_a_real_agent_sends_a_whole_answer_whole_only_where_the_router_takes_it(
    fleet: Fleet, accepts: tuple[str, ...]
) -> None:
    def on_join(fs: FramedStream) -> None:
        body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}]})
        headers = {"content-type": "application/json"}
        fs.send_nowait(m.request(5, "POST", "/v1/chat/completions", headers, body.encode(), False))

    async with fake_router(on_join, accepts) as router:
        fleet.agent(router, "m1", wait=False)  # type: ignore[arg-type]
        with trio.fail_after(30):
            await router.wait_for(
                lambda: any(f["type"] in (m.RESPONSE, m.RESPONSE_END) for f in router.frames_for(5))
            )
        frames = router.frames_for(5)
        if accepts:
            [whole] = frames
            assert whole["type"] == m.RESPONSE and whole["status"] == 200
            body = whole["body"]
        else:
            kinds = [f["type"] for f in frames]
            assert kinds == [m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END]
            body = frames[1]["data"]
        assert json.loads(body)["choices"][0]["message"]["content"] == "Echo: x"
