"""One configuration across routers that share a `--state-url` (issue 21, item 2)."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import openai
import redis

from router.tenants.config import hash_key
from tests.fleet import ADMIN_KEY, Fleet, Router, wait_until
from tests.redis_server import RedisServer

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
POLICY = """
routing_policy:
  match: {{}}
  strategy: least-loaded
fallback_chain:
  - name: {name}
    match: {{}}
    strategy: least-loaded
"""
BROKEN = """
routing_policy:
  strategy: no-such-strategy
"""
AUTH = """
tenants:
  first:
    keys: ["{h}"]
"""


def policy_of(router: Router) -> tuple[str, str]:
    r = httpx.get(router.url + "/admin/policy", headers=ADMIN, timeout=5)
    r.raise_for_status()
    return r.headers["etag"].strip('"'), r.text


def put(router: Router, path: str, text: str) -> httpx.Response:
    return httpx.put(router.url + path, content=text, headers=ADMIN, timeout=5)


def same_policy(routers: list[Router], text: str) -> str:
    """Wait until every router runs `text`; its version, the same on all."""
    wait_until(lambda: all(policy_of(r)[1] == text for r in routers), 5, "policy everywhere")
    versions = {policy_of(r)[0] for r in routers}
    assert len(versions) == 1
    return versions.pop()


def test_a_policy_change_on_one_router_reaches_every_router(fleet: Fleet, tmp_path: Path) -> None:
    server = RedisServer(tmp_path, fleet.env).start()
    fleet.procs.append(server)
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY.format(name="from-file"))
    routers = [
        fleet.router("--state-url", server.url, "--policy-file", str(policy_file)) for _ in range(3)
    ]
    same_policy(routers, POLICY.format(name="from-file"))

    # PUT on one router: validated there, then installed by the others.
    text = POLICY.format(name="put-on-r1")
    answer = put(routers[0], "/admin/policy", text)
    assert answer.status_code == 200, answer.text
    version = same_policy(routers, text)
    assert answer.json()["version"] == version
    for r in routers[1:]:
        r.wait_log(
            rf"policy_reloaded origin=fleet chain=\[routing_policy→put-on-r1\] version={version}"
        )

    # An invalid PUT is refused where it is made and reaches no other router.
    refused = put(routers[1], "/admin/policy", BROKEN)
    assert refused.status_code == 400
    assert {policy_of(r)[0] for r in routers} == {version}

    # A SIGHUP on one router publishes its file.
    policy_file.write_text(POLICY.format(name="after-sighup"))
    routers[2].send_signal(signal.SIGHUP)
    same_policy(routers, POLICY.format(name="after-sighup"))

    # A bad text in the fleet's store (a router of another build wrote it) is refused
    # by every router, each saying why, and none of them changes what it runs.
    running = policy_of(routers[0])[0]
    store = redis.Redis(port=server.port, socket_timeout=2)
    store.hset(
        "hivenet:config:policy", mapping={"version": "0badc0de", "text": BROKEN, "router": "x"}
    )
    store.close()
    for r in routers:
        r.wait_log(r"policy_reload_failed origin=fleet errors=")
        r.wait_log(r"config_rejected kind=policy version=0badc0de")
        assert policy_of(r)[0] == running
    # So is one over the PUT limit, before any parsing.
    store = redis.Redis(port=server.port, socket_timeout=2)
    huge = POLICY.format(name="huge") + "#" * (1024 * 1024)
    store.hset("hivenet:config:policy", mapping={"version": "0b16", "text": huge, "router": "x"})
    store.close()
    for r in routers:
        r.wait_log(r"policy_reload_failed origin=fleet errors=\"policy text in Redis is \d+ bytes")
        assert policy_of(r)[0] == running


def test_an_auth_change_on_one_router_admits_the_new_key_on_every_router(
    fleet: Fleet, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path, fleet.env).start()
    fleet.procs.append(server)
    auth = tmp_path / "auth.yaml"
    auth.write_text(AUTH.format(h=hash_key("key-one")))
    flags = ("--state-url", server.url, "--auth-file", str(auth))
    r1, r2 = fleet.router(*flags), fleet.router(*flags)
    fleet.agent([r1, r2], "m1")

    new = AUTH.format(h=hash_key("key-one")) + f'  second:\n    keys: ["{hash_key("key-two")}"]\n'
    answer = put(r1, "/admin/auth", new)
    assert answer.status_code == 200, answer.text
    version = answer.json()["version"]

    def auth_version(r: Router) -> str:
        return r.admin("/admin/auth")["version"]

    wait_until(lambda: auth_version(r2) == version, 5, "auth on r2")
    client = openai.OpenAI(base_url=r2.url + "/v1", api_key="key-two", max_retries=0)
    reply = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], timeout=30
    )
    assert reply.choices[0].message.content == "Echo: hi"
    client.close()


def test_without_a_state_url_a_change_stays_on_its_router(fleet: Fleet) -> None:
    r1, r2 = fleet.router(), fleet.router()
    before = policy_of(r2)
    assert put(r1, "/admin/policy", POLICY.format(name="only-r1")).status_code == 200
    r1.wait_log(r"policy_reloaded origin=admin_api chain=\[routing_policy→only-r1\]")
    assert policy_of(r2) == before
    assert policy_of(r1)[0] != before[0]
