"""Keys as upstream's operators write and send them (issue 47 items 1, 2 and 4): flat
per-minute token rates beside `quota.per_model` refused everywhere a key set is read,
each key of an owner with its own model allowlist, and `Authorization: <raw key>`
without `Bearer` for clients and admins."""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import httpx
import pytest

from router.cli import main
from tests.fleet import ADMIN_KEY, Fleet, Proc, Router

KEY_A = "sk-hivenet-" + "a" * 44
KEY_B = "sk-hivenet-" + "b" * 44
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PER_MODEL = "        per_model: {m1: {requests_per_minute_per_replica: 0, tokens_per_day: 0}}\n"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def upstream_file(*entries: str) -> str:
    return "api:\n  mode: api-key\n  keys:\n" + "".join(entries) + "admin:\n  mode: api-key\n"


def key_entry(key: str, extra: str = "") -> str:
    return (
        f'    - key_hash: "{digest(key)}"\n'
        '      metadata: {name: "k", owner: "acme"}\n'
        "      quota:\n        requests_per_minute: 100\n" + extra
    )


# Two keys of one owner, one of them limited to m1 (item 2).
TWO_KEYS = upstream_file(key_entry(KEY_A, "      models: [m1]\n"), key_entry(KEY_B))
# A flat output rate beside per_model (item 1).
MIXED = upstream_file(
    f'    - key_hash: "{digest(KEY_A)}"\n'
    '      metadata: {name: "k", owner: "acme"}\n'
    "      quota:\n        output_tokens_per_minute: 500\n" + PER_MODEL
)


def chat(router: Router, model: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_check_auth_refuses_flat_rates_beside_per_model_and_takes_per_key_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "auth.yaml"
    path.write_text(MIXED)
    assert main(["check-auth", str(path)]) == 1
    printed = capsys.readouterr().err
    assert "api.keys[0].quota.output_tokens_per_minute: cannot be combined with" in printed
    assert "quota.per_model" in printed
    path.write_text(TWO_KEYS)
    assert main(["check-auth", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "tenant acme: models=per key keys=2" in printed
    assert f"key sha256:{digest(KEY_A)[:12]}…: models=m1" in printed
    assert f"key sha256:{digest(KEY_B)[:12]}…: models=*" in printed


def test_static_keys_of_one_owner_keep_their_own_models_and_a_mixed_file_is_refused(
    fleet: Fleet, tmp_path: Path
) -> None:
    auth = tmp_path / "auth.yaml"
    auth.write_text(MIXED)
    refused = fleet.router("--auth-config-file", str(auth), start=False)
    Proc.start(refused)
    assert refused.popen is not None and refused.popen.wait(60) == 2
    assert "output_tokens_per_minute: cannot be combined with quota.per_model" in refused.log()

    auth.write_text(TWO_KEYS)
    router = fleet.router("--auth-config-file", str(auth))
    fleet.join(
        fleet.agent(router, "m1", wait=False),
        fleet.agent(router, "m2", wait=False),
    )
    assert chat(router, "m1", bearer(KEY_A)).status_code == 200
    forbidden = chat(router, "m2", bearer(KEY_A))
    assert forbidden.status_code == 403, forbidden.text
    assert forbidden.json()["error"]["code"] == "model_forbidden"
    assert chat(router, "m2", bearer(KEY_B)).status_code == 200
    # Each key's /v1/models shows its own list.
    listed = httpx.get(router.url + "/v1/models", headers=bearer(KEY_A), timeout=10).json()
    assert [card["id"] for card in listed["data"]] == ["m1"]
    listed = httpx.get(router.url + "/v1/models", headers=bearer(KEY_B), timeout=10).json()
    assert sorted(card["id"] for card in listed["data"]) == ["m1", "m2"]

    # Item 4: the raw key without `Bearer`, for a client and for the admin API.
    assert chat(router, "m1", {"Authorization": KEY_A}).status_code == 200
    assert chat(router, "m1", {"Authorization": "Basic " + KEY_A}).status_code == 401
    raw_admin = httpx.get(
        router.url + "/admin/health", headers={"Authorization": ADMIN_KEY}, timeout=10
    )
    assert raw_admin.status_code == 200, raw_admin.text
    wrong = httpx.get(router.url + "/admin/health", headers={"Authorization": "nope"}, timeout=10)
    assert wrong.status_code == 401

    # A reload to the mixed file is refused, naming per_model; the running keys stay.
    auth.write_text(MIXED)
    router.send_signal(signal.SIGHUP)
    router.wait_log(
        r"auth_reload_failed origin=file errors=.*cannot be combined with quota.per_model"
    )
    assert chat(router, "m2", bearer(KEY_B)).status_code == 200


def test_dynamic_keys_of_one_owner_keep_their_own_allowed_models(fleet: Fleet) -> None:
    router = fleet.router(env={"HIVENET_ROUTER_AUTH_MODE": "dynamic"})
    fleet.join(
        fleet.agent(router, "m1", wait=False),
        fleet.agent(router, "m2", wait=False),
    )

    def put(key_id: str, version: str, **fields: object) -> httpx.Response:
        body = {
            "version": version,
            "key_hash": digest(fields.pop("key")),  # type: ignore[arg-type]
            "owner": "acme",
            "name": key_id,
            "enabled": True,
            **fields,
        }
        url = router.url + "/admin/api-keys/" + key_id
        return httpx.put(url, json=body, headers=ADMIN, timeout=10)

    first = put("a", "rev_1", key=KEY_A, allowed_models=["m1"])
    assert first.status_code == 200, first.text
    second = put("b", "rev_2", key=KEY_B, allowed_models=["m2"])
    assert second.status_code == 200, second.text
    assert chat(router, "m1", bearer(KEY_A)).status_code == 200
    assert chat(router, "m2", bearer(KEY_A)).status_code == 403
    assert chat(router, "m2", bearer(KEY_B)).status_code == 200
    assert chat(router, "m1", bearer(KEY_B)).status_code == 403

    # Item 1 on a dynamic write: refused, naming per_model; the running key stays.
    quota = {
        "output_tokens_per_minute": 500,
        "per_model": {"m1": {"requests_per_minute_per_replica": 0, "tokens_per_day": 0}},
    }
    mixed = put("a", "rev_3", key=KEY_A, quota=quota)
    assert mixed.status_code == 400, mixed.text
    assert (
        "quota.output_tokens_per_minute: cannot be combined with quota.per_model"
        in (mixed.json()["error"])
    )
    assert chat(router, "m1", bearer(KEY_A)).status_code == 200
