"""Upstream's cross-config check (issue 20): a serverless key's input tokens per minute
must hold the max_input_tokens of every serverless model it can reach. Checked at
start-up, on SIGHUP, and on every admin write of either side; a change that breaks it
is refused and the running configuration stays."""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import httpx

from router.admission.crosscheck import below_serverless_cap
from router.metrics import RouterMetrics
from router.policy.store import PolicyStore
from router.tenants.config import load_auth
from tests.fleet import ADMIN_KEY, Fleet, Proc

KEY = "sk-hivenet-" + "k" * 64
HASH = hashlib.sha256(KEY.encode()).hexdigest()
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def auth(quota: str, extra: str = "") -> str:
    return (
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{HASH}"\n      metadata: {{name: k, owner: acme}}\n'
        f"      quota: {quota}\n{extra}admin:\n  mode: api-key\n"
    )


def policy(cap: int, mode: str = "serverless") -> str:
    return f"mode: {mode}\nmax_input_tokens: {cap}\nrouting_policy:\n  strategy: least-loaded\n"


def test_each_reachable_serverless_cap_is_checked_with_the_limits_that_apply() -> None:
    per_model = (
        "{per_model: {big: {requests_per_minute_per_replica: 0,"
        " tokens_per_day: 0, input_tokens_per_minute: 100}, small: "
        "{requests_per_minute_per_replica: 0, tokens_per_day: 0}}}"
    )
    config = load_auth(auth(per_model))
    # The global policy's cap: the per_model entry of `big` is below it, `small`'s
    # (no rate of its own) is not.
    assert below_serverless_cap(config, [(None, "serverless", 1000)]) == [
        "key-" + HASH[:12] + ".quota.per_model.big.input_tokens_per_minute: 100 is below"
        " max_input_tokens 1000 of serverless model 'big' (a request at that cap could"
        " never pass)"
    ]
    # A reserved model is no one's concern, unless the key itself is serverless.
    assert below_serverless_cap(config, [(None, "reserved", 1000)]) == []
    serverless_key = load_auth(auth("{input_tokens_per_minute: 500}", "      mode: serverless\n"))
    errors = below_serverless_cap(serverless_key, [(None, "reserved", 0), ("m", "reserved", 800)])
    assert len(errors) == 1 and "of serverless model 'm'" in errors[0]
    # A model the key may not use is not held against it.
    narrow = load_auth(auth("{input_tokens_per_minute: 500}", "      models: [m]\n"))
    assert below_serverless_cap(narrow, [(None, "reserved", 0), ("o", "serverless", 800)]) == []


def test_the_check_at_start_up_on_admin_writes_and_on_sighup(fleet: Fleet, tmp_path: Path) -> None:
    auth_file, policy_file = tmp_path / "auth.yaml", tmp_path / "policy.yaml"
    auth_file.write_text(auth("{input_tokens_per_minute: 500}"))
    policy_file.write_text(policy(1000))
    flags = ("--auth-config-file", str(auth_file), "--policy-file", str(policy_file))
    refused = fleet.router(*flags, start=False)
    Proc.start(refused)
    assert refused.popen is not None and refused.popen.wait(60) == 2
    assert "input_tokens_per_minute: 500 is below max_input_tokens 1000" in refused.log()

    policy_file.write_text(policy(400))
    router = fleet.router(*flags)
    running_policy = httpx.get(router.url + "/admin/policy", headers=ADMIN, timeout=10).text

    def put(path: str, body: str) -> httpx.Response:
        return httpx.put(router.url + path, content=body.encode(), headers=ADMIN, timeout=10)

    for path, body in (
        ("/admin/policy", policy(1000)),
        ("/admin/policy/models/big", "models: [big]\n" + policy(2000)),
        ("/admin/auth", auth("{input_tokens_per_minute: 300}")),
    ):
        answer = put(path, body)
        assert answer.status_code == 400, (path, answer.text)
        error = answer.json()
        if path == "/admin/policy":  # upstream's flat `{"error": "<message>"}`
            error = {"code": "request_invalid", "message": error["error"], **error}
        else:
            error = error["error"]
        assert (
            error["code"] == "request_invalid" and "is below max_input_tokens" in error["message"]
        )
        assert any("could never pass" in e for e in error["errors"])
    assert httpx.get(router.url + "/admin/policy", headers=ADMIN, timeout=10).text == running_policy
    # A valid write of either side still goes in.
    assert put("/admin/policy/models/big", "models: [big]\n" + policy(500)).status_code == 200

    policy_file.write_text(policy(1000))
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"policy_reload_failed origin=file errors=.*is below max_input_tokens 1000")
    auth_file.write_text(auth("{input_tokens_per_minute: 300}"))
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"auth_reload_failed origin=file errors=.*is below max_input_tokens 400")
    assert httpx.get(router.url + "/admin/policy", headers=ADMIN, timeout=10).text == running_policy


def test_a_named_policy_whose_removal_would_break_a_key_stays() -> None:
    config = load_auth(auth("{input_tokens_per_minute: 500}", "      models: [big]\n"))
    store = PolicyStore(RouterMetrics())
    store.cross_check = lambda caps: below_serverless_cap(config, caps)
    # The key reaches only `big`: once `big` has a policy of its own, the global
    # policy's cap is not the key's concern...
    assert store.replace(policy(1000), "test")
    assert store.put_named("big", "models: [big]\n" + policy(400), "test") == []
    assert store.replace(policy(1000), "test") == []
    # ...until `big` would follow it.
    errors = store.delete_named("big", "test")
    assert errors and "of serverless global policy" in errors[0]
    assert "big" in store.models.named
    assert store.put_named("big", "models: [big]\n" + policy(2000), "test")
    assert store.models.named["big"].policy.admission.max_input_tokens == 400
