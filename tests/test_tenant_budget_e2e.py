"""A whole answer that no longer fits the day's token budget (issue 47 item 6): as
upstream, the router discards it and answers 429 `token_limit_exceeded`, the input
estimate stays charged, and the tenant's slot is given back; a refusal of a request
that declared no `max_tokens` says the budget is exceeded, not `max_tokens`."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx

from router.tenants.config import hash_key
from tests.fleet import Fleet, Router, wait_until

KEY = "hnr-budget-key"


def auth(tokens_per_day: int) -> str:
    return (
        "tenants:\n  acme:\n"
        f'    keys: ["{hash_key(KEY)}"]\n'
        f"    tokens_per_day: {tokens_per_day}\n"
        "    max_concurrent: 1\n"
    )


def chat(router: Router, text: str, **fields: object) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": text}], **fields}
    return httpx.post(
        router.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )


def reload(router: Router, path: Path, tokens_per_day: int, count: int) -> None:
    path.write_text(auth(tokens_per_day))
    router.send_signal(signal.SIGHUP)
    wait_until(
        lambda: router.log().count("auth_reloaded origin=file") == count, 15, "auth reloaded"
    )


def test_a_whole_answer_over_the_days_budget_is_discarded(fleet: Fleet, tmp_path: Path) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(auth(1_000_000))
    audit = tmp_path / "audit.jsonl"
    router = fleet.router("--auth-config-file", str(path), "--audit-log", str(audit))
    agent = fleet.agent(router, "m1")
    text = "one two three four five six seven eight"
    first = chat(router, text)
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    spent = usage["prompt_tokens"] + usage["completion_tokens"]

    reload(router, path, 2 * spent - 1, 1)
    # Without max_tokens, a refusal at admission names the budget, not max_tokens; with
    # max_tokens it names max_tokens, as upstream. Neither is charged.
    long = " ".join(["word"] * (4 * spent))
    refused = chat(router, long)
    assert refused.status_code == 429, refused.text
    message = refused.json()["error"]["message"]
    assert message.startswith("daily token budget exceeded: this request's input")
    assert "max_tokens" not in message
    declared = chat(router, "hi", max_tokens=4 * spent)
    assert declared.status_code == 429, declared.text
    assert (
        "insufficient daily token budget for requested max_tokens"
        in (declared.json()["error"]["message"])
    )

    # The same question again is admitted (its input estimate fits what is left) but
    # its answer does not fit: discarded, 429, upstream's header.
    served_before = agent.sim_state()["requests_total"]
    second = chat(router, text)
    assert second.status_code == 429, second.text
    error = second.json()["error"]
    assert error["code"] == "token_limit_exceeded"
    assert error["message"].startswith("daily token budget exceeded: the answer took")
    assert "Echo" not in second.text  # the answer itself never reaches the client
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    assert 1 <= int(second.headers["retry-after"]) <= 86400
    # The engine did the work (upstream's warning says so).
    assert agent.sim_state()["requests_total"] == served_before + 1
    router.wait_log(r"tenant=acme tenant_limit code=token_limit_exceeded [^\n]*answer_discarded")

    # The tenant's one concurrent slot and the agent's slot were given back: with room
    # in the budget again, the next request is served.
    reload(router, path, 1_000_000, 2)
    again = chat(router, text)
    assert again.status_code == 200, again.text
    assert all(a["status"]["active_requests"] == 0 for a in router.agents())

    # The audit line of the discarded answer keeps the agent and the real usage.
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    discarded = next(line for line in lines if line.get("agent") and line["status"] == 429)
    assert discarded["code"] == "token_limit_exceeded"
    assert discarded["agent"] == agent.peer_id
    assert discarded["prompt_tokens"] == usage["prompt_tokens"]
    assert discarded["completion_tokens"] == usage["completion_tokens"]
