"""The /admin/api-keys registry's validation, versions and saving (no processes; the
end-to-end checks are in tests/test_api_keys_e2e.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import trio

from protocol.tokens import TokenError, issue_token, verify_with
from router.documents import MAX_ERRORS
from router.metrics import RouterMetrics
from router.settings import RouterSettings
from router.tenants.registry import (
    KeyRegistry,
    RegistryError,
    RegistryFile,
    StaleVersion,
    parse_registry,
    rfc3339,
)

KEY = "sk-hivenet-client-one"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()


def entry(key_id: str = "acme-prod", **fields: object) -> dict:
    base: dict = {
        "id": key_id,
        "key_hash": DIGEST,
        "owner": "acme",
        "name": "Acme production",
        "enabled": True,
    }
    return {**base, **fields}


def document(*entries: dict, version: str = "rev_00000001") -> str:
    return json.dumps({"version": version, "keys": list(entries)})


def errors_of(text: str) -> list[str]:
    with pytest.raises(RegistryError) as failed:
        parse_registry(text)
    return failed.value.errors


def test_a_valid_entry_is_a_tenant_keyed_by_its_hash() -> None:
    registry = parse_registry(document(entry(key_hash=DIGEST.upper(), quota={"tokens_per_day": 9})))
    tenant = registry.config.tenant_for_key(KEY)
    assert tenant is not None and tenant.name == "acme" and tenant.tokens_per_day == 9
    # Hashes are normalized to lowercase, and never shown.
    assert registry.entries["acme-prod"]["key_hash"] == DIGEST
    assert registry.public("acme-prod")["key_hash"] == ""


def test_every_problem_of_an_entry_is_named_at_once() -> None:
    bad = {
        "id": "no spaces",
        "key_hash": "sk-hivenet-in-clear",
        "owner": "",
        "enabled": "yes",
        "expires_at": "01-01-2027",
        "allowed_models": "m1",
        "colour": "blue",
    }
    errors = errors_of(document(bad))
    for expected in (
        "keys[0].colour: unknown key field",
        "keys[0].id: must be 1-128 letters",
        "keys[0].key_hash: must be the key's SHA-256, exactly 64 hex digits",
        "got a key in clear",
        "keys[0].enabled: must be true or false",
        "keys[0].expires_at: must be an RFC 3339 time",
        "keys[0].allowed_models: must be a list",
    ):
        assert any(expected in e for e in errors), (expected, errors)


def test_the_auth_file_checks_apply_with_the_registry_field_names() -> None:
    mixed = {"requests_per_minute": 5, "per_model": {"m": {"tokens_per_day": 1}}}
    errors = errors_of(document(entry(owner="", quota=mixed, allowed_models=[""])))
    for expected in (
        "keys[0].owner: must not be empty",
        "keys[0].quota.per_model: cannot be combined with the flat",
        "keys[0].quota.per_model.m.requests_per_minute_per_replica: missing",
        "keys[0].allowed_models[0]: must be a non-empty string",
    ):
        assert any(expected in e for e in errors), (expected, errors)


def test_one_hash_one_id_and_one_set_of_limits_per_owner() -> None:
    other = hashlib.sha256(b"another").hexdigest()
    errors = errors_of(
        document(
            entry("a"),
            entry("b"),
            entry("c", key_hash=other, quota={"requests_per_minute": 1}),
            entry("a", key_hash=hashlib.sha256(b"third").hexdigest()),
        )
    )
    assert any("keys[1].key_hash: is also the hash of key 'a'" in e for e in errors), errors
    assert any("keys[2]: owner 'acme' is also key 'a' with another quota" in e for e in errors), (
        errors
    )
    assert any("keys[3].id: 'a' is listed twice" in e for e in errors), errors


def test_keys_of_one_owner_each_keep_their_own_allowed_models() -> None:
    other = "sk-hivenet-client-two"
    registry = parse_registry(
        document(
            entry("a", allowed_models=["m1"], quota={"requests_per_minute": 5}),
            entry(
                "b",
                key_hash=hashlib.sha256(other.encode()).hexdigest(),
                allowed_models=["m2"],
                quota={"requests_per_minute": 5},
            ),
        )
    )
    first, second = registry.config.tenant_for_key(KEY), registry.config.tenant_for_key(other)
    assert first is not None and second is not None
    assert first.allows_model("m1") and not first.allows_model("m2")
    assert second.allows_model("m2") and not second.allows_model("m1")
    # One owner, one bucket: the same tenant name and limits for both.
    assert first.name == second.name == "acme" and first.requests_per_minute == 5
    assert len(registry.config.tenants["acme"].key_hashes) == 2


def test_flat_token_rates_beside_per_model_are_refused() -> None:
    quota = {
        "input_tokens_per_minute": 500,
        "per_model": {"m": {"requests_per_minute_per_replica": 1, "tokens_per_day": 0}},
    }
    errors = errors_of(document(entry(quota=quota)))
    assert any(
        e.startswith("keys[0].quota.input_tokens_per_minute: cannot be combined with")
        and "per_model" in e
        for e in errors
    ), errors


def test_disabled_and_expired_keys_do_not_authenticate() -> None:
    registry = parse_registry(
        document(
            entry("off", enabled=False),
            entry(
                "old", key_hash=hashlib.sha256(b"k2").hexdigest(), expires_at="2020-01-01T00:00:00Z"
            ),
        )
    )
    assert registry.config.tenant_for_key(KEY) is None
    assert registry.config.tenant_for_key("k2") is None and registry.config.expired("k2")


def test_rfc3339_offsets_and_impossible_dates() -> None:
    assert rfc3339("2027-01-01T00:00:00Z") == 1798761600.0
    assert rfc3339("2027-01-01T01:00:00+01:00") == 1798761600.0
    assert rfc3339("2027-02-30T00:00:00Z") is None
    assert rfc3339("2027-01-01") is None


def registry_in(tmp_path: Path) -> KeyRegistry:
    return KeyRegistry(RouterMetrics(), RegistryFile(str(tmp_path / "state.sqlite3")))


def test_versions_sort_as_strings_and_a_lower_one_is_stale(tmp_path: Path) -> None:
    registry = registry_in(tmp_path)

    async def main() -> None:
        text = registry.with_entry("acme-prod", {"version": "rev_00000002", **entry()})
        assert await registry.write(text, "test") == []
        # Equal is accepted (a replay); lower is stale and names the running version.
        registry.with_entry("acme-prod", {"version": "rev_00000002", **entry()})
        with pytest.raises(StaleVersion) as stale:
            registry.without_entry("acme-prod", "rev_00000001")
        assert stale.value.current == "rev_00000002"
        with pytest.raises(RegistryError):
            registry.with_entry("acme-prod", entry())  # no version

    trio.run(main)


def test_a_bad_write_keeps_the_running_set_and_a_good_one_is_saved(tmp_path: Path) -> None:
    registry = registry_in(tmp_path)

    async def main() -> None:
        text = registry.with_entry("acme-prod", {"version": "v1", **entry()})
        assert await registry.write(text, "test") == []
        bad = registry.with_entry("second", {"version": "v2", **entry(enabled=None)})
        assert await registry.write(bad, "test") != []
        assert set(registry.current.entries) == {"acme-prod"}

    trio.run(main)
    # A restart reads the registry back from the router's state file.
    again = registry_in(tmp_path)
    assert again.current.version == "v1" and set(again.current.entries) == {"acme-prod"}
    assert again.current.config.tenant_for_key(KEY) is not None


def test_a_fleet_copy_with_a_lower_version_is_superseded(tmp_path: Path) -> None:
    registry = registry_in(tmp_path)
    trio.run(registry.write, json.loads(document(entry(), version="rev_5")), "test")
    assert registry.supersedes(document(version="rev_4"))
    assert not registry.supersedes(document(version="rev_6"))
    assert not registry.supersedes("not json")


def test_either_secret_of_a_rotation_verifies_and_names_itself() -> None:
    current, previous = b"c" * 32, b"p" * 32
    for secret in (current, previous):
        token = issue_token(secret, "peer", 60)
        assert verify_with((current, previous), token, "peer") == secret
    retired = issue_token(b"r" * 32, "peer", 60)
    with pytest.raises(TokenError, match="bad token signature"):
        verify_with((current, previous), retired, "peer")
    # Only a bad signature tries the next secret: an expired token is refused as such.
    expired = issue_token(previous, "peer", 60, now=1000.0)
    with pytest.raises(TokenError, match="token expired"):
        verify_with((current, previous), expired, "peer")


def test_a_registry_key_is_admitted_under_its_own_id_with_its_own_limits() -> None:
    quota = {"requests_per_minute": 5, "input_tokens_per_minute": 4096}
    registry = parse_registry(document(entry(quota=quota, max_occupancy_share=0.25)))
    record = registry.config.key_for(KEY)
    assert record is not None and record.id == "acme-prod" and record.tenant == "acme"
    assert record.limits.max_occupancy_share == 0.25
    assert record.limits.input_tokens_per_minute == 4096
    assert registry.public("acme-prod")["max_occupancy_share"] == 0.25
    errors = errors_of(document(entry(max_occupancy_share=2)))
    assert any(e.startswith("keys[0].max_occupancy_share: must be a number") for e in errors)


def test_a_key_whose_input_rate_is_below_a_serverless_cap_is_refused(tmp_path: Path) -> None:
    registry = registry_in(tmp_path)
    registry.policies = lambda: [(None, "reserved", 0), ("big", "serverless", 8192)]
    slow = entry(quota={"input_tokens_per_minute": 4096})

    async def main() -> None:
        errors = await registry.write(json.loads(document(slow)), "test")
        assert errors == [
            "acme-prod.quota.input_tokens_per_minute: 4096 is below max_input_tokens 8192"
            " of serverless model 'big' (a request at that cap could never pass)"
        ]
        # A key that cannot reach the model is not held to its cap.
        narrow = {**slow, "allowed_models": ["small"]}
        assert await registry.write(json.loads(document(narrow)), "test") == []

    trio.run(main)


def test_admin_keys_come_from_the_variable_and_the_file(tmp_path: Path) -> None:
    keys = tmp_path / "admin.keys"
    keys.write_text("# operators\nfile-one, file-two\n\nfile-three  # the CI\n")
    settings = RouterSettings()
    env = {
        "HIVENET_ROUTER_ADMIN_API_KEYS": "env-one",
        "HIVENET_ROUTER_ADMIN_API_KEYS_FILE": str(keys),
    }
    settings.apply_environment(env)
    assert settings.admin_api_keys == ["env-one", "file-one", "file-two", "file-three"]
    # SIGHUP re-reads the file only; the variable's keys stay.
    assert settings.admin_api_keys_env == ["env-one"]
    with pytest.raises(ValueError, match="HIVENET_ROUTER_ADMIN_API_KEYS_FILE="):
        RouterSettings().apply_environment(
            {"HIVENET_ROUTER_ADMIN_API_KEYS_FILE": str(tmp_path / "missing")}
        )


def test_hostile_numbers_are_refused_not_a_crash(tmp_path: Path) -> None:
    registry = registry_in(tmp_path)

    async def main() -> None:
        huge = registry.with_entry("k", {"version": "v1", **entry(quota={"tokens_per_day": 2**70})})
        assert "must be between 0 and 1000000000000" in (await registry.write(huge, "test"))[0]
        inf = registry.with_entry("k", {"version": "v1", **entry(quota={"tokens_per_day": 1e400})})
        assert "must be an integer" in (await registry.write(inf, "test"))[0]
        assert registry.current.entries == {}

    trio.run(main)


def test_a_replace_lists_at_most_a_hundred_errors_and_names_a_bad_ids_type(
    tmp_path: Path,
) -> None:
    registry = registry_in(tmp_path)
    keys = [entry("same") for _ in range(300)]
    with pytest.raises(RegistryError) as refused:
        registry.replaced_by({"version": "v1", "keys": keys})
    errors = refused.value.errors
    assert len(errors) == MAX_ERRORS + 1 and "not listed" in errors[-1]
    assert errors[0] == "keys[1].id: 'same' is listed twice"
    with pytest.raises(RegistryError) as refused:
        registry.replaced_by({"version": "v1", "keys": [entry(key_id=[1])]})  # type: ignore[arg-type]
    assert refused.value.errors == ["keys[0].id: a string is required in a replace, got a list"]
