"""The key record admission reads (issue 20): every key its own id and limits."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from router.metrics import RouterMetrics
from router.tenants.audit import AdminRecord, AuditLog, audit_admin
from router.tenants.config import KeyLimits, hash_key, key_id_of, load_auth
from router.tenants.gate import GateSettings, TenantGate
from router.tenants.keys import ClientKeys

KEY = "sk-hivenet-" + "1" * 64
OTHER = "sk-hivenet-" + "2" * 64


def _hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_two_static_keys_of_one_owner_have_two_ids_and_their_own_limits() -> None:
    text = (
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{_hex(KEY)}"\n'
        '      metadata: {name: "a", owner: "acme"}\n'
        "      mode: serverless\n      max_occupancy_share: 0.25\n      max_input_tokens: 900\n"
        "      quota: {input_tokens_per_minute: 1000, output_tokens_per_minute: 200}\n"
        f'    - key_hash: "{_hex(OTHER)}"\n'
        '      metadata: {name: "b", owner: "acme"}\n'
        "admin:\n  mode: api-key\n"
    )
    config = load_auth(text)
    first, second = config.key_for(KEY), config.key_for(OTHER)
    assert first is not None and second is not None
    assert first.id != second.id and first.id == key_id_of(hash_key(KEY))
    assert first.tenant == second.tenant == "acme"
    assert first.limits == KeyLimits("serverless", 0.25, 1000, 200, 900, 0)
    assert second.limits == KeyLimits()
    assert first.limits.serverless("") and not second.limits.serverless("reserved")
    assert second.limits.serverless("serverless")
    # The id is not the key, nor enough of its hash to look it up.
    assert KEY not in first.id and len(first.id) == len("key-") + 12


def test_a_per_model_entry_carries_that_models_serverless_limits() -> None:
    text = (
        "api:\n  mode: api-key\n  keys:\n"
        f'    - key_hash: "{_hex(KEY)}"\n'
        '      metadata: {name: "a", owner: "acme"}\n'
        "      quota:\n        per_model:\n"
        "          big: {requests_per_minute_per_replica: 1, tokens_per_day: 0,"
        " input_tokens_per_minute: 7, max_occupancy_share: 0.5}\n"
        "          small: {requests_per_minute_per_replica: 1, tokens_per_day: 0}\n"
        "admin:\n  mode: api-key\n"
    )
    key = load_auth(text).key_for(KEY)
    assert key is not None
    assert key.limits_for("big").input_tokens_per_minute == 7
    assert key.limits_for("big").max_occupancy_share == 0.5
    # No flat rate beside per_model (upstream refuses the mix): `small` has none.
    assert key.limits_for("small").input_tokens_per_minute == 0


def test_a_tenants_file_gives_each_of_its_keys_the_tenants_limits() -> None:
    text = (
        "tenants:\n  acme:\n"
        f"    keys: [{hash_key(KEY)}, {hash_key(OTHER)}]\n"
        "    mode: serverless\n    input_tokens_per_minute: 300\n    images_max: 2\n"
    )
    config = load_auth(text)
    first, second = config.key_for(KEY), config.key_for(OTHER)
    assert first is not None and second is not None
    assert first.id != second.id
    assert first.limits == second.limits == KeyLimits("serverless", 0.0, 300, 0, 0, 2)


def test_an_admin_call_gets_an_audit_line_with_who_and_from_where(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path), 1 << 20, 1)
    audit_admin(log, AdminRecord("api_key.put", "acme-prod", 200, "key-0123", "10.0.0.7", "r1"))
    audit_admin(None, AdminRecord("api_key.put", "x", 200))  # no log: nothing, no error
    log.close()
    (line,) = path.read_text().splitlines()
    record = json.loads(line)
    assert record["kind"] == "admin" and record["action"] == "api_key.put"
    assert record["target"] == "acme-prod" and record["status"] == 200
    assert record["key_id"] == "key-0123" and record["source_ip"] == "10.0.0.7"


def test_keys_of_hivenet_router_api_keys_each_get_their_own_id() -> None:
    gate = TenantGate(GateSettings(), ClientKeys("k-one:team,k-two:team"), RouterMetrics())
    tenant, one = gate.identify_key(["k-one"])
    again, two = gate.identify_key(["wrong", "k-two"])
    assert tenant == again == "team"
    assert one is not None and two is not None and one.id != two.id
    assert one.id == key_id_of(hash_key("k-one"))
    assert gate.identify_key(["nope"]) == (None, None)
    # Without keys, nobody needs one: no record, no shared "anonymous" state.
    open_gate = TenantGate(GateSettings(), ClientKeys(""), RouterMetrics())
    assert open_gate.identify_key([]) == ("default", None)
