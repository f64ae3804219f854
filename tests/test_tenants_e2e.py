"""Tenants from an auth file, end to end: real router, agents and simulated engines,
the official SDKs as clients."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from router.tenants.config import hash_key
from tests.fleet import ADMIN_KEY, VENV_BIN, Fleet, Proc, Router, inference_audit_lines, wait_until

ALPHA, BETA, GAMMA, DELTA = (f"hnr-test-{n}-key" for n in ("alpha", "beta", "gamma", "delta"))
# A word no log or audit line may contain: prompts are never written down.
SECRET_WORD = "zebracadabra"
CHAT_PATH = "/v1/chat/completions"

AUTH = f"""
tenants:
  alpha:
    keys: ["{hash_key(ALPHA)}"]
    models: [m1]
    requests_per_minute: 1
    burst: 2
  beta:
    keys: ["{hash_key(BETA)}"]
    models: ["m*"]
    requests_per_minute: 1
    burst: 2
    max_input_bytes: 2000
    priority: 5
  gamma:
    keys: ["{hash_key(GAMMA)}"]
    models: [slow]
    max_concurrent: 1
  delta:
    keys: ["{hash_key(DELTA)}"]
    tokens_per_day: 40
"""


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def oai(router: Router, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=30)


def claude(router: Router, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key=key, max_retries=0, timeout=30)


def chat(client: openai.OpenAI, model: str = "m1", text: str = "hello") -> str:
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}]
    )
    return answer.choices[0].message.content or ""


def error_of(exc: openai.APIStatusError | anthropic.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_tenants_keys_models_and_every_limit(fleet: Fleet, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    router = fleet.router(
        "--auth-file", write(tmp_path / "auth.yaml", AUTH), "--audit-log", str(audit)
    )
    fleet.join(
        fleet.agent(router, "m1", wait=False),
        fleet.agent(router, "m2", wait=False),
        fleet.agent(router, "slow", "--sim-token-latency", "0.2s", wait=False),
    )

    # No key, an unknown key: 401 as without tenants.
    for key in ("", "hnr-nobody"):
        r = httpx.post(
            router.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"} if key else {},
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "unauthorized"

    # alpha: m1 only (403, no bucket token spent), then its burst of 2, then 429.
    alpha = oai(router, ALPHA)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        chat(alpha, "m2")
    assert error_of(denied.value)["code"] == "model_forbidden"
    assert "retry-after" not in denied.value.response.headers
    assert chat(alpha, text="one") == "Echo: one"
    assert chat(alpha, text="two") == "Echo: two"
    with pytest.raises(openai.RateLimitError) as limited:
        chat(alpha)
    assert error_of(limited.value)["code"] == "rate_limit_exceeded"
    assert error_of(limited.value)["type"] == "rate_limit_error"
    # One request a minute refills in at most 60 s.
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60

    # beta, Anthropic's SDK and shapes: a glob of models, an input limit, its own bucket.
    beta = claude(router, BETA)
    with pytest.raises(anthropic.APIStatusError) as too_big:
        beta.messages.create(
            model="m2", max_tokens=5, messages=[{"role": "user", "content": "x " * 2000}]
        )
    assert too_big.value.status_code == 413
    assert too_big.value.response.json()["type"] == "error"
    assert error_of(too_big.value)["code"] == "payload_too_large"
    for _ in range(2):
        reply = beta.messages.create(
            model="m2", max_tokens=20, messages=[{"role": "user", "content": "hi beta"}]
        )
        assert reply.content[0].text == "Echo: hi beta"  # type: ignore[union-attr]
    with pytest.raises(anthropic.RateLimitError) as beta_limited:
        beta.messages.create(model="m1", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    body = beta_limited.value.response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert int(beta_limited.value.response.headers["retry-after"]) >= 1

    # gamma: one request at a time. A slow stream holds the slot; a second is refused.
    gamma = oai(router, GAMMA)
    started = threading.Event()
    finished: list[str] = []

    def slow_stream() -> None:
        stream = gamma.chat.completions.create(
            model="slow",
            messages=[{"role": "user", "content": "a b c d e f g h"}],
            stream=True,
        )
        text = ""
        for chunk in stream:
            started.set()
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        finished.append(text)

    worker = threading.Thread(target=slow_stream)
    worker.start()
    assert started.wait(20)
    with pytest.raises(openai.RateLimitError) as busy:
        chat(gamma, "slow", "second")
    assert error_of(busy.value)["code"] == "concurrency_limit_exceeded"
    assert busy.value.response.headers["retry-after"] == "1"
    worker.join(30)
    assert finished == ["Echo: a b c d e f g h"]

    def again() -> bool:
        try:
            return chat(gamma, "slow", "again") == "Echo: again"
        except openai.RateLimitError:  # the stream's end reached the client first
            return False

    wait_until(again, 10, "slot given back")

    # delta: tokens per day, counted from the engine's usage whether streamed or not.
    delta = oai(router, DELTA)
    full = delta.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": f"{SECRET_WORD} two three"}]
    )
    assert full.usage is not None
    counted = full.usage.prompt_tokens + full.usage.completion_tokens

    def tokens_charged() -> float:
        return router.metric("hivenet_router_tenant_tokens_total", tenant="delta")

    wait_until(lambda: tokens_charged() == counted, 5, "non-streaming usage charged")
    # A stream whose client did not ask for usage: the router asked for it (through
    # the agent) and the client still sees no usage-only chunk. Each chunk carries the
    # running count the agent asks for so that a broken stream can be continued
    # (docs/api/client.md, stream continuation): never more than the whole answer's.
    chunks = list(
        delta.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": f"{SECRET_WORD} two three"}],
            stream=True,
        )
    )
    assert chunks and all(c.choices for c in chunks)
    running = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert running == sorted(running) and all(n <= full.usage.completion_tokens for n in running)
    counted += full.usage.prompt_tokens + full.usage.completion_tokens  # the same question
    wait_until(lambda: tokens_charged() == counted, 5, "streaming usage charged")
    # An Anthropic stream: usage from message_start and message_delta. (Its declared
    # max_tokens must fit in what is left of the day's 40 tokens, with its input.)
    with claude(router, DELTA).messages.stream(
        model="m2", max_tokens=5, messages=[{"role": "user", "content": "one two three"}]
    ) as stream:
        final = stream.get_final_message()
    counted += final.usage.input_tokens + final.usage.output_tokens
    wait_until(lambda: tokens_charged() == counted, 5, "Anthropic streaming usage charged")
    assert counted < 40
    while True:
        try:
            chat(delta, text="more words to spend the quota")
        except openai.RateLimitError as exc:
            assert error_of(exc)["code"] == "token_limit_exceeded"
            # Until midnight UTC.
            assert 1 <= int(exc.response.headers["retry-after"]) <= 86400
            break
        counted += 1
        assert counted < 200, "the token quota never ran out"

    # Per tenant and code in Prometheus, and a log line for each refusal.
    for tenant, code in (
        ("alpha", "model_forbidden"),
        ("alpha", "rate_limit_exceeded"),
        ("beta", "payload_too_large"),
        ("beta", "rate_limit_exceeded"),
        ("gamma", "concurrency_limit_exceeded"),
        ("delta", "token_limit_exceeded"),
    ):
        assert (
            router.metric("hivenet_router_tenant_rejections_total", tenant=tenant, code=code) == 1
        ), (tenant, code)
        assert re.search(rf"tenant={tenant} tenant_limit code={code} ", router.log())
    assert router.metric("hivenet_router_http_requests_total", tenant="delta") >= 4

    # The audit log: one JSON line per request, never the prompt.
    text = audit.read_text()
    assert SECRET_WORD not in text and SECRET_WORD not in router.log()
    lines = inference_audit_lines(audit)
    assert len(lines) == router.metric("hivenet_router_http_requests_total")
    by_tenant = {}
    for line in lines:
        assert set(line) >= {
            "time",
            "request_id",
            "tenant",
            "model",
            "step",
            "agent",
            "status",
            "prompt_tokens",
            "completion_tokens",
            "duration_ms",
        }
        by_tenant.setdefault(line["tenant"], []).append(line)
    refused = [x for x in by_tenant["alpha"] if x["status"] == 429]
    assert refused[0]["code"] == "rate_limit_exceeded" and refused[0]["agent"] is None
    served = [x for x in by_tenant["delta"] if x["status"] == 200]
    assert all(x["step"] == "routing_policy" and x["agent"] for x in served)
    assert sum(x["prompt_tokens"] + x["completion_tokens"] for x in served) == tokens_charged()


def test_auth_file_validation_and_reloads(fleet: Fleet, tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.yaml", "tenants:\n  alpha:\n    keys: [hnr-plain]\n    rpm: 5\n")
    # check-auth names every problem; hash-key makes keys the file accepts.
    check = subprocess.run(
        [str(VENV_BIN / "hivenet-router"), "check-auth", bad], capture_output=True, text=True
    )
    assert check.returncode == 1
    assert "tenants.alpha.keys[0]" in check.stderr and "a key in clear" in check.stderr
    assert "tenants.alpha.rpm" in check.stderr and "requests_per_minute" in check.stderr
    made = subprocess.run(
        [str(VENV_BIN / "hivenet-router"), "hash-key"], capture_output=True, text=True, check=True
    )
    key = re.search(r"^key: (\S+)$", made.stdout, re.M).group(1)  # type: ignore[union-attr]
    digest = re.search(r"^hash: (\S+)$", made.stdout, re.M).group(1)  # type: ignore[union-attr]
    assert digest == hash_key(key)
    again = subprocess.run(
        [str(VENV_BIN / "hivenet-router"), "hash-key", "--stdin"],
        input=key + "\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert again.stdout.strip() == digest

    # A bad file at start: exit 2 with the reasons.
    refused = fleet.router("--auth-file", bad, start=False)
    Proc.start(refused)  # not Router.start: it would wait for router_ready
    assert refused.popen is not None and refused.popen.wait(20) == 2
    assert "tenants.alpha.keys[0]" in refused.log()

    good = tmp_path / "auth.yaml"
    write(good, f"tenants:\n  first:\n    keys: ['{digest}']\n")
    router = fleet.router("--auth-file", str(good))
    fleet.agent(router, "m1")
    assert chat(oai(router, key)) == "Echo: hello"

    # A bad file on SIGHUP: rejected, the running tenants kept.
    write(good, "tenants:\n  first:\n    keys: []\n")
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"auth_reload_failed origin=file errors=.*tenants\.first\.keys")
    assert chat(oai(router, key)) == "Echo: hello"
    assert router.metric("hivenet_router_auth_reloads_total", result="failure") == 1

    # A good one: the new key works, the old one no longer does.
    second = "hnr-second-key"
    write(good, f"tenants:\n  second:\n    keys: ['{hash_key(second)}']\n    priority: 3\n")
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"auth_reloaded origin=file tenants=1")
    assert chat(oai(router, second)) == "Echo: hello"
    with pytest.raises(openai.AuthenticationError):
        chat(oai(router, key))

    # PUT /admin/auth: validated the same way; GET shows tenants, never key hashes.
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.put(router.url + "/admin/auth", headers=admin, content="tenants: 3\n")
    assert r.status_code == 400 and r.json()["error"]["errors"]
    r = httpx.put(
        router.url + "/admin/auth",
        headers=admin,
        content=f"tenants:\n  third:\n    keys: ['{digest}']\n    models: ['m*']\n",
    )
    assert r.status_code == 200 and r.json()["tenants"] == ["third"]
    shown = httpx.get(router.url + "/admin/auth", headers=admin)
    assert shown.status_code == 200 and "sha256:" not in shown.text
    assert shown.json()["tenants"][0] == {
        "name": "third",
        "keys": 1,
        "models": ["m*"],
        "requests_per_minute": 0,
        "burst": 0,
        "tokens_per_day": 0,
        "max_concurrent": 0,
        "max_input_bytes": 0,
        "priority": 0,
    }
    assert chat(oai(router, key)) == "Echo: hello"
    assert httpx.get(router.url + "/admin/auth").status_code == 401


def test_every_audit_line_carries_the_code_the_client_got(fleet: Fleet, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    auth = f'tenants:\n  alpha:\n    keys: ["{hash_key(ALPHA)}"]\n    models: [m1]\n'
    router = fleet.router(
        "--auth-file",
        write(tmp_path / "auth.yaml", auth),
        "--audit-log",
        str(audit),
        "--request-timeout",
        "2s",
    )
    agent = fleet.agent(router, "m1")
    got: dict[str, tuple[int, str | None]] = {}  # request id: status, the code in the answer

    def call(path: str, key: str | None, method: str = "POST", **kwargs: object) -> None:
        rid = str(uuid.uuid4())
        headers = {"x-request-id": rid}
        if key is not None and path == "/v1/messages":
            headers["x-api-key"] = key
        elif key is not None:
            headers["authorization"] = f"Bearer {key}"
        with httpx.stream(method, router.url + path, headers=headers, timeout=30, **kwargs) as r:  # type: ignore[arg-type]
            text = r.read().decode()
        code = None
        if r.status_code >= 400:
            code = json.loads(text)["error"]["code"]
        elif '"error"' in text:  # a stream cut by an error event
            code = json.loads(text.rsplit("data: ", 1)[1])["error"]["code"]
        got[rid] = (r.status_code, code)

    def chat_body(model: str = "m1", stream: bool = False) -> dict:
        messages = [{"role": "user", "content": "a b c"}]
        return {"model": model, "messages": messages, "stream": stream}

    call(CHAT_PATH, None, json=chat_body())
    call("/v1/messages", "hnr-nobody", json={**chat_body(), "max_tokens": 5})
    call(CHAT_PATH, ALPHA, method="GET")
    call(CHAT_PATH, ALPHA, content=b"not json")
    call(CHAT_PATH, ALPHA, json=chat_body("m2"))
    call(CHAT_PATH, ALPHA, json=chat_body())
    agent.sim_state(fail_status=400, fail_count=1, fail_body=None)
    call(CHAT_PATH, ALPHA, json=chat_body())
    agent.sim_state(fail_status=500, fail_count=100, fail_body=None)
    call(CHAT_PATH, ALPHA, json=chat_body())
    agent.sim_state(fail_count=0, stall_after_tokens=1)
    call(CHAT_PATH, ALPHA, json=chat_body(stream=True))
    agent.sim_state(stall_after_tokens=None)
    assert list(got.values()) == [
        (401, "unauthorized"),
        (401, "unauthorized"),
        (405, "method_not_allowed"),
        (400, "request_invalid"),
        (403, "model_forbidden"),
        (200, None),
        (400, "invalid_parameter"),
        (502, "backend_error"),
        (200, "request_timeout"),
    ]

    def lines() -> list[dict]:
        return inference_audit_lines(audit)

    wait_until(lambda: len(lines()) == len(got), 10, "an audit line per request")
    assert {x["request_id"]: (x["status"], x["code"]) for x in lines()} == got
