"""`--metrics-compat upstream` (issue 47): every series upstream's dashboards query exists
on a live router with the flag, in upstream's units; without it no upstream name appears
and this router's names are unchanged."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import httpx
import trio

from protocol import messages as m
from router.agent_detail import upstream_of
from router.tenants.config import hash_key
from tests.fleet import Fleet, Router, wait_until
from tests.link_peers import scripted_agent
from tests.test_upstream_e2e import upstream

KEY = "hnr-compat-test-key-0123456789"
AUTH = f"""tenants:
  acme:
    keys: ["{hash_key(KEY)}"]
    requests_per_minute: 600
    tokens_per_day: 100000
"""
# A GPU host running llama.cpp, as its heartbeat says: the sim agent has no GPU, and no
# engine of this suite exports llama.cpp's throughputs or vLLM's raw histograms.
GPU = {
    "index": 0,
    "util_percent": 87.0,
    "vram_used_bytes": 30e9,
    "vram_free_bytes": 50e9,
    "vram_total_bytes": 80e9,
    "temperature_c": 64.0,
    "power_watts": 412.5,
}
HARDWARE = {
    "gpu_temperature_c": 64.0,
    "gpu_util_percent": 0.87,
    "gpu_vram_used_percent": 0.375,
    "memory_used_percent": 0.25,
    "cpu_usage_percent": 0.5,
    "memory_used_bytes": 16e9,
    "memory_available_bytes": 48e9,
    "memory_total_bytes": 64e9,
    "gpus": [GPU],
    "interval": 2.0,
}
ENGINE = {
    "kv_cache_utilization": 0.4,
    "running_requests": 2,
    "waiting_requests": 1,
    "avg_ttft_seconds": 0.12,
    "p90_ttft_seconds": 0.3,
    "avg_itl_seconds": 0.02,
    "p90_itl_seconds": 0.04,
    "preemptions_total": 3,
    "interval": 0.5,
    "upstream": {
        "histograms": {
            "ttft_seconds": {"buckets": [[0.1, 4], [0.5, 9]], "sum": 1.7, "count": 10},
            "itl_seconds": {"buckets": [[0.01, 50]], "sum": 1.1, "count": 80},
            "request_prompt_tokens": {"buckets": [[128, 6]], "sum": 900, "count": 10},
            "request_generation_tokens": {"buckets": [[64, 2]], "sum": 700, "count": 10},
        },
        "finish_reasons": {"stop": 8, "length": 2},
        "predicted_tps": 41.5,
        "prompt_tps": 900.0,
    },
}
# Another model than the sim agent's: this scripted agent never answers a request.
LLAMA = {"model": "m-gpu", "capability": "llm", "engine": "llamacpp", "capacity": 4}


def dashboard_metrics() -> set[str]:
    """Every metric name in the PromQL of upstream's Prometheus dashboards (panels and
    variables); a histogram's `_bucket` series stands for its family."""
    folder = upstream("deploy", "grafana", "provisioning", "dashboards")
    names: set[str] = set()
    for path in sorted(folder.glob("*.json")):
        board = json.loads(path.read_text())
        texts: list[str] = []

        def walk(panels: list, texts: list[str]) -> None:
            for panel in panels:
                walk(panel.get("panels", []), texts)
                for target in panel.get("targets", []):
                    if target.get("datasource", panel.get("datasource", {})).get("type") == "loki":
                        continue
                    texts.append(target.get("expr", ""))

        walk(board.get("panels", []), texts)
        for var in board.get("templating", {}).get("list", []):
            if var.get("datasource", {}).get("type") == "prometheus":
                query = var.get("query")
                texts.append(query.get("query", "") if isinstance(query, dict) else str(query))
        for text in texts:
            names |= set(re.findall(r"\b((?:hivenet|http)_[a-z0-9_]+)", text))
    return names


def scraped(router: Router) -> dict[str, list[str]]:
    """Sample lines of a live scrape, by sample name."""
    out: dict[str, list[str]] = {}
    for line in router.metrics().splitlines():
        if line and not line.startswith("#"):
            out.setdefault(re.split(r"[{ ]", line, maxsplit=1)[0], []).append(line)
    return out


def value(lines: list[str], **labels: str) -> float:
    for line in lines:
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample with {labels} in {lines}")


def test_the_dashboards_name_the_series_this_test_checks() -> None:
    names = dashboard_metrics()
    assert len(names) >= 45, names
    assert {"hivenet_agent_srtt_ms", "hivenet_tenant_quota_rpm_limit"} <= names
    assert "hivenet_tenant_request_duration_seconds_bucket" in names


async def test_every_dashboard_series_exists_with_the_flag(fleet: Fleet, tmp_path: Path) -> None:
    auth = tmp_path / "auth.yaml"
    auth.write_text(AUTH)
    router = await trio.to_thread.run_sync(
        lambda: fleet.router("--metrics-compat", "upstream", "--auth-file", str(auth))
    )
    sim = await trio.to_thread.run_sync(lambda: fleet.agent(router, "m1"))
    heartbeat = m.heartbeat(time.time(), True, ENGINE, HARDWARE)
    async with scripted_agent(router, lambda msg, fs: None, LLAMA, heartbeat=heartbeat) as gpu:

        def traffic() -> None:
            headers = {"Authorization": f"Bearer {KEY}"}
            body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
            wait_until(
                lambda: (
                    httpx.post(
                        router.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
                    ).status_code
                    == 200
                ),
                what="a request served",
            )
            bad = {"Authorization": "Bearer wrong"}
            httpx.post(router.url + "/v1/chat/completions", json=body, headers=bad, timeout=10)

        await trio.to_thread.run_sync(traffic)

        def sim_ttft_sent() -> bool:
            # The sim agent's histogram arrives with its next heartbeat after the answer.
            lines = scraped(router).get("hivenet_agent_engine_ttft_seconds_count", [])
            return any(sim.peer_id in line and not line.endswith(" 0.0") for line in lines)

        await trio.to_thread.run_sync(
            lambda: wait_until(sim_ttft_sent, what="the sim engine's TTFT in a heartbeat")
        )
        page = await trio.to_thread.run_sync(scraped, router)
        missing = sorted(n for n in dashboard_metrics() if n not in page)
        assert not missing, missing

        # Upstream's units: milliseconds, percentages, Unix milliseconds.
        ours = {"peer_id": gpu.peer_id}
        assert value(page["hivenet_agent_cpu_usage_percent"], **ours) == 50.0
        assert value(page["hivenet_agent_memory_used_percent"], **ours) == 25.0
        assert value(page["hivenet_agent_gpu_utilization_percent"], **ours) == 87.0
        assert value(page["hivenet_agent_gpu_vram_free_bytes"], **ours) == 50e9
        assert value(page["hivenet_agent_memory_available_bytes"], **ours) == 48e9
        seen_ms = value(page["hivenet_routing_agent_last_seen_timestamp"], **ours)
        assert abs(seen_ms / 1000 - time.time()) < 30
        sim_srtt = value(page["hivenet_router_agent_srtt_seconds"], peer_id=sim.peer_id)
        assert value(page["hivenet_agent_srtt_ms"], peer_id=sim.peer_id) == sim_srtt * 1000
        info = value(page["hivenet_routing_agent_info"], **ours, engine="llamacpp", capacity="4")
        assert info == 1.0
        # Re-exported from the engine: histograms, finish reasons, llama.cpp throughput.
        assert value(page["hivenet_agent_engine_ttft_seconds_bucket"], **ours, le="0.5") == 9
        assert value(page["hivenet_agent_engine_ttft_seconds_count"], **ours) == 10
        reasons = page["hivenet_agent_engine_request_success_total"]
        assert value(reasons, **ours, finished_reason="length") == 2
        assert value(page["hivenet_agent_engine_predicted_tps"], **ours) == 41.5
        # The sim agent's own engine (vLLM's names): its TTFT histogram, as the engine has it.
        sim_ttft = page["hivenet_agent_engine_ttft_seconds_count"]
        assert value(sim_ttft, peer_id=sim.peer_id) >= 1
        # Tenants: the auth file's limits, the day's tokens, requests by outcome.
        assert value(page["hivenet_tenant_quota_rpm_limit"], tenant_id="acme") == 600
        assert value(page["hivenet_tenant_quota_tpd_limit"], tenant_id="acme") == 100000
        assert value(page["hivenet_tenant_tokens_used_today"], tenant_id="acme") > 0
        assert value(page["hivenet_tenant_requests_success_total"], tenant_id="acme") >= 1
        assert abs(value(page["hivenet_tenant_last_request_timestamp"]) - time.time()) < 60
        assert value(page["hivenet_routing_requests_routed_total"], tenant_id="acme") >= 1
        assert "http_server_active_requests" in page


def test_without_the_flag_no_upstream_name_appears(fleet: Fleet) -> None:
    router = fleet.router()
    fleet.agent(router, "m1")
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    page = scraped(router)
    upstream_names = [
        n
        for n in page
        if (n.startswith("hivenet_") and not n.startswith("hivenet_router_"))
        or n.startswith(("http_server_", "http_client_"))
    ]
    assert not upstream_names, upstream_names
    # This router's own names, as INTERFACE.md sets them.
    assert "hivenet_router_routing_requests_routed_total" in page
    assert "hivenet_router_policy_primary_routed_total" in page


def test_engine_upstream_of_a_heartbeat_is_bounded_and_checked() -> None:
    good = upstream_of(ENGINE)
    assert good["histograms"]["ttft_seconds"][0][-1] == (math.inf, 10.0)
    assert good["finish_reasons"] == {"stop": 8.0, "length": 2.0}

    def ttft(**item: object) -> dict:
        return {"upstream": {"histograms": {"ttft_seconds": item}}}

    hostile = [
        {"upstream": "x"},
        ttft(buckets=[[1, 5]], sum=1, count=2),  # the +Inf bucket below a finite one
        ttft(buckets=[[1, 5]], sum=1),  # no count
        ttft(buckets=[[math.nan, 1]], sum=1, count=1),
        ttft(buckets=[[2, 1], [1, 1]], sum=1, count=1),  # bounds out of order
        ttft(buckets=[[float(i), 1] for i in range(100)], sum=1, count=1),
        ttft(buckets="many", sum=1, count=1),
        ttft(buckets=[[1, True]], sum=1, count=1),
        {"upstream": {"histograms": {"other": {"buckets": [], "sum": 1, "count": 1}}}},
        {"upstream": {"finish_reasons": {f"r{i}": 1 for i in range(100)}}},
        {"upstream": {"finish_reasons": {"Bad Reason!": 1, 3: 4}}},
        {"upstream": {"predicted_tps": -1, "prompt_tps": "fast"}},
    ]
    for engine in hostile:
        assert upstream_of(engine) == {}, engine


VLLM_PAGE = """\
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m1"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m1"} 5.0
vllm:time_to_first_token_seconds_sum{model_name="m1"} 0.9
vllm:time_to_first_token_seconds_count{model_name="m1"} 5.0
vllm:request_prompt_tokens_bucket{le="100.0",model_name="m1"} 4.0
vllm:request_prompt_tokens_bucket{le="+Inf",model_name="m1"} 5.0
vllm:request_prompt_tokens_sum{model_name="m1"} 420.0
vllm:request_prompt_tokens_count{model_name="m1"} 5.0
vllm:request_success_total{finished_reason="stop",model_name="m1"} 4.0
vllm:request_success_total{finished_reason="length",model_name="m1"} 1.0
"""


def test_the_agent_reads_what_upstream_re_exports_from_its_engine() -> None:
    from agent.engines import get_adapter

    values = get_adapter("vllm").new_sampler("m1").update(VLLM_PAGE, now=0.0)
    json.dumps(values, allow_nan=False)  # the agent's own pages are JSON
    extra = values["upstream"]
    assert extra["histograms"]["ttft_seconds"] == {
        "buckets": [[0.1, 3.0]],
        "sum": 0.9,
        "count": 5.0,
    }
    assert extra["histograms"]["request_prompt_tokens"]["sum"] == 420.0
    assert extra["finish_reasons"] == {"stop": 4.0, "length": 1.0}
    parsed = upstream_of({"upstream": extra})
    assert parsed["histograms"]["ttft_seconds"] == (((0.1, 3.0), (math.inf, 5.0)), 0.9)
    llama = "llamacpp:predicted_tokens_seconds 38.5\nllamacpp:prompt_tokens_seconds 812\n"
    values = get_adapter("llamacpp").new_sampler(None).update(llama, now=0.0)
    assert values["upstream"] == {"predicted_tps": 38.5, "prompt_tps": 812.0}


async def test_provider_calls_are_timed_as_upstream_names_them(
    fleet: Fleet, tmp_path: Path
) -> None:
    from tests.provider_fakes import FakeOpenAI
    from tests.test_provider_e2e import chat, start_router

    fake = FakeOpenAI("sk-test")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        router = await trio.to_thread.run_sync(
            lambda: start_router(
                fleet, tmp_path, "openai", fake.base_url, "--metrics-compat", "upstream"
            )
        )
        await trio.to_thread.run_sync(lambda: fleet.agent(router, "m1"))
        raw = await trio.to_thread.run_sync(lambda: chat(router))
        assert raw.headers["x-hivenet-served-by"] == "provider:openai"
        page = await trio.to_thread.run_sync(scraped, router)
        counts = page["http_client_request_duration_seconds_count"]
        assert value(counts, provider="openai", status_code="200") == 1
        assert value(page["hivenet_policy_provider_fallback_total"], model="m1") == 1
        nursery.cancel_scope.cancel()
