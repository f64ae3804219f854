"""Request fields that change routing or framing are typed at the router (issue 17 #3a, #10).

A wrong type is refused with 400 `request_invalid` from the router (`source: router`)
in the caller's protocol, before any agent is asked: the engine never sees the request,
so nothing can be counted against an agent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from router.http.request_fields import FIELDS, MAX_MODEL_NAME, problem
from tests.fleet import Agent, Fleet, Router

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
HI = [{"role": "user", "content": "hi"}]


def valid_body(path: str) -> dict:
    if path == EMBEDDINGS:
        return {"model": "emb", "input": "hi"}
    if path == RERANK:
        return {"model": "rr", "query": "q", "documents": ["d"]}
    if path == COMPLETIONS:
        return {"model": "m1", "prompt": "hi"}
    if path == RESPONSES:
        return {"model": "m1", "input": HI}
    body: dict[str, Any] = {"model": "m1", "messages": HI}
    if path == MESSAGES:
        body["max_tokens"] = 8
    return body


# (path, field, bad value) for every rule a request can break; `None` deletes the field.
BAD = [
    *((p, "stream", v) for p in (CHAT, MESSAGES, EMBEDDINGS, RERANK) for v in ("yes", 1, [])),
    (CHAT, "messages", "hi"),
    (CHAT, "messages", {"role": "user"}),
    (CHAT, "messages", None),
    (MESSAGES, "messages", "hi"),
    (MESSAGES, "messages", {"role": "user", "content": "hi"}),
    (MESSAGES, "messages", None),
    (CHAT, "stream_options", "usage"),
    (CHAT, "stream_options", {"include_usage": "true"}),
    (CHAT, "max_tokens", -1),
    (CHAT, "max_tokens", "16"),
    (CHAT, "max_tokens", 1.5),
    (CHAT, "max_tokens", True),
    (CHAT, "max_completion_tokens", "16"),
    (MESSAGES, "max_tokens", "16"),
    (MESSAGES, "max_tokens", -5),
    (CHAT, "model", "x" * (MAX_MODEL_NAME + 1)),
    *((p, "stream", "yes") for p in (COMPLETIONS, RESPONSES)),
    (COMPLETIONS, "prompt", None),
    (COMPLETIONS, "prompt", {"text": "hi"}),
    (COMPLETIONS, "max_tokens", "16"),
    (COMPLETIONS, "stream_options", {"include_usage": 1}),
    (RESPONSES, "input", None),
    (RESPONSES, "input", 7),
    (RESPONSES, "max_output_tokens", -1),
    (RESPONSES, "model", None),
]


def body_with(path: str, name: str, value: object) -> dict:
    body = valid_body(path)
    if value is None:
        del body[name]
    else:
        body[name] = value
    return body


# --- the table, without processes ---------------------------------------------------------


@pytest.mark.parametrize(("path", "name", "value"), BAD)
def test_each_bad_type_is_named_in_the_problem(path: str, name: str, value: object) -> None:
    found = problem(path, body_with(path, name, value))
    assert found is not None and f"'{name}" in found, found


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_valid_bodies_and_null_optional_fields_pass(path: str) -> None:
    known = (CHAT, MESSAGES, EMBEDDINGS, RERANK, COMPLETIONS, RESPONSES)
    body = valid_body(path) if path in known else {"model": "m"}
    assert problem(path, body) is None
    nulls = {"stream": None, "max_tokens": None, "stream_options": None}
    assert problem(path, {**body, **nulls}) is None


def test_accepted_values_at_the_edges() -> None:
    ok = {
        "model": "m1",
        "messages": [],
        "stream": False,
        "stream_options": {"include_usage": True, "other": "kept"},
        "max_tokens": 0,
        "max_completion_tokens": 10**9,
    }
    assert problem(CHAT, ok) is None
    assert problem(CHAT, {**ok, "stream_options": {}}) is None


# --- through a real router and agents -----------------------------------------------------


class TypedFleet:
    def __init__(self, fleet: Fleet) -> None:
        self.router: Router = fleet.router()
        self.m1: Agent = fleet.agent(self.router, "m1", wait=False)
        self.emb: Agent = fleet.agent(self.router, "emb", "--capability", "embedding", wait=False)
        self.rr: Agent = fleet.agent(self.router, "rr", "--capability", "reranker", wait=False)
        fleet.join(self.m1, self.emb, self.rr)

    def engine_requests(self) -> int:
        return sum(a.sim_state()["requests_total"] for a in (self.m1, self.emb, self.rr))


@pytest.fixture(scope="module")
def tf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TypedFleet]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("typed")))
    try:
        yield TypedFleet(fleet)
    finally:
        fleet.close()


def post(router: Router, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, content=json.dumps(body).encode(), timeout=30)


@pytest.mark.parametrize(("path", "name", "value"), BAD)
def test_a_bad_type_is_refused_by_the_router_in_the_callers_protocol(
    tf: TypedFleet, path: str, name: str, value: object
) -> None:
    before = tf.engine_requests()
    r = post(tf.router, path, body_with(path, name, value))
    assert r.status_code == 400, r.text
    body = r.json()
    if path == MESSAGES:
        assert body["type"] == "error" and set(body) == {"type", "error"}, body
    else:
        assert set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == "request_invalid", err
    assert err["source"] == "router", err
    assert err["type"] == "invalid_request_error", err
    assert f"'{name}" in err["message"], err
    assert tf.engine_requests() == before


def test_messages_not_a_list_is_refused_through_the_anthropic_sdk(tf: TypedFleet) -> None:
    client = anthropic.Anthropic(base_url=tf.router.url, api_key="k", max_retries=0)
    before = tf.engine_requests()
    for messages in ("hi", {"role": "user", "content": "hi"}, 5):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="m1", max_tokens=8, messages=messages)  # type: ignore[arg-type]
        exc = info.value
        assert isinstance(exc.body, dict) and exc.body["type"] == "error"
        assert exc.body["error"]["code"] == "request_invalid"
        assert exc.body["error"]["source"] == "router"
        assert "'messages'" in exc.body["error"]["message"]
    assert tf.engine_requests() == before
    answer = client.messages.create(model="m1", max_tokens=8, messages=HI)
    assert answer.content


def test_a_truthy_stream_is_refused_through_the_openai_sdk(tf: TypedFleet) -> None:
    client = openai.OpenAI(base_url=tf.router.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m1", messages=HI, max_tokens=8, extra_body={"stream": "yes"}
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "request_invalid"
    assert "'stream' must be a boolean" in info.value.body["message"]
    # A real boolean still streams.
    chunks = list(
        client.chat.completions.create(model="m1", messages=HI, max_tokens=8, stream=True)
    )
    assert chunks
