"""The admin API, the models API, request ids and /metrics against a live router.

Every `curl … | jq` command of the seeds is here, as the seeds write it. Each one's
selection is evaluated in Python (CI installs no jq), and, where `curl` and `jq` are
both installed, the command itself is also run through bash and must print the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from router.http.asgi import RequestIds, request_id
from tests.fleet import ADMIN_KEY, Agent, Fleet, Proc, Router, wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
OTHER = "Qwen-3.6-35B"
AGENT_FLAGS = {
    "eu": [
        "--region", "EU-France", "--organization", "hivenet", "--machine", "gpu-box-1",
        "--gpu-model", "NVIDIA H100", "--tags", "fast,eu", "--capacity", "4",
    ],
    "uae": [
        "--region", "UAE", "--organization", "partner", "--machine", "gpu-box-2",
        "--gpu-model", "NVIDIA A100", "--tags", "slow", "--capacity", "8",
    ],
}  # fmt: skip


class AdminFleet:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.router: Router = fleet.router()
        common = ["--heartbeat-interval", "1s", "--sim-token-latency", "10ms"]
        self.eu: Agent = fleet.agent(self.router, MODEL, *AGENT_FLAGS["eu"], *common)
        self.uae: Agent = fleet.agent(self.router, MODEL, *AGENT_FLAGS["uae"], *common)
        self.agents = [self.eu, self.uae]

    def get(self, path: str, key: str | None = ADMIN_KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return httpx.get(self.router.url + path, headers=headers, timeout=10)

    def chat(self, text: str = "hello", **headers: str) -> httpx.Response:
        return httpx.post(
            self.router.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": text}]},
            headers=headers,
            timeout=30,
        )


@pytest.fixture(scope="module")
def af(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AdminFleet]:
    fleet = Fleet(Path(tmp_path_factory.mktemp("admin")))
    try:
        admin_fleet = AdminFleet(fleet)
        admin_fleet.chat()  # one answer, so the universal stats are known
        yield admin_fleet
    finally:
        fleet.close()


# --- the seeds' commands -------------------------------------------------------------------

# (where, the command as the seeds print it, key -> the path its jq filter selects)
Selection = tuple[str, str, dict[str, tuple[str, ...]]]


def _agents_cmd(body: str) -> str:
    return (
        'curl \\\n  -H "Authorization: Bearer $HIVENET_ROUTER_ADMIN_API_KEY" \\\n'
        "  http://localhost:8080/admin/routing-table \\\n"
        f"  | jq '.agents[] | {{{body}}}'"
    )


SEEDS: list[Selection] = [
    (
        "fallback-chains.md:407",
        'curl \\\n  -H "Authorization: Bearer <admin-api-key>" \\\n'
        "  http://localhost:8080/admin/routing-table \\\n"
        '  -H "Authorization: Bearer <admin-api-key>" \\\n'
        "  | jq '.agents[] | {\n      model: .metadata.model,\n"
        "      gpu_model: .metadata.gpu_model\n    }'",
        {"model": ("metadata", "model"), "gpu_model": ("metadata", "gpu_model")},
    ),
    (
        "fallback-chains.md:662",
        'curl \\\n  -H "Authorization: Bearer <admin-api-key>" \\\n'
        "  http://localhost:8080/admin/routing-table \\\n"
        '  -H "Authorization: Bearer <admin-api-key>" \\\n'
        "  | jq '.agents[] | {\n      model: .metadata.model,\n"
        "      capability: .metadata.capability,\n      engine: .metadata.engine,\n"
        "      region: .metadata.region,\n      tags: .metadata.tags,\n"
        "      healthy: .status.healthy,\n      backend_healthy: .status.backend_healthy\n"
        "    }'",
        {
            "model": ("metadata", "model"),
            "capability": ("metadata", "capability"),
            "engine": ("metadata", "engine"),
            "region": ("metadata", "region"),
            "tags": ("metadata", "tags"),
            "healthy": ("status", "healthy"),
            "backend_healthy": ("status", "backend_healthy"),
        },
    ),
    (
        "policy-gates.md:59",
        _agents_cmd(
            "\n      peer_id,\n      model: .metadata.model,\n      engine: .metadata.engine,"
            "\n      capability: .metadata.capability\n    "
        ),
        {
            "peer_id": ("peer_id",),
            "model": ("metadata", "model"),
            "engine": ("metadata", "engine"),
            "capability": ("metadata", "capability"),
        },
    ),
    (
        "policy-gates.md:105",
        _agents_cmd(
            "\n      model: .metadata.model,\n      peer_id,\n"
            "      agent_healthy: .status.healthy,\n"
            "      backend_healthy: .status.backend_healthy,\n"
            "      last_seen: .status.last_seen\n    "
        ),
        {
            "model": ("metadata", "model"),
            "peer_id": ("peer_id",),
            "agent_healthy": ("status", "healthy"),
            "backend_healthy": ("status", "backend_healthy"),
            "last_seen": ("status", "last_seen"),
        },
    ),
    (
        "policy-gates.md:156",
        _agents_cmd(
            "\n      model: .metadata.model,\n      capability: .metadata.capability,\n"
            "      engine: .metadata.engine\n    "
        ),
        {
            "model": ("metadata", "model"),
            "capability": ("metadata", "capability"),
            "engine": ("metadata", "engine"),
        },
    ),
    (
        "policy-gates.md:219",
        _agents_cmd(
            "\n      model: .metadata.model,\n      engine: .metadata.engine,\n"
            "      region: .metadata.region,\n      organization: .metadata.organization,\n"
            "      machine: .metadata.machine,\n      gpu_model: .metadata.gpu_model,\n"
            "      tags: .metadata.tags\n    "
        ),
        {
            "model": ("metadata", "model"),
            "engine": ("metadata", "engine"),
            "region": ("metadata", "region"),
            "organization": ("metadata", "organization"),
            "machine": ("metadata", "machine"),
            "gpu_model": ("metadata", "gpu_model"),
            "tags": ("metadata", "tags"),
        },
    ),
    (
        "policy-gates.md:321",
        _agents_cmd(
            "\n      model: .metadata.model,\n      peer_id,\n"
            "      active_requests: .status.active_requests,\n"
            "      capacity: .metadata.capacity,\n"
            "      capacity_utilization: .status.capacity_utilization\n    "
        ),
        {
            "model": ("metadata", "model"),
            "peer_id": ("peer_id",),
            "active_requests": ("status", "active_requests"),
            "capacity": ("metadata", "capacity"),
            "capacity_utilization": ("status", "capacity_utilization"),
        },
    ),
    (
        "policy-gates.md:704",
        _agents_cmd(
            "\n      model: .metadata.model,\n      engine: .metadata.engine,\n"
            "      kv_cache: .engine.kv_cache_utilization\n    "
        ),
        {
            "model": ("metadata", "model"),
            "engine": ("metadata", "engine"),
            "kv_cache": ("engine", "kv_cache_utilization"),
        },
    ),
    (
        "routing-concepts.md:520",
        'curl \\\n-H "Authorization: Bearer " \\\nhttp://localhost:8080/admin/routing-table \\\n'
        "| jq '.agents[] | {\nmodel: .metadata.model,\nengine: .metadata.engine,\n"
        "region: .metadata.region,\norganization: .metadata.organization,\n"
        "machine: .metadata.machine,\ntags: .metadata.tags,\ngpu_model: .metadata.gpu_model\n}'",
        {
            "model": ("metadata", "model"),
            "engine": ("metadata", "engine"),
            "region": ("metadata", "region"),
            "organization": ("metadata", "organization"),
            "machine": ("metadata", "machine"),
            "tags": ("metadata", "tags"),
            "gpu_model": ("metadata", "gpu_model"),
        },
    ),
]
SEED_IDS = [s[0] for s in SEEDS]


def _select(agent: dict, fields: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, path in fields.items():
        value: Any = agent
        for part in path:
            assert isinstance(value, dict) and part in value, f"{'.'.join(path)} missing"
            value = value[part]
        out[key] = value
    return out


def _runnable(command: str, router: Router) -> str:
    """The seeds' command against the test router: its address and admin key."""
    command = command.replace("http://localhost:8080", router.url)
    command = command.replace("<admin-api-key>", ADMIN_KEY)
    command = command.replace("$HIVENET_ROUTER_ADMIN_API_KEY", ADMIN_KEY)
    command = command.replace('"Authorization: Bearer "', f'"Authorization: Bearer {ADMIN_KEY}"')
    return command.replace("curl ", "curl -sS ", 1)


@pytest.mark.parametrize(("where", "command", "fields"), SEEDS, ids=SEED_IDS)
def test_seeds_routing_table_selections(
    af: AdminFleet, where: str, command: str, fields: dict[str, tuple[str, ...]]
) -> None:
    agents = wait_until(lambda: _fresh_table(af), 20, "engine and hardware metrics")
    assert len(agents) == 2
    by_machine = {}
    for agent in agents:
        selected = _select(agent, fields)
        for key, value in selected.items():
            # Every field these commands select is reported by the sim agents.
            assert value is not None, (where, key, agent)
        by_machine[agent["metadata"]["machine"]] = selected
    expected = {
        "gpu-box-1": {
            "model": MODEL,
            "gpu_model": "NVIDIA H100",
            "region": "EU-France",
            "organization": "hivenet",
            "tags": ["fast", "eu"],
            "capacity": 4,
        },
        "gpu-box-2": {
            "model": MODEL,
            "gpu_model": "NVIDIA A100",
            "region": "UAE",
            "organization": "partner",
            "tags": ["slow"],
            "capacity": 8,
        },
    }
    for machine, values in by_machine.items():
        assert values.get("machine", machine) == machine
        for key, value in values.items():
            if key in expected[machine]:
                assert value == expected[machine][key], (where, key)
        for key in ("capability", "engine"):
            if key in values:
                assert values[key] == {"capability": "llm", "engine": "sim"}[key]
        for key in ("healthy", "agent_healthy", "backend_healthy"):
            if key in values:
                assert values[key] is True
        if "kv_cache" in values:
            assert 0.0 <= values["kv_cache"] <= 1.0
        if "last_seen" in values:
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", values["last_seen"])


def _fresh_table(af: AdminFleet) -> list[dict] | None:
    table = af.get("/admin/routing-table").json()
    agents = table["agents"]
    assert table["total"] == len(agents)  # upstream's count beside the list
    for a in agents:
        if a["engine"]["kv_cache_utilization"] is None:
            return None
        if a["hardware"]["memory_used_percent"] is None:
            return None
        if a["hardware"]["cpu_usage_percent"] is None:
            return None
    return agents


@pytest.mark.parametrize(("where", "command", "fields"), SEEDS, ids=SEED_IDS)
def test_seeds_commands_run_verbatim_with_curl_and_jq(
    af: AdminFleet, where: str, command: str, fields: dict[str, tuple[str, ...]]
) -> None:
    missing = [tool for tool in ("curl", "jq") if shutil.which(tool) is None]
    if missing:
        # The seeds' own commands are the spec: CI must run them, not pass over them.
        if os.environ.get("CI"):
            pytest.fail(f"{' and '.join(missing)} missing in CI: scripts/setup installs them")
        pytest.skip(f"{' and '.join(missing)} not installed; scripts/setup installs them")
    wait_until(lambda: _fresh_table(af), 20, "engine and hardware metrics")
    out = subprocess.run(
        ["bash", "-c", "set -o pipefail; " + _runnable(command, af.router)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    printed = json.loads("[" + re.sub(r"}\s*{", "},{", out.stdout.strip()) + "]")
    assert len(printed) == 2
    for obj in printed:
        assert list(obj) == list(fields)  # jq keeps the command's key order
        for key in fields:
            assert obj[key] is not None, (where, key, obj)


def test_seeds_admin_models_ids(af: AdminFleet) -> None:
    # policy-gates.md:52 — curl … /admin/models | jq -r '.data[].id'
    body = af.get("/admin/models").json()
    assert [m["id"] for m in body["data"]] == [MODEL]
    card = body["data"][0]
    assert card["capability"] == "llm"
    assert card["agents"]["total"] == 2
    assert sorted(card["agent_peer_ids"]) == sorted(a.peer_id for a in af.agents)
    # One model, by its name with a slash in it.
    one = af.get("/admin/models/" + MODEL)
    assert one.status_code == 200 and one.json()["id"] == MODEL
    # Upstream: the same card as /v1/models/{model}, its agent list included.
    listed = one.json()["agents"]["list"]
    assert sorted(a["peer_id"] for a in listed) == sorted(a.peer_id for a in af.agents)
    assert all(a["is_healthy"] is True and a["engine"] == "sim" for a in listed)
    missing = af.get("/admin/models/absent")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    if shutil.which("curl") and shutil.which("jq"):
        command = (
            'curl \\\n  -H "Authorization: Bearer $HIVENET_ROUTER_ADMIN_API_KEY" \\\n'
            "  http://localhost:8080/admin/models \\\n  | jq -r '.data[].id'"
        )
        out = subprocess.run(
            ["bash", "-c", "set -o pipefail; " + _runnable(command, af.router)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [MODEL]


def test_seeds_admin_health(af: AdminFleet) -> None:
    # policy-gates.md:98 — curl … /admin/health | jq .
    health = af.get("/admin/health").json()
    assert health["status"] == "healthy"
    assert health["total_agents"] == 2
    assert health["healthy_agents"] == 2
    assert health["queues"] == {MODEL: 0}
    assert len(health["agents"]) == 2
    # Upstream's fields too (its admin-endpoints page).
    assert health["queue_length"] == 0
    assert abs(health["timestamp"] - time.time()) < 60
    for agent in health["agents"]:
        for key in ("peer_id", "model", "healthy", "backend_healthy", "active_requests"):
            assert agent[key] is not None
        assert agent["model"] == MODEL
        assert agent["healthy"] is True and agent["backend_healthy"] is True
        assert agent["is_healthy"] is True and agent["engine"] == "sim"
        assert isinstance(agent["version"], str) and isinstance(agent["region"], str)
        # Upstream's unit: Unix seconds (issue 47 item 11).
        assert isinstance(agent["last_seen"], int) and abs(agent["last_seen"] - time.time()) < 60
    assert {a["capacity"] for a in health["agents"]} == {4, 8}


def test_v1_models_lists_agent_counts_capacity_engines_and_regions(af: AdminFleet) -> None:
    r = httpx.get(af.router.url + "/v1/models", timeout=10)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL
    assert card["object"] == "model"
    assert isinstance(card["created"], int)
    assert card["owned_by"]
    assert card["capability"] == "llm"
    assert card["agents"] == {
        "total": 2,
        "healthy": 2,
        "total_capacity": 12,
        "engines": ["sim"],
        "regions": ["EU-France", "UAE"],
    }
    one = httpx.get(af.router.url + "/v1/models/" + MODEL, timeout=10)
    assert one.status_code == 200
    detail = one.json()
    # The detail adds one entry per agent (the Go router's `agents.list[]`).
    listed = detail["agents"].pop("list")
    assert detail == card | {"created": detail["created"]}
    assert len(listed) == 2 and {a["region"] for a in listed} == {"EU-France", "UAE"}
    encoded = httpx.get(af.router.url + "/v1/models/meta-llama%2FLlama-3.1-8B-Instruct", timeout=10)
    assert encoded.status_code == 200 and encoded.json()["id"] == MODEL


def test_routing_table_has_every_interface_field(af: AdminFleet) -> None:
    agents = wait_until(lambda: _fresh_table(af), 20, "engine and hardware metrics")
    fields = {
        "metadata": (
            "model", "capability", "engine", "region", "organization", "machine", "gpu_model",
            "tags", "capacity",
        ),
        "status": (
            "healthy", "backend_healthy", "last_seen", "active_requests", "capacity_utilization",
        ),
        "universal": ("success_rate", "srtt", "consecutive_failures"),
        "engine": (
            "kv_cache_utilization", "running_requests", "waiting_requests", "avg_ttft_seconds",
            "p90_ttft_seconds", "avg_itl_seconds", "p90_itl_seconds",
        ),
        "hardware": (
            "gpu_temperature_c", "gpu_util_percent", "gpu_vram_used_percent",
            "memory_used_percent", "cpu_usage_percent",
        ),
    }  # fmt: skip
    for agent in agents:
        assert isinstance(agent["peer_id"], str) and agent["peer_id"].startswith("12D3KooW")
        for group, names in fields.items():
            for name in names:
                assert name in agent[group], f"{group}.{name}"
        for name in ("kv_cache_utilization", "running_requests", "waiting_requests"):
            assert agent["engine"][name] is not None, name
        for name in ("memory_used_percent", "cpu_usage_percent"):
            assert 0.0 <= agent["hardware"][name] <= 1.0, name
        for name in ("gpu_temperature_c", "gpu_util_percent", "gpu_vram_used_percent"):
            # NVML where there is a GPU; null (never zero) without one.
            value = agent["hardware"][name]
            assert value is None or value >= 0
            if not _nvml_present():
                assert value is None, name
        assert 0.0 <= agent["status"]["capacity_utilization"] <= 1.0
    served = [a for a in agents if a["universal"]["success_rate"] is not None]
    assert served, "the fixture's request was served by one agent"
    for agent in served:
        assert agent["universal"]["success_rate"] == 1.0
        assert agent["universal"]["srtt"] > 0
        assert agent["universal"]["consecutive_failures"] == 0


def _nvml_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


def test_engine_latency_metrics_appear_under_traffic(af: AdminFleet) -> None:
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            af.chat(" ".join(f"w{i}" for i in range(8)))

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    try:

        def latency_known() -> bool:
            for agent in af.get("/admin/routing-table").json()["agents"]:
                engine = agent["engine"]
                if all(
                    engine[k] is not None
                    for k in ("avg_ttft_seconds", "p90_ttft_seconds", "avg_itl_seconds")
                ):
                    return engine["avg_itl_seconds"] > 0
            return False

        wait_until(latency_known, 30, "TTFT and ITL from the sim's histograms")
    finally:
        stop.set()
        for t in threads:
            t.join(30)


# --- admin keys --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/admin/routing-table", "/admin/health", "/admin/models", "/admin/policy"]
)
def test_admin_needs_a_key(af: AdminFleet, path: str) -> None:
    for key in (None, "wrong-key", ""):
        r = af.get(path, key=key) if key != "" else httpx.get(af.router.url + path, timeout=10)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["code"] == "unauthorized" and err["source"] == "router"
        assert r.headers["www-authenticate"] == 'Bearer realm="hivenet-router"'
    r = httpx.put(af.router.url + "/admin/policy", content=b"routing_policy: {}", timeout=10)
    assert r.status_code == 401
    assert af.get(path).status_code == 200


def test_policy_as_json_when_asked(af: AdminFleet) -> None:
    yaml_text = af.get("/admin/policy")
    assert yaml_text.headers["content-type"].startswith("application/yaml")
    for accept in ("application/json", "application/json, */*;q=0.5"):
        r = httpx.get(
            af.router.url + "/admin/policy",
            headers={"Authorization": f"Bearer {ADMIN_KEY}", "Accept": accept},
            timeout=10,
        )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/json")
        policy = r.json()
        # The policy's own fields, as upstream's JSON has them.
        assert policy["routing_policy"] == yaml.safe_load(yaml_text.text)["routing_policy"]
        assert policy["chain"][0] == "routing_policy" and policy["version"]
        # One version, one tag: If-Match on PUT takes the tag of either form.
        assert r.headers["etag"] == yaml_text.headers["etag"]
        assert r.headers["vary"] == "accept"


def test_policy_get_and_put_count_reloads(af: AdminFleet) -> None:
    router = af.router
    h = {"Authorization": f"Bearer {ADMIN_KEY}"}
    original = af.get("/admin/policy")
    assert original.status_code == 200
    assert original.headers["content-type"].startswith("application/yaml")
    assert "routing_policy" in original.text
    before_ok = router.metric("hivenet_router_policy_reloads_total", result="success")
    before_bad = router.metric("hivenet_router_policy_reloads_total", result="failure")
    bad = httpx.put(
        router.url + "/admin/policy", content=b"routing_policy: [", headers=h, timeout=10
    )
    assert bad.status_code == 400
    # Upstream's flat `{"error": "<message>"}`, every reason in `errors` beside it.
    assert isinstance(bad.json()["error"], str) and "invalid YAML" in bad.json()["error"]
    assert bad.json()["errors"]
    good = """
routing_policy:
  match:
    region: EU-France
  strategy: least-loaded
fallback_chain:
  - name: anywhere
    match: {}
    strategy: least-loaded
"""
    ok = httpx.put(router.url + "/admin/policy", content=good.encode(), headers=h, timeout=10)
    try:
        assert ok.status_code == 200, ok.text
        assert ok.json()["chain"] == ["routing_policy", "anywhere"]
        assert ok.json()["status"] == "policy updated"  # upstream's reply
        assert af.get("/admin/policy").text == good
        assert af.chat().status_code == 200
    finally:
        restored = httpx.put(
            router.url + "/admin/policy", content=original.content, headers=h, timeout=10
        )
        assert restored.status_code == 200
    assert router.metric("hivenet_router_policy_reloads_total", result="failure") == before_bad + 1
    assert router.metric("hivenet_router_policy_reloads_total", result="success") == before_ok + 2


def test_router_refuses_to_start_without_admin_keys(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    del fleet.env["HIVENET_ROUTER_ADMIN_API_KEYS"]
    fleet.env.pop("HIVENET_ROUTER_ALLOW_INSECURE_ADMIN", None)
    router = fleet.router(start=False)
    try:
        Proc.start(router)
        assert router.popen is not None
        code = router.popen.wait(60)
        assert code != 0
        log = router.log()
        assert "HIVENET_ROUTER_ADMIN_API_KEYS" in log
        assert "HIVENET_ROUTER_ALLOW_INSECURE_ADMIN=true" in log
        assert "router_ready" not in log
    finally:
        fleet.close()


def test_insecure_admin_is_allowed_when_asked_for_and_warned_about(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    del fleet.env["HIVENET_ROUTER_ADMIN_API_KEYS"]
    try:
        router = fleet.router(env={"HIVENET_ROUTER_ALLOW_INSECURE_ADMIN": "true"})
        r = httpx.get(router.url + "/admin/health", timeout=10)
        assert r.status_code == 200
        assert r.json()["total_agents"] == 0
        assert r.json()["status"] == "degraded"
        assert "admin_api_insecure" in router.log()
    finally:
        fleet.close()


# --- X-Request-ID ------------------------------------------------------------------------------


def test_a_valid_request_id_is_kept_returned_and_logged(af: AdminFleet) -> None:
    rid = "8b9e4a6d-dfb4-4b95-bada-319e7e5b878a"  # the seeds' example
    r = af.chat(**{"X-Request-ID": rid})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == rid
    af.router.wait_log(rf"req={rid} method=POST path=/v1/chat/completions status=200")
    # Upper case is a valid UUID too: kept exactly, so a grep for it finds the lines.
    upper = str(uuid.uuid4()).upper()
    r = af.chat(**{"X-Request-ID": upper})
    assert r.headers["x-request-id"] == upper
    af.router.wait_log(rf"req={upper} method=POST")
    # Every line about a failing request carries it: forward errors, exhaustion, access.
    rid = str(uuid.uuid4())
    r = httpx.post(
        af.router.url + "/v1/chat/completions",
        json={"model": OTHER, "messages": [{"role": "user", "content": "x"}]},
        headers={"X-Request-ID": rid},
        timeout=30,
    )
    assert r.status_code == 404 and r.headers["x-request-id"] == rid
    af.router.wait_log(rf"req={rid} method=POST path=/v1/chat/completions status=404")
    lines = [line for line in af.router.log().splitlines() if rid in line]
    assert len(lines) >= 2  # the exhaustion warning and the access line
    assert all(f"req={rid} " in line for line in lines)
    assert any("policy_exhausted" in line for line in lines)
    # Admin answers carry one too.
    assert af.get("/admin/health", key=ADMIN_KEY).headers["x-request-id"]


@pytest.mark.parametrize(
    "given",
    ["not-a-uuid", "1c2d4a6d-dfb4-4b95-bada-319e7e5b87", "x" * 500, "1234", "req=evil injected=1"],
)
def test_an_invalid_request_id_is_replaced(af: AdminFleet, given: str) -> None:
    r = af.chat(**{"X-Request-ID": given})
    assert r.status_code == 200
    returned = r.headers["x-request-id"]
    assert returned != given
    assert str(uuid.UUID(returned)) == returned
    af.router.wait_log(rf"req={returned} method=POST")
    # `req=<given>`, not `given` alone: a generated UUID or a port may contain "1234".
    assert f"req={given}" not in af.router.log()


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("8B9E4A6D-DFB4-4B95-BADA-319E7E5B878A", "8B9E4A6D-DFB4-4B95-BADA-319E7E5B878A"),
        (" 8b9e4a6d-dfb4-4b95-bada-319e7e5b878a ", "8b9e4a6d-dfb4-4b95-bada-319e7e5b878a"),
        # The other spellings upstream's router accepts are kept as sent too.
        ("{8b9e4a6d-dfb4-4b95-bada-319e7e5b878a}", "{8b9e4a6d-dfb4-4b95-bada-319e7e5b878a}"),
        (
            "URN:uuid:8b9e4a6d-dfb4-4b95-bada-319e7e5b878a",
            "URN:uuid:8b9e4a6d-dfb4-4b95-bada-319e7e5b878a",
        ),
        ("8b9e4a6ddfb44b95bada319e7e5b878a", "8b9e4a6ddfb44b95bada319e7e5b878a"),
    ],
)
def test_request_id_spellings(given: str, kept: str) -> None:
    scope = {"headers": [(b"x-request-id", given.encode())]}
    assert request_id(scope, RequestIds()) == kept


@pytest.mark.parametrize(
    "given",
    [
        "not-a-uuid",
        "{8b9e4a6d-dfb4-4b95-bada-319e7e5b878a",
        "8b9e4a6d-dfb4-4b95-bada-319e7e5b878a}",
        "urn:uuid:{8b9e4a6d-dfb4-4b95-bada-319e7e5b878a}",
        "8b9e-4a6ddfb44b95bada319e7e5b878a",  # Python's UUID() takes it; upstream does not
        "8b9e4a6d-dfb4-4b95-bada-319e7e5b878a\nreq=forged",
    ],
)
def test_request_ids_upstream_refuses_are_replaced(given: str) -> None:
    scope = {"headers": [(b"x-request-id", given.encode())]}
    made = request_id(scope, RequestIds())
    assert made != given.strip() and str(uuid.UUID(made)) == made


def test_request_id_generated_when_absent() -> None:
    ids = RequestIds()
    first = request_id({"headers": []}, ids)
    second = request_id({"headers": [(b"x-request-id", b"")]}, ids)
    assert first != second
    assert str(uuid.UUID(first)) == first


def test_generated_request_ids_are_version_4_and_distinct_past_a_refill() -> None:
    ids = RequestIds()
    made = [ids.new() for _ in range(600)]  # more than one pool of 256
    assert len(set(made)) == len(made)
    for rid in made:
        parsed = uuid.UUID(rid)
        assert str(parsed) == rid
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122


# --- /metrics ----------------------------------------------------------------------------------

METRIC_FAMILIES = (
    # INTERFACE.md's counters, as the seeds name them
    "hivenet_router_routing_requests_routed_total",
    "hivenet_router_policy_primary_routed_total",
    "hivenet_router_policy_fallback_routed_total",
    "hivenet_router_policy_provider_fallback_total",
    "hivenet_router_policy_exhausted_total",
    "hivenet_router_agent_connection_resets_total",
    # and the rest under the same prefix
    "hivenet_router_forward_failures_total",
    "hivenet_router_http_requests_total",
    "hivenet_router_request_duration_seconds",
    "hivenet_router_router_overhead_seconds",
    "hivenet_router_queue_depth",
    "hivenet_router_queue_wait_seconds",
    "hivenet_router_agents_connected",
    "hivenet_router_agents_healthy",
    "hivenet_router_policy_reloads_total",
)


def test_metrics_endpoint_has_every_family(af: AdminFleet) -> None:
    router = af.router
    assert af.chat().status_code == 200
    base_url = f"http://127.0.0.1:{router.metrics_port}"
    text = httpx.get(base_url + "/metrics", timeout=10).text
    # Only the page Prometheus scrapes answers with it.
    assert httpx.get(base_url + "/admin/routing-table", timeout=10).status_code == 404
    assert httpx.post(base_url + "/metrics", timeout=10).status_code == 405
    for family in METRIC_FAMILIES:
        base = family.removesuffix("_total")
        assert re.search(rf"^# TYPE {base}(_total)? ", text, re.M), family
    assert router.metric("hivenet_router_agents_connected") == 2
    assert router.metric("hivenet_router_agents_healthy") == 2
    assert router.metric("hivenet_router_routing_requests_routed_total", model=MODEL) >= 1
    assert router.metric("hivenet_router_policy_primary_routed_total", model=MODEL) >= 1
    endpoint = {"endpoint": "/v1/chat/completions"}
    assert router.metric("hivenet_router_router_overhead_seconds_count", **endpoint) >= 1
    assert (
        router.metric("hivenet_router_request_duration_seconds_count", tenant="default", **endpoint)
        >= 1
    )
    # The seeds' `curl http://localhost:2112/metrics | grep hivenet_router_policy`
    policy_lines = [line for line in text.splitlines() if "hivenet_router_policy" in line]
    assert any(
        line.startswith("hivenet_router_policy_primary_routed_total{") for line in policy_lines
    )
