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

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml

from tests.fleet import Fleet

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RULES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
# Series Prometheus makes itself for each target, not the router.
PROMETHEUS_OWN = {"up"}
# Values Grafana gives its built-in interval variables; any duration parses the same.
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: scripts/setup installs it (Debian's prometheus package)"
    return path


def load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards", DEPLOY / "grafana/dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the file runs.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- the expressions -----------------------------------------------------------------


def dashboard_files() -> list[Path]:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert len(files) == 3, files
    return files


def dashboard_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])


def label_values_selector(query: str) -> str:
    """The series selector of a Grafana `label_values(selector, label)` query."""
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert m, f"variable query {query!r} is not label_values(selector, label)"
    return m.group(1)


def substitute(expr: str, variables: set[str], where: str) -> str:
    for name, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)
    for name in re.findall(r"\$(\w+)", expr):
        assert name in variables, f"{where}: ${name} is not a variable of the dashboard"
    # Every variable is multi-valued with allValue ".*", used as a regex (=~"$model").
    return re.sub(r"\$\w+", ".*", expr)


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expression) for every target and variable query of every dashboard."""
    out: list[tuple[str, str]] = []
    for path in dashboard_files():
        dash = dashboard_json(path)
        variables = {v["name"] for v in dash["templating"]["list"]}
        for var in dash["templating"]["list"]:
            where = f"{path.name} variable ${var['name']}"
            selector = label_values_selector(var["query"]["query"])
            out.append((where, substitute(selector, variables, where)))
        for panel in panels(dash):
            for target in panel.get("targets", []):
                where = f"{path.name} panel {panel['title']!r} {target['refId']}"
                out.append((where, substitute(target["expr"], variables, where)))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    out = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule["record"]
                out.append((f"{path.name} {name}", rule["expr"]))
    return out


def recorded_names() -> set[str]:
    return {
        rule["record"]
        for path in RULES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (a lexer for the PromQL these files use)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    # Label lists of by/without/on/ignoring/group_left/group_right.
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*(?=\s*(\(?))", text):
        word, call = m.group(0), m.group(1)
        if call or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


# --- the router's real metrics ---------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name a router with one sim agent can export, from its TYPE lines."""
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
        text = router.metrics()
    finally:
        fleet.close()
    names = set()
    for line in text.splitlines():
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
    rules = [{"record": f"dashboard:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        # promtool names a failing rule by its index in the group.
        bad = [exprs[int(i)] for i in re.findall(r"rule (\d+)", out.stdout + out.stderr)]
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


def test_the_lexer_finds_metric_names() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{model=~".*", x="y{"}[5m])))'
        " / on (model) group_left () b:c:rate5m + count without (peer_id) (up) > bool 2"
    )
    assert metric_names(expr) == {"a_bucket", "b:c:rate5m", "up"}


def test_every_metric_the_deploy_files_name_is_exported(exported: set[str]) -> None:
    recorded = recorded_names()
    missing = []
    for where, expr in dashboard_exprs() + rule_exprs():
        for name in metric_names(expr):
            if ":" in name:
                if name not in recorded:
                    missing.append(f"{where}: {name} (no recording rule makes it)")
            elif name not in exported and name not in PROMETHEUS_OWN:
                missing.append(f"{where}: {name}")
    assert not missing, "\n".join(missing)


def test_every_exported_router_family_is_on_a_dashboard(exported: set[str]) -> None:
    """A new metric in router/metrics.py without a panel shows up here."""
    shown = {name for _, expr in dashboard_exprs() for name in metric_names(expr)}
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
