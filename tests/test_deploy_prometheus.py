"""A real Prometheus (Debian's, beside promtool) scrapes a real router and runs deploy/'s rules.

promtool shows the expressions parse; this shows they evaluate on the router's real
series: every recording and alert rule evaluates with no error (a many-to-many match or
a label clash shows up only here), every dashboard query succeeds, and the panels an
operator looks at first have data with one simulated agent serving traffic.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy_files import RULES, dashboard_exprs
from tests.fleet import Fleet, Proc, Router, free_port, wait_until

# With one healthy sim agent and a steady trickle of chat requests, these panels must
# show something; the others wait for what this test does not cause (fallbacks,
# refusals, reloads, tenant tokens, a shared state store).
MUST_HAVE_DATA = {
    "Agents connected",
    "Agents healthy",
    "Healthy agents of $model",
    "Routed requests/s",
    "Client 5xx share",
    "Fleet capacity in use",
    "Requests by routing path",
    "Primary, this range",
    "Client request duration",
    "Router overhead",
    "Routing table",
    "Success rate",
    "SRTT",
    "KV cache",
    "Running and waiting requests",
    "Metrics age",
    "Resident memory",
    "Trio tasks",
    "Requests/s",
    "Requests by tenant",
    "Served locally, by tenant",
    "Answers by status",
    "Answers this range, by tenant, endpoint and status",
}


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> dict[str, Any]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]

    def rules(self) -> list[dict[str, Any]]:
        groups = httpx.get(self.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]


def chat(router: Router) -> None:
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, Prometheus]]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: scripts/setup installs it (Debian's prometheus)"
    directory = tmp_path_factory.mktemp("deploy-prometheus")
    fleet = Fleet(directory)
    try:
        router = fleet.router()
        fleet.agent(router, "m1")
        chat(router)
        # The job name the alerts and the dashboards' process panels select.
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in RULES],
            "scrape_configs": [
                {
                    "job_name": "hivenet-router",
                    "static_configs": [{"targets": [f"127.0.0.1:{router.metrics_port}"]}],
                }
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        argv = [
            binary,
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        fleet.procs.append(Proc("prometheus", argv, {}, directory / "prometheus.log").start())
        prom = Prometheus(f"http://127.0.0.1:{port}")
        wait_until(lambda: httpx.get(prom.url + "/-/ready").status_code == 200, 60, "ready")

        def rates_seen() -> bool:
            chat(router)
            # A client's typo, which no alert is about (a 404, no agent's model).
            typo = {"model": "m1-typo", "messages": [{"role": "user", "content": "hi"}]}
            httpx.post(router.url + "/v1/chat/completions", json=typo, timeout=30)
            routed = prom.query("model:hivenet_router_routing_requests_routed:rate5m > 0")
            typos = prom.query("model:hivenet_router_policy_exhausted:rate5m > 0")
            return bool(routed["result"]) and bool(typos["result"])

        # Requests keep coming until two scrapes apart show the counters rising.
        wait_until(rates_seen, 60, "routed and exhausted rates in Prometheus")
        time.sleep(2)  # two evaluations of the alerts after the recordings
        wait_until(
            lambda: all(r["health"] != "unknown" for r in prom.rules()), 30, "rules evaluated"
        )
        yield router, prom
    finally:
        fleet.close()


def test_every_rule_evaluates_without_error(stack: tuple[Router, Prometheus]) -> None:
    _, prom = stack
    rules = prom.rules()
    names = {r["name"] for r in rules}
    written = {
        rule.get("alert") or rule["record"]
        for path in RULES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    }
    assert names == written
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad


def test_no_alert_fires_on_a_healthy_fleet(stack: tuple[Router, Prometheus]) -> None:
    _, prom = stack
    firing = [
        (r["name"], [a["labels"] for a in r.get("alerts", [])])
        for r in prom.rules()
        if r["type"] == "alerting" and r.get("alerts")
    ]
    assert not firing


def test_every_dashboard_query_evaluates_and_the_main_panels_have_data(
    stack: tuple[Router, Prometheus],
) -> None:
    _, prom = stack
    with_data = set()
    for e in dashboard_exprs():
        if prom.query(e.expr)["result"] and e.title:
            with_data.add(e.title)
    assert sorted(MUST_HAVE_DATA - with_data) == []


def test_the_rules_and_the_scrape_config_pass_promtool_check_config(tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml, with its rule_files pointed at the real rules."""
    config = yaml.safe_load(
        (Path(__file__).resolve().parent.parent / "deploy/prometheus/prometheus.yml").read_text()
    )
    config["rule_files"] = [str(p) for p in RULES]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    promtool = shutil.which("promtool")
    assert promtool
    out = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(RULES)} rule files found" in out.stdout + out.stderr
