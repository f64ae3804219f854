"""Every error the router answers, in both protocols, against real processes.

OpenAI-style endpoints answer `{"error":{"code","message","type","source"}}`;
`/v1/messages` answers Anthropic's `{"type":"error","error":{...}}` with the same inner
fields. The official SDKs must raise the exception class that matches the status.

`payload_too_large` (413) is the router's name for a body over
HIVENET_ROUTER_MAX_REQUEST_BYTES; INTERFACE.md lists no code for it.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from protocol.errors import (
    STATUS,
    ErrorCode,
    RouterError,
    anthropic_error_body,
    classify_backend_status,
    openai_error_body,
    route_missing,
)
from tests.fleet import Agent, Fleet, Router, wait_until

KEY = "err-key"
OTHER_KEY = "other-key"
MAX_BYTES = 65536
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
BOTH = [(CHAT, "openai"), (MESSAGES, "anthropic")]
ALL = [*BOTH, (EMBEDDINGS, "openai"), (RERANK, "openai")]


def request_body(path: str, model: str = "m1", text: str = "hello", **extra: Any) -> dict:
    if path == EMBEDDINGS:
        return {"model": model, "input": text, **extra}
    if path == RERANK:
        return {"model": model, "query": text, "documents": [text], **extra}
    body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    if path == MESSAGES:
        body.setdefault("max_tokens", 64)
    return body


def post(
    router: Router,
    path: str,
    body: dict | bytes,
    key: str | None = KEY,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> httpx.Response:
    h = {"content-type": "application/json", **(headers or {})}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(router.url + path, content=content, headers=h, timeout=timeout)


def assert_error(
    r: httpx.Response, status: int, code: str, protocol: str, source: str = "router"
) -> dict:
    """The status, the protocol's shape, the code and source; returns the inner error."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    uuid.UUID(r.headers["x-request-id"])
    body = r.json()
    if protocol == "anthropic":
        assert set(body) == {"type", "error"}, body
        assert body["type"] == "error"
    else:
        assert set(body) == {"error"}, body
    err = body["error"]
    assert {"code", "message", "type", "source"} <= set(err), err
    assert err["code"] == code, err
    assert err["source"] == source, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


class ErrFleet:
    def __init__(self, fleet: Fleet) -> None:
        self.router = fleet.router(
            env={
                "HIVENET_ROUTER_API_KEYS": f"{KEY}:team-a,{OTHER_KEY}:team-b",
                "HIVENET_ROUTER_MAX_REQUEST_BYTES": str(MAX_BYTES),
            }
        )
        self.m1 = fleet.agent(self.router, "m1", "--heartbeat-interval", "1s", wait=False)
        self.emb = fleet.agent(self.router, "emb", "--capability", "embedding", wait=False)
        self.rr = fleet.agent(self.router, "rr", "--capability", "reranker", wait=False)
        # Served by embedding agents only: chat requests must stop at gate 3.
        self.shared = fleet.agent(self.router, "shared", "--capability", "embedding", wait=False)
        self.down = fleet.agent(self.router, "down", "--heartbeat-interval", "1s", wait=False)
        fleet.join(self.m1, self.emb, self.rr, self.shared, self.down)

    def model_for(self, path: str) -> str:
        return {EMBEDDINGS: "emb", RERANK: "rr"}.get(path, "m1")

    def agent_for(self, path: str) -> Agent:
        return {EMBEDDINGS: self.emb, RERANK: self.rr}.get(path, self.m1)


@pytest.fixture(scope="module")
def err_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ErrFleet]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("errors")))
    try:
        yield ErrFleet(fleet)
    finally:
        fleet.close()


@pytest.fixture
def ef(err_fleet: ErrFleet) -> Iterator[ErrFleet]:
    yield err_fleet
    # A failed test must not leave a failure armed for the next one.
    for agent in (err_fleet.m1, err_fleet.emb, err_fleet.rr, err_fleet.down):
        agent.sim_state(fail_count=0, healthy=True, stall_after_tokens=None)


# --- the request itself -------------------------------------------------------------


@pytest.mark.parametrize(("path", "protocol"), ALL)
@pytest.mark.parametrize(
    "body",
    [b"not json", b"{", b"[1, 2]", b'"text"', b"null", b"\xff\xfe\x00\x81garbage", b""],
    ids=["text", "truncated", "array", "string", "null", "non-utf8", "empty"],
)
def test_malformed_body_is_request_invalid(
    ef: ErrFleet, path: str, protocol: str, body: bytes
) -> None:
    assert_error(post(ef.router, path, body), 400, "request_invalid", protocol)


@pytest.mark.parametrize(("path", "protocol"), BOTH)
def test_deeply_nested_json_is_request_invalid_not_a_crash(
    ef: ErrFleet, path: str, protocol: str
) -> None:
    body = b"[" * 30000 + b"]" * 30000
    err = assert_error(post(ef.router, path, body), 400, "request_invalid", protocol)
    assert "nested" in err["message"]
    assert "handler_error" not in ef.router.log()


@pytest.mark.parametrize(("path", "protocol"), ALL)
@pytest.mark.parametrize("model", [None, "", 5, ["m1"]], ids=["missing", "empty", "int", "list"])
def test_missing_model_is_request_invalid(ef: ErrFleet, path: str, protocol: str, model) -> None:
    body = request_body(path)
    if model is None:
        del body["model"]
    else:
        body["model"] = model
    err = assert_error(post(ef.router, path, body), 400, "request_invalid", protocol)
    assert "model" in err["message"]


@pytest.mark.parametrize(("path", "protocol"), ALL)
def test_unknown_model_is_404_model_not_found(ef: ErrFleet, path: str, protocol: str) -> None:
    r = post(ef.router, path, request_body(path, model="no-such-model"))
    err = assert_error(r, 404, "model_not_found", protocol)
    assert "no-such-model" in err["message"]
    assert err["type"] == "not_found_error"


@pytest.mark.parametrize(("path", "protocol"), ALL)
def test_body_over_the_limit_is_413_payload_too_large(
    ef: ErrFleet, path: str, protocol: str
) -> None:
    body = request_body(path, model=ef.model_for(path), text="x " * MAX_BYTES)
    err = assert_error(post(ef.router, path, body), 413, "payload_too_large", protocol)
    assert str(MAX_BYTES) in err["message"]
    # Without a Content-Length (chunked upload) the limit holds as the body arrives.
    data = json.dumps(body).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    r = httpx.post(
        ef.router.url + path,
        content=chunks(),
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        timeout=30,
    )
    assert_error(r, 413, "payload_too_large", protocol)
    # Just under the limit is served.
    ok = post(ef.router, path, request_body(path, model=ef.model_for(path), text="y"))
    assert ok.status_code == 200, ok.text


# --- keys and tenants -----------------------------------------------------------------


@pytest.mark.parametrize(("path", "protocol"), ALL)
def test_client_keys_are_required_when_configured(ef: ErrFleet, path: str, protocol: str) -> None:
    body = request_body(path, model=ef.model_for(path))
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"x-api-key": "wrong"},
        {"authorization": "Basic " + KEY},
        {"authorization": "Bearer  x"},
    ):
        r = post(ef.router, path, body, key=None, headers=headers)
        err = assert_error(r, 401, "unauthorized", protocol)
        assert err["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == 'Bearer realm="hivenet-router"'
    assert post(ef.router, path, body).status_code == 200
    r = post(ef.router, path, body, key=None, headers={"x-api-key": OTHER_KEY})
    assert r.status_code == 200, r.text
    # Upstream also takes the raw key without `Bearer` (api-keys).
    r = post(ef.router, path, body, key=None, headers={"authorization": KEY})
    assert r.status_code == 200, r.text


def test_tenant_of_the_key_is_in_the_access_log_and_metric_labels(ef: ErrFleet) -> None:
    rid = str(uuid.uuid4())
    r = post(
        ef.router,
        MESSAGES,
        request_body(MESSAGES),
        key=None,
        headers={"x-api-key": OTHER_KEY, "x-request-id": rid},
    )
    assert r.status_code == 200, r.text
    line = ef.router.wait_log(rf"req={rid} method=POST path=/v1/messages status=200 [^\n]*")
    assert "tenant=team-b" in line.group(0)
    assert (
        ef.router.metric(
            "hivenet_router_http_requests_total", endpoint=MESSAGES, status="200", tenant="team-b"
        )
        >= 1
    )
    assert (
        ef.router.metric(
            "hivenet_router_request_duration_seconds_count", endpoint=MESSAGES, tenant="team-b"
        )
        >= 1
    )
    bad = post(ef.router, CHAT, request_body(CHAT), key="nope")
    assert bad.status_code == 401
    assert ef.router.metric("hivenet_router_http_requests_total", status="401", tenant="-") >= 1


# --- routing outcomes -------------------------------------------------------------------


@pytest.mark.parametrize(("path", "protocol"), BOTH)
def test_chat_to_an_embedding_only_model_stops_at_the_capability_gate(
    ef: ErrFleet, path: str, protocol: str
) -> None:
    before = ef.shared.sim_state()["requests_total"]
    rid = str(uuid.uuid4())
    r = post(ef.router, path, request_body(path, model="shared"), headers={"x-request-id": rid})
    err = assert_error(r, 503, "no_agents_available", protocol)
    assert "gate[3] capability" in err["message"]
    assert r.headers["x-request-id"] == rid
    line = ef.router.wait_log(rf"req={rid} [^\n]*policy_exhausted[^\n]*").group(0)
    assert 'capability="llm"' in line
    assert 'gate[3] capability [capability(got=\\"embedding\\",want=\\"llm\\")=1]' in line
    # Refused by the gate: nothing reached the engine.
    assert ef.shared.sim_state()["requests_total"] == before
    # The embedding endpoint itself is served.
    ok = post(ef.router, EMBEDDINGS, request_body(EMBEDDINGS, model="shared"))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("path", "protocol"), BOTH)
def test_unhealthy_backend_exhausts_the_chain(ef: ErrFleet, path: str, protocol: str) -> None:
    logged = len(ef.router.log())
    ef.down.sim_state(healthy=False)
    wait_until(
        lambda: ef.router.agent(ef.down.peer_id)["status"]["backend_healthy"] is False,
        20,
        "backend unhealthy in the routing table",
    )
    r = post(ef.router, path, request_body(path, model="down"))
    err = assert_error(r, 503, "no_agents_available", protocol)
    assert "gate[2]" in err["message"]
    # /admin/health agrees with itself: not counted healthy, not shown healthy.
    health = ef.router.admin("/admin/health")
    [row] = [a for a in health["agents"] if a["peer_id"] == ef.down.peer_id]
    assert (row["healthy"], row["backend_healthy"], row["is_healthy"]) == (True, False, False)
    assert health["healthy_agents"] == sum(a["is_healthy"] for a in health["agents"])
    ef.down.sim_state(healthy=True)
    wait_until(
        lambda: ef.router.agent(ef.down.peer_id)["status"]["backend_healthy"] is True,
        20,
        "backend healthy again",
    )
    # The router's own journal says when the agent left gate 2 and when it came back,
    # written as the heartbeat that said so was read, before the table showed it.
    changes = re.findall(
        rf"level=(\w+) subsystem=link agent_backend_(\w+) peer={ef.down.peer_id} model=down\n",
        ef.router.log()[logged:],
    )
    assert changes == [("warn", "unhealthy"), ("info", "healthy")]
    assert post(ef.router, path, request_body(path, model="down")).status_code == 200


# --- backend answers ------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "protocol"), ALL)
@pytest.mark.parametrize("stream", [False, True])
def test_backend_400_passes_through_as_invalid_parameter(
    ef: ErrFleet, path: str, protocol: str, stream: bool
) -> None:
    agent = ef.agent_for(path)
    agent.sim_state(
        fail_status=400, fail_count=1, fail_body={"error": {"message": "temperature is too high"}}
    )
    body = request_body(path, model=ef.model_for(path))
    if stream:
        body["stream"] = True
    r = post(ef.router, path, body)
    err = assert_error(r, 400, "invalid_parameter", protocol, source="backend")
    assert err["message"] == "temperature is too high"
    assert err["type"] == "invalid_request_error"
    assert agent.sim_state()["fail_count"] == 0


@pytest.mark.parametrize(("path", "protocol"), BOTH)
def test_backend_422_is_invalid_parameter_400(ef: ErrFleet, path: str, protocol: str) -> None:
    # INTERFACE.md: other 400/422 -> invalid_parameter, whose status is 400.
    ef.m1.sim_state(fail_status=422, fail_count=1, fail_body="plain text problem")
    r = post(ef.router, path, request_body(path))
    err = assert_error(r, 400, "invalid_parameter", protocol, source="backend")
    assert "plain text problem" in err["message"]


@pytest.mark.parametrize(("path", "protocol"), BOTH)
def test_context_length_from_the_engine_is_context_length_exceeded(
    ef: ErrFleet, path: str, protocol: str
) -> None:
    # The sim's context is 4096 words; the prompt plus max_tokens does not fit.
    r = post(ef.router, path, request_body(path, max_tokens=5000))
    err = assert_error(r, 400, "context_length_exceeded", protocol, source="backend")
    assert "maximum context length" in err["message"]


def test_embedding_context_length_is_context_length_exceeded(ef: ErrFleet) -> None:
    r = post(ef.router, EMBEDDINGS, request_body(EMBEDDINGS, model="emb", text="w " * 5000))
    assert_error(r, 400, "context_length_exceeded", "openai", source="backend")


@pytest.mark.parametrize(("path", "protocol"), BOTH)
@pytest.mark.parametrize(
    ("fail_status", "status", "code"),
    [(500, 502, "backend_error"), (503, 503, "backend_unavailable")],
)
def test_backend_5xx_is_retried_then_reported(
    ef: ErrFleet, path: str, protocol: str, fail_status: int, status: int, code: str
) -> None:
    # One agent serves m1: its failure drains the step (gate 5) and the chain is spent.
    ef.m1.sim_state(fail_status=fail_status, fail_count=1, fail_body=None)
    rid = str(uuid.uuid4())
    r = post(ef.router, path, request_body(path), headers={"x-request-id": rid})
    err = assert_error(r, status, code, protocol, source="backend")
    assert "gate[5]" in err["message"]
    log = ef.router.log()
    assert re.search(rf"req={rid} forward_error [^\n]*code={code}", log)
    assert re.search(rf"req={rid} [^\n]*policy_exhausted", log)
    assert ef.router.metric("hivenet_router_forward_failures_total", model="m1", code=code) >= 1
    assert post(ef.router, path, request_body(path)).status_code == 200


# --- the SDKs' exception classes ------------------------------------------------------------


def test_openai_sdk_raises_the_matching_exceptions(ef: ErrFleet) -> None:
    client = openai.OpenAI(base_url=ef.router.url + "/v1", api_key=KEY, max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    cases: list[tuple[type[Exception], int, str, dict]] = [
        (openai.NotFoundError, 404, "model_not_found", {"model": "absent"}),
        (openai.BadRequestError, 400, "request_invalid", {"model": ""}),
        (openai.BadRequestError, 400, "context_length_exceeded", {"max_tokens": 5000}),
        (openai.InternalServerError, 503, "no_agents_available", {"model": "shared"}),
        (openai.APIStatusError, 413, "payload_too_large", {"user": "x" * MAX_BYTES}),
    ]
    for cls, status, code, kwargs in cases:
        with pytest.raises(cls) as info:
            client.chat.completions.create(**{"model": "m1", "messages": msgs, **kwargs})
        exc = info.value
        assert isinstance(exc, openai.APIStatusError)
        assert exc.status_code == status
        assert exc.code == code, exc.body
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="absent", messages=msgs, stream=stream)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="absent", input="x")
    bad_key = openai.OpenAI(base_url=ef.router.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as auth:
        bad_key.chat.completions.create(model="m1", messages=msgs)
    assert auth.value.code == "unauthorized"
    ef.m1.sim_state(fail_status=400, fail_count=1, fail_body=None)
    with pytest.raises(openai.BadRequestError) as backend:
        client.chat.completions.create(model="m1", messages=msgs)
    assert backend.value.code == "invalid_parameter"


def test_anthropic_sdk_raises_the_matching_exceptions(ef: ErrFleet) -> None:
    client = anthropic.Anthropic(base_url=ef.router.url, api_key=KEY, max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    cases: list[tuple[type[Exception], int, str, dict]] = [
        (anthropic.NotFoundError, 404, "model_not_found", {"model": "absent"}),
        (anthropic.BadRequestError, 400, "request_invalid", {"model": ""}),
        (anthropic.BadRequestError, 400, "context_length_exceeded", {"max_tokens": 5000}),
        (anthropic.ServiceUnavailableError, 503, "no_agents_available", {"model": "shared"}),
        (
            anthropic.ContentTooLargeError,
            413,
            "payload_too_large",
            {"system": "x" * MAX_BYTES},
        ),
    ]
    for cls, status, code, kwargs in cases:
        with pytest.raises(cls) as info:
            client.messages.create(**{"model": "m1", "max_tokens": 16, "messages": msgs, **kwargs})
        exc = info.value
        assert isinstance(exc, anthropic.APIStatusError)
        assert exc.status_code == status
        assert isinstance(exc.body, dict) and exc.body["type"] == "error"
        assert exc.body["error"]["code"] == code
    with (
        pytest.raises(anthropic.NotFoundError),
        client.messages.stream(model="absent", max_tokens=16, messages=msgs) as stream,
    ):
        stream.get_final_message()
    bad_key = anthropic.Anthropic(base_url=ef.router.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.create(model="m1", max_tokens=16, messages=msgs)


# --- malformed HTTP ---------------------------------------------------------------------------


def raw_http(router: Router, data: bytes, close_after_send: bool = False) -> bytes:
    """Send raw bytes; everything the router answers until it closes (or 10 s pass)."""
    with socket.create_connection(("127.0.0.1", router.http_port), timeout=10) as s:
        s.sendall(data)
        if close_after_send:
            s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def _head(path: str, length: str, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n{extra}"
        "Connection: close\r\n\r\n"
    ).encode()


def test_malformed_http_never_crashes_the_router(ef: ErrFleet) -> None:
    router = ef.router
    body = json.dumps(request_body(CHAT)).encode()
    # A body shorter than its Content-Length, then the client leaves.
    raw_http(router, _head(CHAT, str(len(body) + 100)) + body, close_after_send=True)
    # Content-Length shorter than the body: the truncated JSON is refused by the router
    # in Anthropic's shape, or the stray bytes by the HTTP layer first.
    answer = raw_http(router, _head(MESSAGES, "10") + body)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"content-length: 0\r\n" in answer or b'"type":"error"' in answer, answer
    answer = raw_http(router, _head(MESSAGES, "10") + body[:10])
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b'"type":"error"' in answer and b"request_invalid" in answer, answer
    # Nonsense Content-Length and request lines: rejected by the HTTP layer.
    for junk in (
        _head(CHAT, "abc") + body,
        _head(CHAT, "-5") + body,
        b"GARBAGE\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS hello
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n",
    ):
        answer = raw_http(router, junk)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer[:200]
    # A declared size over the limit is refused without reading the body.
    answer = raw_http(router, _head(MESSAGES, str(MAX_BYTES * 100)))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"type":"error"' in answer and b"payload_too_large" in answer
    # Still serving, and no handler ever failed.
    assert httpx.get(router.url + "/health", timeout=10).json() == {"status": "ok"}
    assert post(router, CHAT, request_body(CHAT)).status_code == 200
    assert router.alive()
    assert "handler_error" not in router.log()


@pytest.mark.parametrize(("path", "protocol"), BOTH)
def test_wrong_method_and_unknown_paths_answer_in_the_callers_protocol(
    ef: ErrFleet, path: str, protocol: str
) -> None:
    h = {"authorization": f"Bearer {KEY}"}
    r = httpx.get(ef.router.url + path, headers=h, timeout=10)
    assert_error(r, 405, "method_not_allowed", protocol)
    assert r.headers["allow"] == "POST"
    r = httpx.post(ef.router.url + path + "/no-such-thing", headers=h, json={}, timeout=10)
    assert_error(r, 404, "not_found", protocol)


def test_unknown_routes_and_models_in_the_models_api(ef: ErrFleet) -> None:
    h = {"authorization": f"Bearer {KEY}"}
    r = httpx.get(ef.router.url + "/v1/models/absent", headers=h, timeout=10)
    assert_error(r, 404, "model_not_found", "openai")
    r = httpx.post(ef.router.url + "/v1/models", headers=h, timeout=10)
    assert_error(r, 405, "method_not_allowed", "openai")
    assert r.headers["allow"] == "GET, HEAD"
    r = httpx.get(ef.router.url + "/nowhere", timeout=10)
    assert_error(r, 404, "not_found", "openai")


@pytest.mark.parametrize("path", ["/health", "/v1/models"])
def test_head_answers_as_get_without_the_body(ef: ErrFleet, path: str) -> None:
    """A load balancer's health check or a monitor may ask with HEAD."""
    h = {"authorization": f"Bearer {KEY}"}
    got = httpx.get(ef.router.url + path, headers=h, timeout=10)
    head = httpx.head(ef.router.url + path, headers=h, timeout=10)
    assert got.status_code == head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == got.headers["content-length"]
    assert head.headers["content-type"] == got.headers["content-type"]


# --- capacity and the deadline ----------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Agent]]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("slow")))
    try:
        router = fleet.router("--queue-depth", "0", "--request-timeout", "4s")
        agent = fleet.agent(router, "slow", "--capacity", "2", "--sim-token-latency", "50ms")
        yield router, agent
    finally:
        fleet.close()


def test_no_capacity_and_request_timeout(slow_fleet: tuple[Router, Agent]) -> None:
    router, agent = slow_fleet
    # The engine stops before its first token: both slots stay taken until the deadline.
    agent.sim_state(stall_after_tokens=0)
    results: dict[str, Any] = {}

    def stalled_openai() -> None:
        results["openai"] = post(router, CHAT, request_body(CHAT, model="slow"), key=None)

    def stalled_anthropic() -> None:
        client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
        try:
            client.messages.create(
                model="slow", max_tokens=16, messages=[{"role": "user", "content": "x"}]
            )
        except anthropic.APIStatusError as exc:
            results["anthropic"] = exc

    threads = [threading.Thread(target=stalled_openai), threading.Thread(target=stalled_anthropic)]
    started = time.monotonic()
    for t in threads:
        t.start()
    wait_until(lambda: router.agents()[0]["status"]["active_requests"] == 2, 3, "both slots taken")
    # Queue disabled and no free slot: no_capacity at once, in both protocols.
    for path, protocol in BOTH:
        for stream in (False, True):
            r = post(router, path, request_body(path, model="slow", stream=stream), key=None)
            err = assert_error(r, 503, "no_capacity", protocol)
            assert "gate[6] capacity" in err["message"]
    with pytest.raises(openai.InternalServerError) as busy:
        openai.OpenAI(
            base_url=router.url + "/v1", api_key="unused", max_retries=0
        ).chat.completions.create(model="slow", messages=[{"role": "user", "content": "x"}])
    assert busy.value.status_code == 503 and busy.value.code == "no_capacity"
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - started
    assert 3.5 < elapsed < 20, elapsed
    err = assert_error(results["openai"], 504, "request_timeout", "openai")
    assert "4s" in err["message"]
    exc = results["anthropic"]
    assert isinstance(exc, anthropic.GatewayTimeoutError)
    assert exc.body["error"]["code"] == "request_timeout"
    assert exc.body["error"]["type"] == "timeout_error"
    # The deadline cancelled the forwards: the engine saw it and every slot is free.
    wait_until(lambda: agent.sim_state()["in_flight"] == 0, 10, "engine idle")
    assert agent.sim_state()["cancelled_total"] >= 2
    wait_until(lambda: router.agents()[0]["status"]["active_requests"] == 0, 10, "slots released")
    assert router.metric("hivenet_router_http_requests_total", status="504") >= 2
    assert router.metric("hivenet_router_policy_exhausted_total", model="slow") >= 4


@pytest.mark.parametrize(("path", "protocol"), BOTH)
def test_deadline_during_a_stream_ends_it_with_an_error_event(
    slow_fleet: tuple[Router, Agent], path: str, protocol: str
) -> None:
    router, agent = slow_fleet
    agent.sim_state(stall_after_tokens=2)
    try:
        with httpx.stream(
            "POST",
            router.url + path,
            json=request_body(path, model="slow", text="a b c d e", stream=True),
            timeout=30,
        ) as r:
            assert r.status_code == 200
            text = r.read().decode()
    finally:
        agent.sim_state(stall_after_tokens=None)
    events = [e for e in text.split("\n\n") if e.strip()]
    last = events[-1]
    if protocol == "anthropic":
        assert last.startswith("event: error\ndata: ")
    else:
        assert last.startswith("data: ")
    payload = json.loads(last.split("data: ", 1)[1])
    if protocol == "anthropic":
        assert payload["type"] == "error"
    assert payload["error"]["code"] == "request_timeout"
    assert len(events) >= 2  # the tokens before the stall were relayed first


# --- unit: the error bodies and the backend classification -------------------------------------


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_has_a_status_and_both_shapes(code: ErrorCode) -> None:
    err = RouterError(code, "m")
    assert err.http_status == STATUS[code]
    o = openai_error_body(err)
    a = anthropic_error_body(err)
    assert o["error"] == {
        "code": str(code),
        "message": "m",
        "type": o["error"]["type"],
        "source": "router",
    }
    assert a["type"] == "error" and a["error"]["code"] == str(code)
    assert o["error"]["type"] and a["error"]["type"]


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (200, b"", None),
        (400, b'{"message":"bad temperature"}', ErrorCode.INVALID_PARAMETER),
        (400, b"This model's maximum context length is 4096", ErrorCode.CONTEXT_LENGTH_EXCEEDED),
        (422, b'{"detail":"context_length_exceeded"}', ErrorCode.CONTEXT_LENGTH_EXCEEDED),
        (422, b"{}", ErrorCode.INVALID_PARAMETER),
        (
            400,
            b'{"error":{"code":400,"message":"the request exceeds the available context size,'
            b' try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,'
            b'"n_ctx":4096}}',
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ),
        (
            400,
            b"prompt is longer than the model's context window",
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ),
        (400, b'{"message":"max_tokens must be at least 1, got 0"}', ErrorCode.INVALID_PARAMETER),
        (400, b'{"message":"unknown field context"}', ErrorCode.INVALID_PARAMETER),
        (429, b"", ErrorCode.BACKEND_UNAVAILABLE),
        (503, b"", ErrorCode.BACKEND_UNAVAILABLE),
        (408, b"", ErrorCode.BACKEND_UNAVAILABLE),
        (500, b"", ErrorCode.BACKEND_ERROR),
        (502, b"", ErrorCode.BACKEND_ERROR),
        (413, b"", ErrorCode.REQUEST_INVALID),
        (401, b"", ErrorCode.BACKEND_ERROR),
        (404, b"", ErrorCode.BACKEND_ERROR),
    ],
)
def test_backend_status_classification(status: int, body: bytes, code: ErrorCode | None) -> None:
    assert classify_backend_status(status, body) == code


@pytest.mark.parametrize(
    ("status", "body", "missing"),
    [
        # Each engine's own words for a path it has no route for (issue 47 item 3).
        (404, b'{"detail":"Not Found"}', True),
        (404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}', True),
        (404, b"404 page not found", True),
        (404, b"", True),
        # A model it lacks is a judgement of the request, not a missing route.
        (404, b'{"error":{"message":"The model `m9` does not exist.","code":404}}', False),
        (404, b'{"error":"model \\"m9\\" not found, try pulling it first"}', False),
        (405, b'{"detail":"Method Not Allowed"}', False),
        (200, b"{}", False),
    ],
)
def test_an_engines_missing_route_is_told_from_a_missing_model(
    status: int, body: bytes, missing: bool
) -> None:
    assert route_missing(status, body) is missing
