"""The Go router's auth.yaml shape, loaded into this router's tenants (issue 19)."""

from __future__ import annotations

import hashlib

import pytest

from router.tenants.config import AuthError, load_auth
from router.tenants.counters import LocalCounters
from router.tenants.upstream_auth import BASE58_ALPHABET, base58, end_of_day, keygen_entry

KEY = "sk-hivenet-" + "1" * 64
HEX = hashlib.sha256(KEY.encode()).hexdigest()
OTHER = "sk-hivenet-" + "2" * 64
OTHER_HEX = hashlib.sha256(OTHER.encode()).hexdigest()


def entry(digest: str = HEX, owner: str = "acme", extra: str = "") -> str:
    return f'    - key_hash: "{digest}"\n      metadata: {{name: "k", owner: "{owner}"}}\n{extra}'


def doc(*entries: str, admin: str = "api-key") -> str:
    return "api:\n  mode: api-key\n  keys:\n" + "".join(entries) + f"admin:\n  mode: {admin}\n"


def errors_of(text: str) -> list[str]:
    with pytest.raises(AuthError) as failed:
        load_auth(text)
    return failed.value.errors


def test_keys_of_one_owner_are_one_tenant() -> None:
    quota = "      quota: {requests_per_minute: 10, tokens_per_day: 1000}\n"
    config = load_auth(doc(entry(extra=quota), entry(OTHER_HEX, extra=quota)))
    tenant = config.tenants["acme"]
    assert len(tenant.key_hashes) == 2 and tenant.requests_per_minute == 10
    assert config.tenant_for_key(KEY) is config.tenant_for_key(OTHER) is tenant
    assert config.admin_mode == "api-key" and not config.api_open


def test_keys_of_one_owner_may_list_other_models() -> None:
    quota = "      quota: {requests_per_minute: 10}\n"
    config = load_auth(
        doc(entry(extra=quota + "      models: [m1]\n"), entry(OTHER_HEX, extra=quota))
    )
    limited, open_key = config.tenant_for_key(KEY), config.tenant_for_key(OTHER)
    assert limited is not None and open_key is not None
    assert limited.allows_model("m1") and not limited.allows_model("m2")
    assert open_key.allows_model("m2")
    # Still one tenant, one bucket.
    assert limited.name == open_key.name == "acme" and open_key.requests_per_minute == 10
    assert len(config.tenants["acme"].key_hashes) == 2


def test_api_mode_none_opens_the_client_api() -> None:
    config = load_auth("api:\n  mode: none\nadmin:\n  mode: api-key\n")
    assert config.api_open and config.tenants == {}


def test_expires_at_is_the_last_valid_day_utc() -> None:
    text = doc(entry().replace('owner: "acme"', 'owner: "acme", expires_at: "01-01-2027"'))
    config = load_auth(text)
    last = end_of_day("01-01-2027")
    assert last is not None
    assert config.tenant_for_key(KEY, now=last - 1) is not None
    assert config.tenant_for_key(KEY, now=last) is None
    assert config.expired(KEY, now=last) and not config.expired(KEY, now=last - 1)


def test_per_model_quotas_are_the_allowlist_and_scale_with_replicas() -> None:
    per_model = (
        "      quota:\n        per_model:\n"
        "          big: {requests_per_minute_per_replica: 10, tokens_per_day: 100}\n"
        "          small: {requests_per_minute_per_replica: 0, tokens_per_day: 0}\n"
    )
    tenant = load_auth(doc(entry(extra=per_model))).tenants["acme"]
    assert tenant.allows_model("big") and tenant.allows_model("small")
    assert not tenant.allows_model("other")
    big = tenant.for_model("big", replicas=3)
    assert big.name == "acme/big" and big.requests_per_minute == 30 and big.tokens_per_day == 100
    assert not tenant.for_model("small", replicas=3).limited
    # Each model its own counts: using up one leaves the other untouched.
    counters = LocalCounters(monotonic=lambda: 0.0, wall=lambda: 0.0)
    for i in range(30):
        assert counters.admit(big, f"t{i}").code is None
    assert counters.admit(big, "t31").code is not None
    other = tenant.for_model("big", replicas=1)
    assert other.requests_per_minute == 10
    # No healthy replica: the rate check is skipped, the daily budget still holds.
    none = tenant.for_model("big", replicas=0)
    assert none.requests_per_minute == 0 and none.tokens_per_day == 100 and none.limited


def test_remaining_counts_after_an_admitted_request() -> None:
    quota = "      quota: {requests_per_minute: 3, tokens_per_day: 50}\n"
    tenant = load_auth(doc(entry(extra=quota))).tenants["acme"]
    counters = LocalCounters(monotonic=lambda: 0.0, wall=lambda: 0.0)
    verdict = counters.admit(tenant, "t1")
    assert (verdict.requests_left, verdict.tokens_left) == (2, 50)
    counters.release("acme", "t1", 20, verdict.day)
    assert counters.admit(tenant, "t2").tokens_left == 30


def test_burst_seconds_shrink_the_bucket() -> None:
    quota = "      quota: {requests_per_minute: 120}\n"
    assert load_auth(doc(entry(extra=quota)), burst_seconds=10).tenants["acme"].burst == 20
    assert load_auth(doc(entry(extra=quota))).tenants["acme"].burst == 120


def test_the_example_placeholder_loads_with_a_warning() -> None:
    config = load_auth(doc(entry("replace-with-sha256-hex-from-keygen")))
    assert config.warnings and "no key can match it" in config.warnings[0]
    assert config.tenant_for_key("replace-with-sha256-hex-from-keygen") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            doc(entry(extra="      quota: {requests_per_minute: 1}\n"), entry(OTHER_HEX)),
            "api.keys[1]: owner 'acme' is also api.keys[0] with another quota",
        ),
        (doc(entry(), entry()), "api.keys[1].key_hash: listed twice"),
        (doc(entry(KEY)), "api.keys[0].key_hash: is a key in clear"),
        (
            doc(entry().replace('owner: "acme"', 'owner: ""')),
            "api.keys[0].metadata.owner: must not be empty",
        ),
        (
            doc(entry().replace('      metadata: {name: "k", owner: "acme"}\n', "")),
            "api.keys[0].metadata: missing (required: a mapping with name and owner)",
        ),
        (
            doc(entry().replace('owner: "acme"', 'owner: "acme", expires_at: "2027-01-01"')),
            "api.keys[0].metadata.expires_at: must be a date as DD-MM-YYYY",
        ),
        (
            doc(entry().replace('owner: "acme"', 'owner: "acme", expires_at: "31-02-2027"')),
            "api.keys[0].metadata.expires_at: must be a date as DD-MM-YYYY",
        ),
        (
            doc(entry(extra="      quota: {input_tokens_per_minute: -5}\n")),
            "api.keys[0].quota.input_tokens_per_minute: must be between 0 and 1000000000000,"
            " got -5",
        ),
        (
            doc(entry(extra="      max_occupancy_share: 1.5\n")),
            "api.keys[0].max_occupancy_share: must be a number in (0, 1]",
        ),
        (
            doc(entry(extra="      mode: spot\n")),
            "api.keys[0].mode: must be one of reserved, serverless",
        ),
        (
            doc(entry(extra="      quota: {requests_per_minute: -1}\n")),
            "api.keys[0].quota.requests_per_minute: must be between 0 and 1000000000000, got -1",
        ),
        (doc(entry(extra="      quota: {rpm: 5}\n")), "api.keys[0].quota.rpm: unknown quota field"),
        (
            doc(entry(extra="      quota: {requests_per_minute: 1, burst: 1000000000001}\n")),
            "api.keys[0].quota.burst: must be between 1 and 1000000000000, got 1000000000001",
        ),
        (
            doc(
                entry(
                    extra="      quota:\n        per_model: {m: "
                    "{requests_per_minute_per_replica: 1, tokens_per_day: 10000000000000}}\n"
                )
            ),
            "per_model.m.tokens_per_day: must be between 0 and 1000000000000",
        ),
        (
            doc(
                entry(
                    extra="      quota:\n        requests_per_minute: 5\n        per_model: {m: "
                    "{requests_per_minute_per_replica: 1, tokens_per_day: 1}}\n"
                )
            ),
            "cannot be combined with the flat requests_per_minute/tokens_per_day",
        ),
        (
            doc(
                entry(
                    extra="      quota:\n        output_tokens_per_minute: 500\n"
                    "        per_model: {m: {requests_per_minute_per_replica: 1,"
                    " tokens_per_day: 1}}\n"
                )
            ),
            "api.keys[0].quota.output_tokens_per_minute: cannot be combined with quota.per_model",
        ),
        (
            doc(entry(extra="      quota:\n        per_model: {m: {tokens_per_day: 1}}\n")),
            "per_model.m.requests_per_minute_per_replica: missing (required; 0 is unlimited)",
        ),
        ("api:\n  mode: dynamic\n  keys: [x]\n", "api.keys: not read in dynamic mode"),
        ("api:\n  mode: api-key\n", "api.keys: api.mode api-key needs a non-empty list"),
        ("api:\n  mode: none\n  keys: [x]\n", "api.keys: not read when api.mode is none"),
        ("api: {mode: api-key, keys: []}\nadmins: {}\n", "admins: unknown top-level key"),
        (doc(entry(), admin="open"), "admin.mode: must be one of none, api-key"),
    ],
)
def test_every_mistake_is_named_with_its_path(text: str, expected: str) -> None:
    assert any(expected in error for error in errors_of(text)), errors_of(text)


def test_a_tenants_file_still_loads_as_before() -> None:
    text = f'tenants:\n  team:\n    keys: ["sha256:{HEX}"]\n'
    assert load_auth(text).tenant_for_key(KEY).name == "team"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("hex_bytes", "encoded"),
    [
        # Bitcoin Core's base58 vectors (src/test/data/base58_encode_decode.json).
        ("", ""),
        ("61", "2g"),
        ("626262", "a3gV"),
        ("636363", "aPEr"),
        ("73696d706c792061206c6f6e6720737472696e67", "2cFupjhnEsSn59qHXstmK2ffpLv2"),
        (
            "00eb15231dfceb60925886b67d065299925915aeb172c06647",
            "1NS17iag9jJgTHD1VXjvLCEnZuQ3rJDE9L",
        ),
        ("516b6fcd0f", "ABnLTmg"),
        ("bf4f89001e670274dd", "3SEo3LWLoPntC"),
        ("572e4794", "3EFU7m"),
        ("ecac89cad93923c02321", "EJDM8drfXA6uyA"),
        ("10c8511e", "Rt5zm"),
        ("00000000000000000000", "1111111111"),
    ],
)
def test_base58_matches_bitcoins_vectors(hex_bytes: str, encoded: str) -> None:
    assert base58(bytes.fromhex(hex_bytes)) == encoded


def test_keygen_key_is_base58_of_32_bytes() -> None:
    key = keygen_entry("acme").splitlines()[0].removeprefix("key: ")
    assert key.startswith("sk-hivenet-")
    body = key.removeprefix("sk-hivenet-")
    assert set(body) <= set(BASE58_ALPHABET), body
    # Decoded back: 32 bytes (upstream: 32 random bytes before Base58 encoding).
    number = 0
    for char in body:
        number = number * 58 + BASE58_ALPHABET.index(char)
    zeros = len(body) - len(body.lstrip("1"))
    assert zeros + (number.bit_length() + 7) // 8 == 32


def test_keygen_entry_loads_as_printed() -> None:
    printed = keygen_entry("acme-corp")
    lines = printed.splitlines()
    key = lines[0].removeprefix("key: ")
    body = printed[printed.index("- key_hash") :]
    indented = "".join(f"    {line}\n" for line in body.splitlines())
    config = load_auth("api:\n  mode: api-key\n  keys:\n" + indented)
    assert config.tenant_for_key(key).name == "acme-corp"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="--tenant"):
        keygen_entry("x" * 201)
