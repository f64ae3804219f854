"""The PromQL of deploy/: the dashboards' and rules' expressions, and the names they use.

Shared by tests/test_deploy.py (promtool, the router's metric names) and
tests/test_deploy_prometheus.py (a real Prometheus evaluating them).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

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


@dataclass(frozen=True)
class Expr:
    where: str  # file and panel, variable or rule, for failure messages
    title: str  # the panel's title; "" for a variable or a rule
    expr: str  # as Prometheus gets it, Grafana's variables substituted


def dashboard_exprs() -> list[Expr]:
    """Every target and variable query of every dashboard."""
    out: list[Expr] = []
    for path in dashboard_files():
        dash = dashboard_json(path)
        variables = {v["name"] for v in dash["templating"]["list"]}
        for var in dash["templating"]["list"]:
            where = f"{path.name} variable ${var['name']}"
            selector = label_values_selector(var["query"]["query"])
            out.append(Expr(where, "", substitute(selector, variables, where)))
        for panel in panels(dash):
            for target in panel.get("targets", []):
                where = f"{path.name} panel {panel['title']!r} {target['refId']}"
                expr = substitute(target["expr"], variables, where)
                out.append(Expr(where, panel["title"], expr))
    return out


def rule_exprs() -> list[Expr]:
    out = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule["record"]
                out.append(Expr(f"{path.name} {name}", "", rule["expr"]))
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
