"""Checking and replacing the running policy: `check-policy`, `PUT`/`GET /admin/policy`,
SIGHUP. A bad policy never replaces a good one, and every attempt is counted."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from router import cli
from router.documents import version_of
from router.policy.schema import load_policy_file
from tests.fleet import ADMIN_KEY, VENV_BIN, Fleet, Router, wait_until

POLICIES = Path(__file__).resolve().parent.parent / "configs" / "policies"
VALID = sorted(POLICIES.glob("*.yaml"))
INVALID = sorted((POLICIES / "invalid").glob("*.yaml"))
MODEL = "m1"


def header(path: Path, key: str) -> list[str]:
    prefix = f"# {key}: "
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]


# --- check-policy ------------------------------------------------------------------------


@pytest.fixture
def check_policy(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> object:
    """`hivenet-router check-policy` in-process (one process per file would take a minute):
    the same `main`, without the daemon's logging set-up."""
    monkeypatch.setattr(cli, "setup_logging", lambda **options: None)

    def run(path: Path) -> tuple[int, str, str]:
        code = cli.main(["check-policy", str(path)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_the_policy_directories_are_populated() -> None:
    assert len(VALID) >= 30 and len(INVALID) >= 25


@pytest.mark.parametrize("path", VALID, ids=lambda path: path.name)
def test_check_policy_accepts_every_example_and_prints_its_chain(
    check_policy: object, path: Path
) -> None:
    code, out, err = check_policy(path)  # type: ignore[operator]
    assert (code, err) == (0, "")
    policy = load_policy_file(path)
    names = policy.chain_names()
    chain = names[:]
    if policy.fallback_provider is not None:
        provider = policy.fallback_provider
        chain.append(f"provider {provider.engine} ({provider.model})")
    lines = out.splitlines()
    assert lines[0] == "chain: " + " → ".join(chain)
    for i, name in enumerate(names, 1):
        assert f"step {i}: {name}" in lines
    strategies = [step.strategy for step in policy.steps]
    assert [line[14:] for line in lines if line.startswith("  strategy:   ")] == strategies
    assert sum(line.startswith("  max_tries:  ") for line in lines) == len(names)
    assert any(line.startswith("fallback_provider: ") for line in lines)
    warnings = [line.removeprefix("warning: ") for line in lines if line.startswith("warning: ")]
    assert warnings == header(path, "warning")
    assert all(out.count(warning) == 1 for warning in warnings), out


@pytest.mark.parametrize("path", INVALID, ids=lambda path: path.name)
def test_check_policy_rejects_every_invalid_example_naming_the_field(
    check_policy: object, path: Path
) -> None:
    code, out, err = check_policy(path)  # type: ignore[operator]
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert lines[0] == f"{path}: invalid policy"
    assert all(line.startswith("  - ") for line in lines[1:]) and len(lines) > 1
    for expected in header(path, "expect"):
        assert expected in err, (expected, err)


def test_check_policy_as_a_command(tmp_path: Path) -> None:
    exe = str(VENV_BIN / "hivenet-router")
    good = subprocess.run(
        [exe, "check-policy", str(POLICIES / "fallback-chain.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("chain: routing_policy → any-eu-vllm → any-engine\n")
    bad = subprocess.run(
        [exe, "check-policy", str(POLICIES / "invalid" / "missing-strategy.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1
    assert "routing_policy.strategy" in bad.stderr
    missing = subprocess.run(
        [exe, "check-policy", str(tmp_path / "nope.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1
    assert "nope.yaml" in missing.stderr


STEP = "routing_policy:\n  strategy: least-loaded\n"


def test_check_policy_checks_a_directory_as_policy_model_dir_loads_it(
    check_policy: object, tmp_path: Path
) -> None:
    (tmp_path / "_default.yaml").write_text(
        STEP + "fallback_chain:\n  - name: wide\n    strategy: round-robin\n"
    )
    (tmp_path / "code.yml").write_text("models: [coder]\n" + STEP)
    (tmp_path / "chat.yaml").write_text(
        "models: [a, b]\n" + STEP + "  exclude_if:\n    kv_cache_utilization: {gt: 90}\n"
    )
    # Not policies: an editor's temporary file and another suffix.
    (tmp_path / ".chat.yaml.swp.yaml").write_text("routing_policy: {}\n")
    (tmp_path / "README.txt").write_text("notes\n")
    code, out, err = check_policy(tmp_path)  # type: ignore[operator]
    assert (code, err) == (0, "")
    headers = [line for line in out.splitlines() if line.startswith("== ")]
    assert headers == [
        "== _default: the global policy",
        "== chat: a per-model policy",
        "== code: a per-model policy",
    ]
    sections = out.split("\n\n== ")
    assert sections[0].splitlines()[1] == "chain: routing_policy → wide"
    assert sections[1].splitlines()[1:3] == [
        "chain: routing_policy",
        "models: a, b (a per-model file)",
    ]
    assert "warning: routing_policy.exclude_if.kv_cache_utilization.gt" in sections[1]
    assert sections[2].splitlines()[2] == "models: coder (a per-model file)"


def test_check_policy_names_every_problem_of_a_directory(
    check_policy: object, tmp_path: Path
) -> None:
    (tmp_path / "_default.yaml").write_text(STEP)
    (tmp_path / "_default.yml").write_text(STEP)
    (tmp_path / "a.yaml").write_text("models: [m]\n" + STEP)
    (tmp_path / "b.yaml").write_text("models: [m]\n" + STEP)
    (tmp_path / "c.yaml").write_text(STEP)
    (tmp_path / "d.yaml").write_text("models: [d]\nrouting_policy: {}\n")
    code, out, err = check_policy(tmp_path)  # type: ignore[operator]
    assert code == 1
    # The documents that load are still shown; the global one is refused.
    assert [line for line in out.splitlines() if line.startswith("== ")] == [
        "== a: a per-model policy"
    ]
    lines = err.splitlines()
    assert lines[0] == f"{tmp_path}: invalid policy directory"
    assert all(line.startswith("  - ") for line in lines[1:])
    for expected in (
        "_default.yml: both _default.yaml and _default.yml are there",
        "/b: model 'm' already belongs to policy 'a'",
        "/c: models: missing",
        "/d: routing_policy.strategy",
    ):
        assert sum(expected in line for line in lines) == 1, (expected, err)


def test_check_policy_says_a_directory_without_a_global_policy_uses_the_other_one(
    check_policy: object, tmp_path: Path
) -> None:
    (tmp_path / "a.yaml").write_text("models: [m]\n" + STEP)
    code, out, err = check_policy(tmp_path)  # type: ignore[operator]
    assert (code, err) == (0, "")
    assert out.startswith("== _default: none (the global policy is --policy-file's")
    assert "\n\n== a: a per-model policy\nchain: routing_policy\n" in out


# --- the running policy ------------------------------------------------------------------

FIRST = """\
routing_policy:
  match: {}
  strategy: least-loaded
"""

ONLY_FALLBACK = """\
# The primary matches nobody; every request is a fallback.
routing_policy:
  match:
    region: Nowhere
  strategy: least-loaded
fallback_chain:
  - name: anywhere
    match: {}
    strategy: least-loaded
"""

UNKNOWN_STRATEGY = """\
routing_policy:
  match: {}
  strategy: cache_aware
"""

SEVERAL_PROBLEMS = """\
routing_policy:
  match:
    colour: blue
  exclude_if:
    kv_cache_utilization:
      gt: 0.8
      lt: 0.1
  strategy: least-loaded
"""

BAD_YAML = "routing_policy:\n  match: {\n  strategy: least-loaded\n"

SIGHUP_POLICY = """\
routing_policy:
  match: {}
  strategy: least-loaded
  max_tries: 2
fallback_chain:
  - name: reloaded-by-sighup
    match: {}
    strategy: least-loaded
"""


def admin(method: str, router: Router, body: bytes | None = None, key: str = ADMIN_KEY):
    return httpx.request(
        method,
        router.url + "/admin/policy",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/yaml"},
        timeout=10,
    )


def running_policy(router: Router) -> str:
    r = admin("GET", router)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/yaml")
    return r.text


def reloads(router: Router) -> tuple[float, float]:
    name = "hivenet_router_policy_reloads_total"
    return router.metric(name, result="success"), router.metric(name, result="failure")


def served_by_step(router: Router) -> tuple[float, float]:
    """(primary, fallback) counters after one chat request, which must succeed."""
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "which step?"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return (
        router.metric("hivenet_router_policy_primary_routed_total", model=MODEL),
        router.metric("hivenet_router_policy_fallback_routed_total", model=MODEL),
    )


def test_put_admin_policy_replaces_a_good_policy_and_never_with_a_bad_one(
    fleet: Fleet, tmp_path: Path
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(FIRST)
    router = fleet.router("--policy-file", str(policy_file))
    fleet.agent(router, MODEL)
    assert running_policy(router) == FIRST
    assert served_by_step(router) == (1, 0)
    assert reloads(router) == (0, 0)

    r = admin("PUT", router, ONLY_FALLBACK.encode())
    assert r.status_code == 200, r.text
    assert r.json() == {
        "status": "policy updated",  # upstream's reply
        "chain": ["routing_policy", "anywhere"],
        "version": version_of(ONLY_FALLBACK),
    }
    assert running_policy(router) == ONLY_FALLBACK
    assert served_by_step(router) == (1, 1)
    assert reloads(router) == (1, 0)
    router.wait_log(r"policy_reloaded origin=admin_api chain=\[routing_policy→anywhere\]")

    rejected = [
        (UNKNOWN_STRATEGY.encode(), ["routing_policy.strategy"]),
        (SEVERAL_PROBLEMS.encode(), ["routing_policy.match.colour", "kv_cache_utilization"]),
        (BAD_YAML.encode(), ["invalid YAML"]),
        (b"routing_policy: \xff\xfe", ["UTF-8"]),
        (b"", ["routing_policy"]),
    ]
    for n, (body, fields) in enumerate(rejected, 1):
        r = admin("PUT", router, body)
        assert r.status_code == 400, (body, r.text)
        # Upstream's flat `{"error": "<message>"}`, with every reason in `errors`.
        error = r.json()
        assert isinstance(error["error"], str)
        assert error["errors"], error
        for field in fields:
            assert any(field in e for e in error["errors"]), (field, error["errors"])
            assert field in error["error"]
        # The good policy keeps running, and serving.
        assert running_policy(router) == ONLY_FALLBACK
        assert served_by_step(router) == (1, 1 + n)
    # Several problems in one policy are all reported at once.
    r = admin("PUT", router, SEVERAL_PROBLEMS.encode())
    assert len(r.json()["errors"]) >= 2
    # Every rejected body is a failed reload, the unreadable one included.
    assert reloads(router) == (1, len(rejected) + 1)
    assert router.log().count("policy_reload_failed origin=admin_api") == len(rejected) + 1

    # Only admins may read or replace it.
    assert admin("PUT", router, FIRST.encode(), key="not-an-admin").status_code == 401
    assert admin("GET", router, key="not-an-admin").status_code == 401
    assert running_policy(router) == ONLY_FALLBACK


def test_sighup_reloads_the_policy_file_and_keeps_the_old_one_on_a_bad_edit(
    fleet: Fleet, tmp_path: Path
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(FIRST)
    router = fleet.router("--policy-file", str(policy_file))
    fleet.agent(router, MODEL)

    def hup_and_wait(marker: str, count: int) -> None:
        router.send_signal(signal.SIGHUP)
        wait_until(lambda: router.log().count(marker) >= count, 20, f"{count} x {marker}")

    policy_file.write_text(SIGHUP_POLICY)
    hup_and_wait("policy_reloaded origin=file", 1)
    router.wait_log(r"policy_reloaded origin=file chain=\[routing_policy→reloaded-by-sighup\]")
    assert running_policy(router) == SIGHUP_POLICY
    assert reloads(router) == (1, 0)

    bad_edits: list[bytes | None] = [
        BAD_YAML.encode(),
        UNKNOWN_STRATEGY.encode(),
        b"routing_policy:\n  strategy: least-loaded\n  match: {region: \xff}\n",
        None,  # the file is gone
    ]
    for n, edit in enumerate(bad_edits, 1):
        if edit is None:
            policy_file.unlink()
        else:
            policy_file.write_bytes(edit)
        hup_and_wait("policy_reload_failed origin=file", n)
        assert router.alive()
        assert running_policy(router) == SIGHUP_POLICY
        assert reloads(router) == (1, n)
        assert served_by_step(router) == (n, 0)
    log = router.log()
    assert "routing_policy.strategy" in log
    assert "cannot read policy file" in log
    assert log.count("sighup_reload_rejected") == len(bad_edits)

    # Fixed again: the next SIGHUP takes it.
    policy_file.write_text(FIRST)
    hup_and_wait("policy_reloaded origin=file", 2)
    assert running_policy(router) == FIRST
    assert reloads(router) == (2, len(bad_edits))


def test_without_a_policy_file_the_default_runs_and_sighup_changes_nothing(
    fleet: Fleet,
) -> None:
    router = fleet.router()
    assert running_policy(router) == "routing_policy:\n  match: {}\n  strategy: least-loaded\n"
    router.send_signal(signal.SIGHUP)
    router.wait_log("policy_reload_skipped")
    assert router.alive()
    assert reloads(router) == (0, 0)
    assert running_policy(router).startswith("routing_policy:\n  match: {}")
