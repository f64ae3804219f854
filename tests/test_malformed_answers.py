"""A 200 whose body is broken is a `backend_error`: retried on another agent, never relayed.

Real router and agent processes; the bad agent's simulated engine answers with one of
the broken shapes of `sim/faults.py` (`malformed` in `/sim/state`). Each model
has two agents; the bad one has the lower peer ID, so least-loaded ranking (ties to the
lowest peer ID) tries it first, and the good one must then serve the client.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.fleet import Agent, Fleet, Router, wait_until

WHOLE = ["garbage", "empty", "html", "not_object"]
STREAMED = ["sse_cut", "sse_bad_data"]
FAILURES = "hivenet_router_forward_failures_total"


@dataclass
class Pair:
    model: str
    bad: Agent
    good: Agent


@dataclass
class MalformedFleet:
    router: Router
    chat: Pair
    emb: Pair
    rr: Pair

    def pairs(self) -> tuple[Pair, ...]:
        return (self.chat, self.emb, self.rr)


@pytest.fixture(scope="module")
def malformed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MalformedFleet]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("malformed")))
    try:
        router = fleet.router()
        pairs = []
        for model, capability in (("m1", "llm"), ("emb", "embedding"), ("rr", "reranker")):
            agents = [
                fleet.agent(router, model, "--capability", capability, wait=False) for _ in range(2)
            ]
            bad, good = sorted(agents, key=lambda a: a.peer_id)
            pairs.append(Pair(model, bad, good))
        fleet.join(*(agent for pair in pairs for agent in (pair.bad, pair.good)))
        yield MalformedFleet(router, *pairs)
    finally:
        fleet.close()


@pytest.fixture
def mf(malformed_fleet: MalformedFleet) -> Iterator[MalformedFleet]:
    yield malformed_fleet
    # A failed test must not leave a failure armed for the next one.
    for pair in malformed_fleet.pairs():
        pair.bad.sim_state(fail_count=0, malformed=None, token_latency=0)


class Armed:
    """One broken answer armed on a pair's bad agent, and what must follow from it."""

    def __init__(self, mf: MalformedFleet, pair: Pair, shape: str) -> None:
        self.mf = mf
        self.pair = pair
        self.rid = str(uuid.uuid4())
        self.failures = mf.router.metric(FAILURES, model=pair.model, code="backend_error")
        self.good_requests = pair.good.sim_state()["requests_total"]
        pair.bad.sim_state(malformed=shape, fail_count=1)

    @property
    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.rid}

    def assert_retried_on_the_good_agent(self) -> None:
        router, pair = self.mf.router, self.pair
        assert pair.bad.sim_state()["fail_count"] == 0, "the bad agent was not tried first"
        assert pair.good.sim_state()["requests_total"] == self.good_requests + 1
        line = wait_until(
            lambda: re.search(rf"req={self.rid} forward_error [^\n]*", router.log()),
            10,
            "the forward_error line",
        ).group(0)
        assert f"peer={pair.bad.peer_id}" in line and "code=backend_error" in line, line
        assert "malformed engine answer" in line, line
        assert router.metric(FAILURES, model=pair.model, code="backend_error") == (
            self.failures + 1
        )
        pair.bad.wait_log(rf"req={self.rid} malformed_answer")
        assert_no_slots_held(router)


def assert_no_slots_held(router: Router) -> None:
    wait_until(
        lambda: all(a["status"]["active_requests"] == 0 for a in router.agents()),
        10,
        "every slot released",
    )


def openai_client(router: Router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def anthropic_client(router: Router) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", WHOLE + STREAMED)
def test_chat_completions(mf: MalformedFleet, shape: str, stream: bool) -> None:
    armed = Armed(mf, mf.chat, shape)
    client = openai_client(mf.router)
    messages = [{"role": "user", "content": "alpha beta"}]
    if stream:
        chunks = client.chat.completions.create(
            model="m1", messages=messages, stream=True, extra_headers=armed.headers
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = client.chat.completions.create(
            model="m1", messages=messages, extra_headers=armed.headers
        )
        text = answer.choices[0].message.content
    assert text == "Echo: alpha beta"
    armed.assert_retried_on_the_good_agent()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", ["garbage", "html", "not_object", *STREAMED])
def test_anthropic_messages(mf: MalformedFleet, shape: str, stream: bool) -> None:
    armed = Armed(mf, mf.chat, shape)
    client = anthropic_client(mf.router)
    messages = [{"role": "user", "content": "gamma delta"}]
    if stream:
        with client.messages.stream(
            model="m1", max_tokens=32, messages=messages, extra_headers=armed.headers
        ) as events:
            text = "".join(events.text_stream)
    else:
        answer = client.messages.create(
            model="m1", max_tokens=32, messages=messages, extra_headers=armed.headers
        )
        text = answer.content[0].text
    assert text == "Echo: gamma delta"
    armed.assert_retried_on_the_good_agent()


@pytest.mark.parametrize("shape", WHOLE)
def test_embeddings(mf: MalformedFleet, shape: str) -> None:
    armed = Armed(mf, mf.emb, shape)
    answer = openai_client(mf.router).embeddings.create(
        model="emb", input="one two", extra_headers=armed.headers
    )
    assert len(answer.data) == 1 and len(answer.data[0].embedding) == 8
    armed.assert_retried_on_the_good_agent()


@pytest.mark.parametrize("shape", WHOLE)
def test_rerank(mf: MalformedFleet, shape: str) -> None:
    armed = Armed(mf, mf.rr, shape)
    r = httpx.post(
        mf.router.url + "/v1/rerank",
        json={"model": "rr", "query": "red apple", "documents": ["blue sky", "red apple"]},
        headers=armed.headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == [1, 0]
    armed.assert_retried_on_the_good_agent()


@pytest.mark.parametrize(
    ("path", "protocol"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")]
)
def test_a_stream_that_breaks_after_its_first_event_goes_on_from_the_good_agent(
    mf: MalformedFleet, path: str, protocol: str
) -> None:
    """Bytes went to the client: no retry, the stream is continued on the good agent
    (docs/api/client.md, "Stream continuation"); the client sees one whole stream in its
    protocol."""
    pair = mf.chat
    failures = mf.router.metric(FAILURES, model="m1", code="backend_error")
    # The broken event comes a while after the good one, so the good one is relayed first.
    pair.bad.sim_state(malformed="sse_bad_later", fail_count=1, token_latency=0.5)
    rid = str(uuid.uuid4())
    body = {"model": "m1", "max_tokens": 32, "stream": True}
    body["messages"] = [{"role": "user", "content": "x"}]
    with httpx.stream(
        "POST", mf.router.url + path, json=body, headers={"x-request-id": rid}, timeout=30
    ) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e.strip()]
    data = [json.loads(e.split("data: ", 1)[1]) for e in events if "data: {" in e]
    assert not any("error" in d or d.get("type") == "error" for d in data), events
    if protocol == "anthropic":
        kinds = [d["type"] for d in data]
        assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop", kinds
        said = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    else:
        assert len({d["id"] for d in data}) == 1 and events[-1] == "data: [DONE]"
        said = "".join(c["delta"].get("content") or "" for d in data for c in d["choices"])
    assert said == "Echo: x"
    mf.router.wait_log(rf"req={rid} stream_continued")
    assert pair.bad.sim_state()["fail_count"] == 0
    assert mf.router.metric(FAILURES, model="m1", code="backend_error") == failures + 1
    mf.router.wait_log(rf"req={rid} stream_broken")
    pair.bad.wait_log(rf"req={rid} malformed_answer")
    assert_no_slots_held(mf.router)
