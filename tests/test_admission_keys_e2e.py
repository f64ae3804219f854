"""Serverless keys, the daily budget and the audit line through a real router (issue 20):
every key has its own id and buckets, and the budget charges what engines count."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx

from tests.fleet import Fleet, inference_audit_lines, wait_until

KEY_A, KEY_B, KEY_C = (f"sk-hivenet-{n * 64}" for n in ("a", "b", "c"))
WORDS = "word " * 100  # 500 characters: 160 tokens estimated at first, 100 for the sim


def _hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


AUTH = f"""
api:
  mode: api-key
  keys:
    - key_hash: "{_hex(KEY_A)}"
      metadata: {{name: a, owner: acme}}
      mode: serverless
      quota: {{input_tokens_per_minute: 160}}
    - key_hash: "{_hex(KEY_B)}"
      metadata: {{name: b, owner: acme}}
      mode: serverless
      quota: {{input_tokens_per_minute: 160}}
    - key_hash: "{_hex(KEY_C)}"
      metadata: {{name: c, owner: budget}}
      quota: {{tokens_per_day: 300}}
admin:
  mode: api-key
"""


def post(url: str, key: str, path: str, payload: dict) -> httpx.Response:
    return httpx.post(
        url + path, json=payload, headers={"authorization": f"Bearer {key}"}, timeout=15
    )


def chat(content: str = WORDS, **extra: object) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": content}], **extra}


def test_keys_buckets_budget_and_audit(fleet: Fleet, tmp_path: Path) -> None:
    auth = tmp_path / "auth.yaml"
    auth.write_text(AUTH)
    audit = tmp_path / "audit.log"
    router = fleet.router("--auth-config-file", str(auth), "--audit-log", str(audit))
    agent = fleet.agent(router, "m1")
    fleet.agent(router, "e1", "--capability", "embedding")
    chat_path, embed_path = "/v1/chat/completions", "/v1/embeddings"

    def audited() -> list[dict]:
        return inference_audit_lines(audit)

    def ended(n: int) -> None:
        """The router is done with the first `n` requests: a request's audit line is
        written after its estimate was corrected and its day's tokens trued up, and it
        may lag the answer the client already has."""
        wait_until(lambda: audit.exists() and len(audited()) == n, 10, f"{n} audit lines")

    # B4: key A's input tokens per minute (160) hold one prompt, not two: the first
    # empties the bucket, and the second (148 tokens, once the estimate learned from
    # the first) could pass only after 55 seconds of refill.
    assert post(router.url, KEY_A, chat_path, chat()).status_code == 200
    ended(1)
    refused = post(router.url, KEY_A, chat_path, chat())
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "input tokens per minute" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    # Key B, of the same owner, has buckets of its own (upstream's static keys share one).
    assert post(router.url, KEY_B, chat_path, chat()).status_code == 200
    assert router.metric("hivenet_router_admission_rejections_total", reason="b4_itpm") == 1

    # The daily budget (300) refuses a request whose input and declared output cannot
    # fit, before any engine sees it.
    served = agent.sim_state()["requests_total"]
    big = post(router.url, KEY_C, chat_path, chat("hi", max_tokens=1000))
    assert big.status_code == 429 and big.json()["error"]["code"] == "token_limit_exceeded"
    assert agent.sim_state()["requests_total"] == served
    # Embeddings are charged what the engine counted (100 each), not the estimate (160):
    # two fit, once each is trued up, and the third's estimate does not.
    embed = {"model": "e1", "input": WORDS}
    ended(4)
    assert post(router.url, KEY_C, embed_path, embed).status_code == 200
    ended(5)
    assert post(router.url, KEY_C, embed_path, embed).status_code == 200
    ended(6)
    third = post(router.url, KEY_C, embed_path, embed)
    assert third.status_code == 429 and third.json()["error"]["code"] == "token_limit_exceeded"
    ended(7)
    lines = audited()
    by_key = {line["key_id"] for line in lines if line["tenant"] == "acme"}
    assert len(by_key) == 2 and all(k.startswith("key-") for k in by_key)
    assert all(line["source_ip"] == "127.0.0.1" for line in lines)
    gates = [line["gate"] for line in lines if line["status"] == 429]
    assert gates == ["b4_itpm", None, None]  # the daily budget is the tenant gate's code
    assert [line["code"] for line in lines if line["status"] == 429][1:] == [
        "token_limit_exceeded"
    ] * 2
    for key in (KEY_A, KEY_B, KEY_C):
        assert key not in audit.read_text()
