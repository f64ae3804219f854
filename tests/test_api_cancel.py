"""A client that leaves early cancels the forward: the engine stops, the slot is freed.

The sim engine counts the requests whose client (the agent) went away
(`cancelled_total`) and those still running (`in_flight`); the router's routing table
shows the agent's `active_requests`. 40 tokens at 50 ms make a 2 s answer that the
tests leave after a few chunks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.fleet import Agent, Fleet, Router, wait_until

WORDS = " ".join(f"w{i}" for i in range(39))  # "Echo:" + 39 words = 40 tokens
LONG = " ".join(f"w{i}" for i in range(199))


class CancelFleet:
    def __init__(self, fleet: Fleet, *router_flags: str) -> None:
        self.router: Router = fleet.router(*router_flags)
        self.agent: Agent = fleet.agent(
            self.router, "m1", "--capacity", "8", "--sim-token-latency", "50ms"
        )

    def active(self) -> int:
        return self.router.agent(self.agent.peer_id)["status"]["active_requests"]

    def sim(self) -> dict:
        return self.agent.sim_state()

    def wait_idle(self, cancelled_at_least: int) -> None:
        """The engine saw the cancellations, runs nothing, and the router holds no slot."""
        wait_until(
            lambda: self.sim()["cancelled_total"] >= cancelled_at_least, 15, "engine cancelled"
        )
        wait_until(lambda: self.sim()["in_flight"] == 0, 15, "engine idle")
        wait_until(lambda: self.active() == 0, 15, "active_requests back to 0")


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CancelFleet]:
    """The seeds' default: a stream's slot is released when the response head arrives."""
    fleet = Fleet(Path(tmp_path_factory.mktemp("cancel-head")))
    try:
        yield CancelFleet(fleet)
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def end(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CancelFleet]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("cancel-end")))
    try:
        yield CancelFleet(fleet, "--stream-slot-release", "end")
    finally:
        fleet.close()


def _chat(stream: bool, words: str = WORDS) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": words}], "stream": stream}


def _drop_stream_after(cf: CancelFleet, chunks: int, active_during: int, rid: str) -> None:
    """Read `chunks` token events of a streamed answer, check the slot count, leave."""
    seen = 0
    with httpx.stream(
        "POST",
        cf.router.url + "/v1/chat/completions",
        json=_chat(stream=True),
        headers={"x-request-id": rid},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
                if seen == chunks:
                    # Mid-stream: the engine is generating; the slot as the flag says.
                    assert cf.sim()["in_flight"] == 1
                    assert cf.active() == active_during
                    # Leaving the loop closes the connection with most of the answer unsent.
                    break


def test_dropped_stream_cancels_the_engine_call(head: CancelFleet) -> None:
    before = head.sim()["cancelled_total"]
    rid = str(uuid.uuid4())
    _drop_stream_after(head, 4, active_during=0, rid=rid)
    head.wait_idle(before + 1)
    assert head.sim()["cancelled_total"] == before + 1
    head.router.wait_log(rf"req={rid} client_disconnected")
    head.router.wait_log(rf"req={rid} method=POST path=/v1/chat/completions status=499")


def test_dropped_stream_with_slot_held_to_the_end(end: CancelFleet) -> None:
    before = end.sim()["cancelled_total"]
    _drop_stream_after(end, 4, active_during=1, rid=str(uuid.uuid4()))
    end.wait_idle(before + 1)


def test_a_finished_stream_with_slot_held_to_the_end_releases_it(end: CancelFleet) -> None:
    before = end.sim()["cancelled_total"]
    client = openai.OpenAI(base_url=end.router.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "a b c d e f g h"}], stream=True
    )
    parts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if len(parts) == 3:
                assert end.active() == 1  # held while the stream runs
    assert "".join(parts) == "Echo: a b c d e f g h"
    wait_until(lambda: end.active() == 0, 15, "slot released at the stream's end")
    assert end.sim()["cancelled_total"] == before


def test_openai_sdk_closing_a_stream_cancels_it(head: CancelFleet) -> None:
    before = head.sim()["cancelled_total"]
    client = openai.OpenAI(base_url=head.router.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": WORDS}], stream=True
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    head.wait_idle(before + 1)


def test_dropped_anthropic_stream_cancels_too(head: CancelFleet) -> None:
    before = head.sim()["cancelled_total"]
    body = {**_chat(stream=True), "max_tokens": 100}
    with httpx.stream("POST", head.router.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200
        deltas = 0
        for line in r.iter_lines():
            if line.startswith("event: content_block_delta"):
                deltas += 1
                if deltas == 3:
                    break
    head.wait_idle(before + 1)


@pytest.mark.parametrize("fixture", ["head", "end"])
def test_non_streaming_client_disconnect_cancels_the_forward(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    cf: CancelFleet = request.getfixturevalue(fixture)
    before = cf.sim()["cancelled_total"]
    rid = str(uuid.uuid4())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            cf.router.url + "/v1/chat/completions",
            json=_chat(stream=False),
            headers={"x-request-id": rid},
            timeout=httpx.Timeout(30, read=0.6),
        )
    cf.wait_idle(before + 1)
    cf.router.wait_log(rf"req={rid} client_disconnected")


def test_many_dropped_streams_leave_nothing_behind(end: CancelFleet) -> None:
    before = end.sim()["cancelled_total"]
    clients = []
    try:
        for _ in range(6):
            c = httpx.Client(timeout=30)
            # 10 s answers: all six are still running however slowly they were opened.
            request = c.build_request(
                "POST", end.router.url + "/v1/chat/completions", json=_chat(True, LONG)
            )
            r = c.send(request, stream=True)
            assert r.status_code == 200
            clients.append((c, r))
        wait_until(lambda: end.active() == 6, 15, "six slots held")
    finally:
        for c, r in clients:
            r.close()
            c.close()
    end.wait_idle(before + 6)
    # The agent can take a full load again.
    r = httpx.post(
        end.router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "again"}]},
        timeout=30,
    )
    assert r.json()["choices"][0]["message"]["content"] == "Echo: again"
