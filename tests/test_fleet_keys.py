"""Keys and per-model policies written on one router reach every router sharing a
`--state-url` (issue 20 item 7, issue 21 item 2), each router validating them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import openai

from tests.fleet import ADMIN_KEY, Fleet, Router, wait_until
from tests.redis_server import RedisServer

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
KEY = "sk-hivenet-fleet-client"
OTHER = "sk-hivenet-fleet-other"
NAMED = "models: [m1]\nrouting_policy:\n  strategy: least-loaded\n"


def entry(key: str, owner: str = "acme") -> dict:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return {"key_hash": digest, "owner": owner, "name": owner, "enabled": True}


def served(router: Router, key: str) -> bool:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
    try:
        client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    except openai.AuthenticationError:
        return False
    return True


def version(router: Router) -> dict:
    return router.admin("/admin/api-keys/version")


def named(router: Router) -> tuple[str, dict]:
    r = httpx.get(router.url + "/admin/policy/models", headers=ADMIN, timeout=5)
    return r.headers["etag"], r.json()


def test_keys_and_named_policies_written_on_one_router_reach_the_other(
    fleet: Fleet, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path, fleet.env).start()
    fleet.procs.append(server)
    dynamic = {"HIVENET_ROUTER_AUTH_MODE": "dynamic"}
    a, b = (fleet.router("--state-url", server.url, env=dynamic) for _ in range(2))
    fleet.agent([a, b], "m1")

    # A key PUT on one router serves on the other, which checked it itself.
    url = a.url + "/admin/api-keys/acme"
    put = httpx.put(url, json={"version": "rev_01", **entry(KEY)}, headers=ADMIN, timeout=5)
    assert put.status_code == 200, put.text
    wait_until(lambda: served(b, KEY), 5, "key on the other router")
    assert version(a) == version(b) == {"version": "rev_01", "count": 1}
    b.wait_log(r"api_keys_reloaded origin=fleet keys=1 registry_version=rev_01")

    # A DELETE on the other router revokes it on the first.
    url = b.url + "/admin/api-keys/acme?version=rev_02"
    assert httpx.delete(url, headers=ADMIN, timeout=5).status_code == 200
    wait_until(lambda: not served(a, KEY), 5, "key revoked everywhere")

    # Writes on both routers at once: the higher registry version wins on both (with
    # x too when the second router had it before its own write, as the poll decides).
    first = {"version": "rev_03", **entry(OTHER, "first")}
    second = {"version": "rev_04", **entry(KEY, "second")}
    httpx.put(a.url + "/admin/api-keys/x", json=first, headers=ADMIN, timeout=5)
    httpx.put(b.url + "/admin/api-keys/y", json=second, headers=ADMIN, timeout=5)
    wait_until(lambda: version(a) == version(b), 5, "converged")
    assert version(a)["version"] == "rev_04"
    assert served(a, KEY) and served(b, KEY)

    # A per-model policy document: PUT on one router, then DELETE on the other.
    put = httpx.put(a.url + "/admin/policy/models/one", content=NAMED, headers=ADMIN, timeout=5)
    assert put.status_code == 200, put.text
    wait_until(lambda: "one" in named(b)[1], 5, "named policy on the other router")
    assert named(a)[0] == named(b)[0]
    b.wait_log(r"policy_reloaded origin=fleet name=one models=m1")
    # An invalid document is refused where it is written and reaches nobody.
    bad = httpx.put(b.url + "/admin/policy/models/two", content="models: [m2]\n", headers=ADMIN)
    assert bad.status_code == 400
    gone = httpx.delete(b.url + "/admin/policy/models/one", headers=ADMIN, timeout=5)
    assert gone.status_code == 200
    wait_until(lambda: named(a)[1] == {}, 5, "named policy deleted everywhere")
    a.wait_log(r"policy_removed origin=fleet name=one")
    assert named(a)[0] == named(b)[0]
    assert a.admin("/admin/policy/models") == b.admin("/admin/policy/models") == {}

    # A router that starts later adopts the fleet's keys, and the tombstone removes the
    # deleted policy it brought in its own directory.
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "one.yaml").write_text(NAMED)
    c = fleet.router("--state-url", server.url, "--policy-model-dir", str(policies), env=dynamic)
    wait_until(lambda: version(c) == version(a), 5, "registry adopted")
    wait_until(lambda: named(c)[1] == {}, 5, "tombstone applied")
    c.wait_log(r"policy_removed origin=fleet name=one")
