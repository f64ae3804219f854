"""Keys at run time with real processes (issue 20 item 6): the /admin/api-keys registry,
its restart, the admin calls' audit lines, and credentials rotated without a restart."""

from __future__ import annotations

import hashlib
import json
import re
import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.fleet import ADMIN_KEY, SECRET, Fleet, Proc, Router, wait_until

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
KEY_A, KEY_B = "sk-hivenet-client-a", "sk-hivenet-client-b"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def entry(key: str, **fields: object) -> dict:
    return {"key_hash": digest(key), "owner": "acme", "name": "Acme", "enabled": True, **fields}


def chat(router: Router, key: str) -> str:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hello"}]
    )
    return reply.choices[0].message.content or ""


def refused(router: Router, key: str) -> bool:
    with pytest.raises(openai.AuthenticationError):
        chat(router, key)
    return True


def connected(router: Router) -> set[str]:
    return {a["peer_id"] for a in router.agents() if a["status"]["connected"]}


def keys(router: Router, method: str, path: str = "", **kwargs: object) -> httpx.Response:
    url = router.url + "/admin/api-keys" + path
    return httpx.request(method, url, headers=ADMIN, timeout=10, **kwargs)  # type: ignore[arg-type]


def test_keys_written_at_run_time_authenticate_survive_a_restart_and_are_audited(
    fleet: Fleet, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    router = fleet.router("--audit-log", str(audit), env={"HIVENET_ROUTER_AUTH_MODE": "dynamic"})
    fleet.agent(router, "m1")
    assert keys(router, "GET", "/version").json() == {"version": "", "count": 0}
    assert refused(router, KEY_A)

    put = keys(router, "PUT", "/acme-prod", json={"version": "rev_00000001", **entry(KEY_A)})
    assert put.status_code == 200 and put.json() == {"ok": True}
    assert chat(router, KEY_A)
    listed = keys(router, "GET").json()
    assert listed["count"] == 1 and listed["keys"][0]["id"] == "acme-prod"
    assert listed["keys"][0]["key_hash"] == ""  # never returned
    assert keys(router, "GET", "/acme-prod").json()["key"]["owner"] == "acme"
    missing = keys(router, "GET", "/nope")
    assert missing.status_code == 404 and missing.json() == {"error": "key not found: nope"}

    # An invalid write names every reason, and the running key keeps working.
    bad = {"version": "rev_00000002", "key_hash": KEY_B, "name": "x", "enabled": "yes"}
    answer = keys(router, "PUT", "/second", json=bad)
    assert answer.status_code == 400
    errors = answer.json()["errors"]
    for expected in ("key_hash: must be the key's SHA-256", "enabled: must be true or false"):
        assert any(e.startswith(expected) for e in errors), errors
    assert chat(router, KEY_A)
    stale = keys(router, "PUT", "/acme-prod", json={"version": "rev_00000000", **entry(KEY_A)})
    assert stale.status_code == 409
    assert stale.json() == {"error": "stale version", "current_version": "rev_00000001"}
    huge = keys(router, "PUT", "/big", content=b"{" + b" " * (1024 * 1024) + b"}")
    assert huge.status_code == 400 and "over 1048576 bytes" in huge.json()["error"]

    # Disabled: the key stops at once; deleted: idempotent, and the version is required.
    off = {"version": "rev_00000002", **entry(KEY_A, enabled=False)}
    assert keys(router, "PUT", "/acme-prod", json=off).status_code == 200
    assert refused(router, KEY_A)
    assert keys(router, "DELETE", "/acme-prod").status_code == 400
    for _ in range(2):
        gone = keys(router, "DELETE", "/acme-prod", params={"version": "rev_00000003"})
        assert gone.json() == {"ok": True}

    # A replace validates the whole set before it runs it.
    two = [{"id": "a", **entry(KEY_A)}, {"id": "b", **entry(KEY_B)}]
    done = keys(router, "POST", "/replace", json={"version": "rev_00000004", "keys": two})
    assert done.json() == {"ok": True, "count": 2}
    dup = [two[0], {"id": "c", **entry(KEY_A)}]
    answer = keys(router, "POST", "/replace", json={"version": "rev_00000005", "keys": dup})
    assert answer.status_code == 400
    assert "keys[1].key_hash: is also the hash of key 'a'" in answer.json()["error"]
    assert chat(router, KEY_A) and chat(router, KEY_B)

    # A restart keeps the registry (upstream's is empty after one).
    router.stop()
    Proc.start(router)
    wait_until(lambda: httpx.get(router.url + "/health", timeout=2).status_code == 200)
    assert keys(router, "GET", "/version").json() == {"version": "rev_00000004", "count": 2}
    wait_until(lambda: router.agents(), 20, "agent back")
    assert chat(router, KEY_B)

    # Every admin call has an audit line: which admin key, from where, what, the status.
    httpx.get(router.url + "/admin/api-keys", headers={"Authorization": "Bearer wrong"})

    def admin_lines() -> list[dict]:
        lines = [json.loads(line) for line in audit.read_text().splitlines()]
        return [line for line in lines if line.get("kind") == "admin"]

    # A call's audit line is written once its answer is sent: it may lag the answer.
    wait_until(lambda: admin_lines()[-1]["status"] == 401, 10, "the refused call's line")
    admin = admin_lines()
    key_id = "admin-" + digest(ADMIN_KEY)[:8]
    assert {
        "key_id": key_id,
        "source_ip": "127.0.0.1",
        "action": "PUT",
        "target": "/admin/api-keys/second",
        "status": 400,
    }.items() <= next(a for a in admin if a["action"] == "PUT" and a["status"] == 400).items()
    assert admin[-1]["key_id"] == "" and admin[-1]["status"] == 401
    assert ADMIN_KEY not in audit.read_text()


def test_admin_keys_and_agent_secrets_rotate_without_a_restart(
    fleet: Fleet, tmp_path: Path
) -> None:
    current, previous = tmp_path / "jwt.secret", tmp_path / "jwt.previous"
    current.write_text(SECRET)
    previous.write_text("")
    admin_file = tmp_path / "admin.keys"
    admin_file.write_text(f"{ADMIN_KEY}\n")
    router = fleet.router(
        "--jwt-secret-file",
        str(current),
        "--jwt-secret-previous-file",
        str(previous),
        env={
            "HIVENET_ROUTER_ADMIN_API_KEYS": "",
            "HIVENET_ROUTER_ADMIN_API_KEYS_FILE": str(admin_file),
            "HIVENET_ROUTER_JWT_SECRET": "",
        },
    )
    # Not in dynamic mode: the registry answers as upstream's does.
    answer = keys(router, "GET")
    assert answer.status_code == 501
    assert answer.json()["error"] == "dynamic key registry not active"  # upstream's
    assert "api.mode: dynamic" in answer.json()["hint"]
    old_agent = fleet.agent(router, "m1", wait=False)
    moving = fleet.agent(router, "m1", wait=False)
    fleet.join(old_agent, moving)

    # Step 1: the new secret becomes current, the old one previous; nobody is cut off.
    new_secret = "new-secret-" + "n" * 40
    current.write_text(new_secret)
    previous.write_text(SECRET)
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"credentials_reloaded admin_keys=1 jwt_secrets=2 sessions_retired=0")
    assert connected(router) == {old_agent.peer_id, moving.peer_id}

    # Step 2: agents move one at a time; a late one on the old secret still joins.
    moving.stop()
    rekeyed = fleet.agent(router, "m1", env={"HIVENET_ROUTER_JWT_SECRET": new_secret})
    late = fleet.agent(router, "m1")

    # Step 3: the old secret retires; its sessions end and cannot come back.
    previous.write_text("")
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"credentials_reloaded admin_keys=1 jwt_secrets=1 sessions_retired=2")
    for agent in (old_agent, late):
        agent.wait_log(r"router_refused .*bad token signature \(check the shared JWT secret\)")
    # Ended sessions stay in the table, disconnected, until --remove-after.
    wait_until(lambda: connected(router) == {rekeyed.peer_id}, what="old sessions gone")
    rekeyed_log = rekeyed.log()
    assert "router_refused" not in rekeyed_log

    # Admin keys: the new one works and the old one is refused right after the reload.
    admin_file.write_text("# rotated\nnew-admin-key, second-admin-key\n")
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"credentials_reloaded admin_keys=2")
    health = router.url + "/admin/health"
    assert httpx.get(health, headers=ADMIN).status_code == 401
    assert httpx.get(health, headers={"Authorization": "Bearer new-admin-key"}).status_code == 200
    # A file that cannot be read keeps every running credential.
    admin_file.unlink()
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"credentials_reload_failed reason=")
    assert httpx.get(health, headers={"Authorization": "Bearer new-admin-key"}).status_code == 200
    assert re.search(r"sessions_retired=2", router.log())
