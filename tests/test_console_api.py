"""The console's admin endpoints against real router and agent processes: explain agrees
with what real requests then do, the recent-requests ring and its stories, policy
validation, the page's headers, `hivenet-router explain`, and hostile bodies."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fleet import ADMIN_KEY, VENV_BIN, Agent, Fleet, Router, wait_until

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Round-robin is deterministic and has a memory: explain must follow it request by
# request. The primary step wants a tag no agent has, so every answer shows a drain.
POLICY = """\
routing_policy:
  match:
    tags: [gpu]
  strategy: round-robin
fallback_chain:
  - name: any
    match: {}
    exclude_if:
      kv_cache_utilization:
        gt: 0.8
    strategy: round-robin
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, list[Agent]]]:
    directory = tmp_path_factory.mktemp("console")
    policy = directory / "policy.yaml"
    policy.write_text(POLICY)
    f = Fleet(directory)
    try:
        router = f.router("--policy-file", str(policy))
        flags = ("--capacity", "4", "--engine-sample-interval", "0.5")
        a = f.agent(router, "m1", *flags, "--tags", "cpu,prod", wait=False)
        b = f.agent(router, "m1", *flags, "--tags", "cpu", wait=False)
        f.join(a, b)
        yield router, sorted([a, b], key=lambda x: x.peer_id)
    finally:
        f.close()


def explain(router: Router, **body: object) -> httpx.Response:
    return httpx.post(router.url + "/admin/explain", json=body, headers=ADMIN, timeout=10)


def chat(router: Router) -> httpx.Response:
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    return r


def test_explain_agrees_with_real_requests(fleet: tuple[Router, list[Agent]]) -> None:
    router, _ = fleet
    served = []
    for _ in range(3):
        answer = explain(router, model="m1").json()
        assert answer["outcome"] == "routed"
        primary, fallback = answer["steps"]
        # Gate 4 in the seeds' words, for each agent; the step drains there.
        for agent in primary["agents"]:
            assert agent["excluded_by"] == 'gate[4] match [tags(missing="gpu")]'
            passed = [g["pass"] for g in agent["gates"]]
            assert passed == [True, True, True, False, True, True, True]
        assert primary["drain"] == 'gate[4] match [tags(missing="gpu")=2]'
        assert primary["chosen"] is None
        assert answer["chosen_step"] == "any"
        assert fallback["ranking"][0]["peer_id"] == answer["chosen"]
        rid = chat(router).headers["x-request-id"]
        entry = httpx.get(router.url + f"/admin/requests/{rid}", headers=ADMIN, timeout=5).json()
        assert entry["agent"] == answer["chosen"], (answer, entry)
        assert entry["model"] == "m1" and entry["status"] == 200 and entry["tries"] == 1
        assert any(f"req={rid} " in line for line in entry["lines"]), entry["lines"]
        served.append(entry["agent"])
    # Round-robin: the explanation moved with the router's memory.
    assert served[0] != served[1] and served[0] == served[2]
    listed = httpx.get(
        router.url + "/admin/requests", params={"model": "m1"}, headers=ADMIN, timeout=5
    ).json()
    assert [r["agent"] for r in listed["requests"][:3]] == served[::-1]


def test_gate_7_in_the_seeds_words_and_exhaustion(fleet: tuple[Router, list[Agent]]) -> None:
    router, agents = fleet
    hot, cool = agents
    hot.sim_state(kv_cache_utilization=0.95)
    try:

        def hot_excluded() -> dict | None:
            answer = explain(router, model="m1").json()
            verdicts = {a["peer_id"]: a["excluded_by"] for a in answer["steps"][1]["agents"]}
            return answer if verdicts[hot.peer_id] else None

        answer = wait_until(hot_excluded, 15, "gate 7 to exclude the hot agent")
        verdicts = {a["peer_id"]: a["excluded_by"] for a in answer["steps"][1]["agents"]}
        assert verdicts[hot.peer_id] == "gate[7] exclude_if [kv_cache_utilization=0.95 > 0.8]"
        assert verdicts[cool.peer_id] is None
        assert answer["chosen"] == cool.peer_id
        exclusions = httpx.get(router.url + "/admin/exclusions", headers=ADMIN, timeout=5).json()
        assert exclusions["agents"][hot.peer_id][1]["excluded_by"].startswith("gate[7] exclude_if")
        cool.sim_state(kv_cache_utilization=0.9)

        def drained() -> dict | None:
            answer = explain(router, model="m1").json()
            return answer if answer["outcome"] == "exhausted" else None

        answer = wait_until(drained, 15, "both agents excluded")
        ex = answer["exhaustion"]
        assert ex["reason"] == (
            'routing_policy: gate[4] match [tags(missing="gpu")=2] | any: gate[7] exclude_if'
            " [kv_cache_utilization=2]"
        )
        assert ex["error"] == "no_agents_available" and answer["provider_fallback"] is None
        # The real request meets the same end, with the same reason in its error.
        body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 503 and ex["reason"] in r.json()["error"]["message"]
    finally:
        hot.sim_state(kv_cache_utilization=None)
        cool.sim_state(kv_cache_utilization=None)
    unknown = explain(router, model="nope").json()
    assert unknown["outcome"] == "exhausted"
    assert unknown["exhaustion"]["error"] == "model_not_found"
    assert unknown["steps"][0]["drain"] == "gate[1] model_filter [model_not_registered]"


def test_explain_cli(fleet: tuple[Router, list[Agent]]) -> None:
    router, _ = fleet
    env = {**os.environ, "HIVENET_ROUTER_ADMIN_KEY": ADMIN_KEY}
    argv = [str(VENV_BIN / "hivenet-router"), "explain", "--model", "m1", "--url", router.url]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert 'gate[4] match [tags(missing="gpu")]' in done.stdout
    assert "chosen=" in done.stdout
    gone = subprocess.run(
        [*argv[:3], "nope", *argv[4:]], env=env, capture_output=True, text=True, timeout=30
    )
    assert gone.returncode == 1 and "error=model_not_found" in gone.stdout
    refused = subprocess.run(
        argv, env={**env, "HIVENET_ROUTER_ADMIN_KEY": "wrong"}, capture_output=True, timeout=30
    )
    assert refused.returncode == 2 and b"401" in refused.stderr


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{", "body is not JSON"),
        (b"[]", "body must be a JSON object"),
        (b'{"model": 3}', "`model` must be a non-empty string"),
        (b'{"model": "m1", "headers": {"a": 1}}', "`headers.a` must be a string"),
        (b'{"model": "m1", "messages": "hi"}', "`messages` must be a list"),
        (b'{"model": "m1", "path": "/v1/nope"}', "`path` must be one of"),
        (b'{"model": "m1", "evil": 1}', "unknown fields: evil"),
        (b'{"model": "' + b"x" * 300_000 + b'"}', "explain body exceeds"),
        (b"[" * 100_000, "body is not JSON"),
    ],
)
def test_hostile_explain_bodies(fleet: tuple[Router, list[Agent]], body: bytes, why: str) -> None:
    router, _ = fleet
    r = httpx.post(router.url + "/admin/explain", content=body, headers=ADMIN, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "request_invalid" and why in error["message"], error
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200


def test_admin_key_required(fleet: tuple[Router, list[Agent]]) -> None:
    router, _ = fleet
    for method, path in [
        ("POST", "/admin/explain"),
        ("GET", "/admin/requests"),
        ("GET", "/admin/exclusions"),
        ("POST", "/admin/policy/validate"),
        ("POST", "/admin/keygen"),
        ("GET", "/admin/tenants/usage"),
    ]:
        r = httpx.request(method, router.url + path, json={"model": "m1"}, timeout=5)
        assert r.status_code == 401, (path, r.text)
    r = httpx.get(router.url + "/admin/explain", headers=ADMIN, timeout=5)
    assert r.status_code == 405
    r = httpx.get(router.url + "/admin/requests", params={"limit": "x"}, headers=ADMIN, timeout=5)
    assert r.status_code == 400


def test_policy_validate_shows_the_diff(fleet: tuple[Router, list[Agent]]) -> None:
    router, _ = fleet
    proposed = POLICY.replace("round-robin", "least-loaded")
    r = httpx.post(
        router.url + "/admin/policy/validate", content=proposed, headers=ADMIN, timeout=5
    )
    answer = r.json()
    assert answer["valid"] and answer["chain"] == ["routing_policy", "any"]
    assert "-  strategy: round-robin\n+  strategy: least-loaded\n" in answer["diff"]
    bad = httpx.post(
        router.url + "/admin/policy/validate",
        content="routing_policy: {strategy: fastest}\n",
        headers=ADMIN,
        timeout=5,
    ).json()
    assert not bad["valid"] and any("fastest" in e for e in bad["errors"]), bad
    # Nothing was installed.
    running = httpx.get(router.url + "/admin/policy", headers=ADMIN, timeout=5).text
    assert running == POLICY


def test_page_headers(fleet: tuple[Router, list[Agent]]) -> None:
    router, _ = fleet
    for path in ("/ui", "/ui/", "/ui/console.js", "/ui/console.css"):
        r = httpx.get(router.url + path, timeout=5)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
    assert '<form id="login-form">' in httpx.get(router.url + "/ui", timeout=5).text
    assert "innerHTML" not in httpx.get(router.url + "/ui/console.js", timeout=5).text
    for path in ("/ui/../pyproject.toml", "/ui/nope.js", "/uiindex.html"):
        assert httpx.get(router.url + path, timeout=5).status_code == 404, path
    assert httpx.post(router.url + "/ui", timeout=5).status_code == 405


def test_no_ui(tmp_path: Path) -> None:
    f = Fleet(tmp_path)
    try:
        off = f.router(env={"HIVENET_ROUTER_UI": "off"})
        assert httpx.get(off.url + "/ui", timeout=5).status_code == 404
        r = httpx.get(off.url + "/admin/requests", headers=ADMIN, timeout=5)
        assert r.status_code == 404 and "--no-ui" in r.text
        # Scripts keep explain.
        assert explain(off, model="m1").json()["outcome"] == "exhausted"
    finally:
        f.close()
    bad = subprocess.run(
        [str(VENV_BIN / "hivenet-router"), "serve"],
        env={**f.env, "HIVENET_ROUTER_UI": "maybe"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "HIVENET_ROUTER_UI='maybe'" in bad.stderr
