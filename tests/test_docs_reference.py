"""The reference pages cannot drift from the code (issue 50).

- docs/reference/*.md are what `scripts/docs_reference.py` writes from the parsers, the
  metrics registry, protocol/errors.py, the logging calls and the policy and auth
  schemas: a flag, series, code, event or field added, renamed or removed in the code
  and not regenerated fails here, with the command to run.
- The hand-written pages (and README.md) name no flag that no parser of the project
  (or of a tool the pages run) has, and no `hivenet_router_*` series the registry lacks.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "scripts" / "docs_reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = generator()

# Flags of other programs the pages run (systemd, useradd, apt, podman, the engines).
OTHER_TOOLS = {
    "--no-pager": "systemctl, journalctl",
    "--gil": "py-spy record",
    "--now": "systemctl enable",
    "--unit": "systemd-run",
    "--grep": "journalctl",
    "--system": "useradd",
    "--home-dir": "useradd",
    "--no-create-home": "useradd",
    "--shell": "useradd",
    "--no-upgrade": "apt-get",
    "--build": "podman compose",
    "--dry-run": "podman-compose",
    "--isolation": "podman build",
    "--cgroups": "podman run",
    "--enable-metrics": "SGLang",
    "--metrics": "llama.cpp server",
    "--served-model-name": "vLLM",
    "--enable-shared": "CPython's configure",
    "--data-binary": "curl",
    "--fail": "curl",
    "--silent": "curl",
    "--show-error": "curl",
    "--max-time": "curl",
    "--tool": "valgrind",
    "--reranking": "llama.cpp server",
    "--strict": "mkdocs build",
    "--replicaof": "redis-server",
    "--allowed": "claude (--allowedTools)",
    "--output-format": "claude -p",
    "--verbose": "claude -p",
    "--format": "opencode run",
    "--ignore-scripts": "npm install",
    "--omit": "npm install",
    "--enable-auto-tool-choice": "vLLM",
    "--tool-call-parser": "vLLM",
    "--max-model-len": "vLLM",
    "--dtype": "vLLM",
    "--enforce-eager": "vLLM",
    "--enable-prefix-caching": "vLLM",
    "--max-num-seqs": "vLLM",
    "--num-gpu-blocks-override": "vLLM",
    "--runner": "vLLM",
}


def hand_written() -> list[Path]:
    pages = [p for p in DOCS.rglob("*.md") if "reference" not in p.relative_to(DOCS).parts]
    return [*sorted(pages), ROOT / "README.md"]


@functools.cache
def project_flags() -> frozenset[str]:
    """Every long option of the daemons, the simulator, the benchmarks and scripts/."""
    import agent.cli
    import router.cli

    found: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            found.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    with GEN.clean_environment():
        for parser in (router.cli.build_parser(), agent.cli.build_parser(), GEN.sim_parser()):
            walk(parser)
    # The benchmarks' and the dashboards builder's options, read from their source (their
    # modules are not imported: some start processes at import).
    for path in [*sorted((ROOT / "bench").glob("*.py")), ROOT / "deploy/grafana/dashboards.py"]:
        found.update(
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"--[a-z][a-z0-9-]*", node.value)
        )
    for path in (ROOT / "scripts").iterdir():
        if path.is_file() and path.suffix == "":
            found.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", path.read_text()))
    return frozenset(found)


def test_the_reference_pages_are_what_the_code_generates() -> None:
    stale = [
        name
        for name, text in GEN.render().items()
        if not (DOCS / "reference" / name).exists()
        or (DOCS / "reference" / name).read_text() != text
    ]
    assert not stale, (
        f"docs/reference/{', '.join(stale)} differ from the code:"
        " run `.venv/bin/python scripts/docs_reference.py` and commit the pages"
    )


def test_the_reference_names_what_the_code_has() -> None:
    """A few anchors, so that a generator that silently found nothing fails."""
    cli = (DOCS / "reference" / "cli.md").read_text()
    for flag in ("--policy-file", "--router", "--capacity", "--state-url", "--prefill-shared"):
        assert f"`{flag} " in cli or f"`{flag}`" in cli, flag
    metrics = (DOCS / "reference" / "metrics.md").read_text()
    for name, *_ in GEN.metric_families():
        assert f"`{name}`" in metrics
    assert len(GEN.metric_families()) > 50
    logs = (DOCS / "reference" / "logs.md").read_text()
    for event in ("policy_exhausted", "load_shed", "agent_joined", "router_ready"):
        assert f"`{event}`" in logs, event
    errors = (DOCS / "reference" / "errors.md").read_text()
    from protocol.errors import ErrorCode, status_of

    for code in ErrorCode:
        assert f"| `{code.value}` | {status_of(code)} |" in errors, code


@pytest.mark.parametrize("page", hand_written(), ids=lambda p: str(p.relative_to(ROOT)))
def test_hand_written_pages_name_only_flags_and_series_that_exist(page: Path) -> None:
    text = page.read_text()
    flags = project_flags() | set(OTHER_TOOLS)
    unknown = sorted(
        {f for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", text) if f not in flags}
    )
    assert not unknown, f"{page.name} names flags no parser has: {unknown}"
    families = {name for name, *_ in GEN.metric_families()}
    missing = set()
    for match in re.finditer(r"hivenet_router_[a-z0-9_]+", text):
        name = match.group()
        # `hivenet_router_agent_*`, `hivenet_router_(a|b)`: a prefix of several names.
        if name.endswith("_") or text[match.end() : match.end() + 1] in ("(", "*", "…"):
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if not {name, base, base + "_total", name + "_total"} & families:
            missing.add(name)
    assert not missing, f"{page.name} names series the router does not export: {sorted(missing)}"


def test_the_check_would_catch_an_unknown_flag_and_series() -> None:
    flags = project_flags()
    assert "--policy-file" in flags and "--no-such-flag" not in flags
    families = {name for name, *_ in GEN.metric_families()}
    assert "hivenet_router_policy_shed_total" in families
    assert "hivenet_router_no_such_total" not in families


def test_the_pages_policy_and_auth_examples_load() -> None:
    """Every whole policy (`routing_policy:` or `models:` at the top) and auth file
    (`tenants:` or `api:`) a page shows loads as the router would load it; `sha256:…`
    stands for a key's hash."""
    from router.policy.schema import load_policy
    from router.tenants.config import load_auth

    loaded = 0
    for page in hand_written():
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S):
            if re.search(r"^(routing_policy|models):", block, flags=re.M):
                load_policy(block)
                loaded += 1
            elif re.match(r"(tenants|api):", block):
                load_auth(block.replace("sha256:…", "sha256:" + "0" * 64))
                loaded += 1
    assert loaded >= 4
