"""deploy/: every PromQL expression parses and names only metrics a running router exports.

The expressions are the Grafana dashboards' targets and variable queries (Grafana's
variables replaced by values of their kind) and the Prometheus rules. `promtool`
(Debian's `prometheus` package, installed by scripts/setup) parses them: the dashboard
expressions go into a generated rule file, one recording rule each, since `promtool
check rules` parses any expression that way. The metric names are checked against the
`# TYPE` lines of a real router's /metrics with a simulated agent connected and one
request served, so a family with no sample yet (no fallback has happened) still counts,
and a histogram's `_bucket`, `_sum` and `_count` count under its own name.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy_files import (
    DEPLOY,
    PROMETHEUS_OWN,
    RULES,
    dashboard_exprs,
    dashboard_files,
    dashboard_json,
    load_builder,
    metric_names,
    panels,
    promtool,
    recorded_names,
    rule_exprs,
)
from tests.fleet import Fleet

# --- the router's real metrics ---------------------------------------------------------


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The /metrics text of a router with one sim agent that has served a request."""
    fleet = Fleet(tmp_path_factory.mktemp("deploy-fleet"))
    try:
        router = fleet.router()
        fleet.agent(router, "m1")
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return router.metrics()
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def exported(scraped: str) -> set[str]:
    """Every sample name a router with one sim agent can export, from its TYPE lines."""
    names = set()
    for line in scraped.splitlines():
        m = re.match(r"# TYPE (\S+) (\w+)", line)
        if not m:
            continue
        name, kind = m.groups()
        names.add(name)
        if kind == "histogram":
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
    # The agent's engine and hardware families are there: the sim reports them.
    assert "hivenet_router_agent_kv_cache_utilization" in names
    return names


# --- tests -----------------------------------------------------------------------------


def test_dashboards_are_what_the_builder_renders() -> None:
    builder = load_builder()
    committed = {p.name: p.read_text() for p in dashboard_files()}
    assert committed == builder.rendered(), "run: python deploy/grafana/dashboards.py"


def test_dashboards_query_the_provisioned_datasource() -> None:
    uid = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ][0]["uid"]
    for path in dashboard_files():
        dash = dashboard_json(path)
        for panel in panels(dash):
            if panel["type"] in ("row", "text"):
                continue
            assert panel["datasource"]["uid"] == uid, (path.name, panel["title"])
            assert panel["targets"], (path.name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == uid, (path.name, panel["title"])
        for var in dash["templating"]["list"]:
            assert var["datasource"]["uid"] == uid


def test_promtool_checks_the_rule_files() -> None:
    out = subprocess.run(
        [promtool(), "check", "rules", *map(str, RULES)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_of_the_alerts() -> None:
    tests = DEPLOY / "prometheus/tests/alerts.test.yml"
    out = subprocess.run(
        [promtool(), "test", "rules", tests.name],
        cwd=tests.parent,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    exprs = dashboard_exprs()
    rules = [{"record": f"dashboard:expr_{i}", "expr": e.expr} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        # promtool names a failing rule by its index in the group.
        bad = [exprs[int(i)].where for i in re.findall(r"rule (\d+)", out.stdout + out.stderr)]
        pytest.fail(f"{out.stdout}{out.stderr}\nfailing: {bad}")
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout


def test_a_broken_expression_fails_the_check(tmp_path: Path) -> None:
    """The check above can fail: promtool refuses what Grafana would show as an error."""
    path = tmp_path / "broken.rules.yml"
    bad = 'sum by (model (rate(hivenet_router_policy_shed_total{model=~".*"}[1m]))'
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "dashboard:expr_0", "expr": bad}]}]}))  # fmt: skip
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True)
    assert out.returncode != 0


def test_promtool_finds_nothing_to_lint_in_the_router_s_metrics(scraped: str) -> None:
    """Names, types, help and units as Prometheus asks (base units: seconds, not ms)."""
    # The agent's SRTT, a value with history only after a forward, is among the samples.
    assert "hivenet_router_agent_srtt_seconds{" in scraped
    done = subprocess.run(
        [promtool(), "check", "metrics"], input=scraped, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_lexer_finds_metric_names() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{model=~".*", x="y{"}[5m])))'
        " / on (model) group_left () b:c:rate5m + count without (peer_id) (up) > bool 2"
    )
    assert metric_names(expr) == {"a_bucket", "b:c:rate5m", "up"}


def test_every_metric_the_deploy_files_name_is_exported(exported: set[str]) -> None:
    recorded = recorded_names()
    missing = []
    for e in dashboard_exprs() + rule_exprs():
        where = e.where
        for name in metric_names(e.expr):
            if ":" in name:
                if name not in recorded:
                    missing.append(f"{where}: {name} (no recording rule makes it)")
            elif name not in exported and name not in PROMETHEUS_OWN:
                missing.append(f"{where}: {name}")
    assert not missing, "\n".join(missing)


def test_every_exported_router_family_is_on_a_dashboard(exported: set[str]) -> None:
    """A new metric in router/metrics.py without a panel shows up here."""
    shown = {name for e in dashboard_exprs() for name in metric_names(e.expr)}
    shown |= {
        re.sub(r"_(bucket|sum|count)$", "", name) for name in shown if name.endswith("_bucket")
    }
    families = {
        n
        for n in exported
        if n.startswith("hivenet_router_")
        and not n.endswith(("_created", "_bucket", "_sum", "_count"))
    }
    assert sorted(families - shown) == []


def test_dashboard_panels_tile_a_24_column_grid_with_unique_ids() -> None:
    for path in dashboard_files():
        dash = dashboard_json(path)
        ids = [p["id"] for p in panels(dash)]
        assert len(ids) == len(set(ids)), path.name
        cells: dict[tuple[int, int], str] = {}
        for panel in panels(dash):
            g = panel["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, (path.name, panel["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, (
                        f"{path.name}: {panel['title']!r} overlaps {cells[(x, y)]!r}"
                    )
                    cells[(x, y)] = panel["title"]
            refs = [t["refId"] for t in panel.get("targets", [])]
            assert len(refs) == len(set(refs)), (path.name, panel["title"])


def test_the_docs_list_the_panels_the_builder_renders() -> None:
    page = (DEPLOY.parent / "docs" / "observability.md").read_text()
    assert load_builder().markdown() in page, (
        "paste: python deploy/grafana/dashboards.py --markdown"
    )
