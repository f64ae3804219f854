"""The audit log as upstream writes it (issue 47): upstream's fields and types on every
line, so its Promtail pipeline and Loki dashboard read the file unchanged; model
discovery and every admin call audited; a path that cannot be opened falls back to
stdout; `source_ip` is the socket's peer unless `--trusted-proxies` names the proxy."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from router.http.client_ip import MAX_HOPS, TrustedProxies
from router.tenants.audit import AdminRecord, AuditLog, AuditRecord
from tests.fleet import ADMIN_KEY, Fleet, wait_until
from tests.test_upstream_e2e import upstream

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# Upstream's fields and their JSON types (docs/observability/audit-logging.mdx).
UPSTREAM_FIELDS = {
    "log_type": str,
    "level": str,
    "ts": str,
    "trace_id": str,
    "request_id": str,
    "tenant_id": str,
    "key_id": str,
    "model": str,
    "agent_id": str,
    "status_code": int,
    "latency_ms": int,
    "input_tokens": int,
    "output_tokens": int,
    "error_code": str,
    "source_ip": str,
}
_RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d$")


def check_upstream_shape(line: dict) -> None:
    for name, kind in UPSTREAM_FIELDS.items():
        assert type(line.get(name)) is kind, (name, line)
    assert line["log_type"] == "audit"
    assert line["level"] == ("error" if line["status_code"] >= 400 else "info")
    assert _RFC3339.match(line["ts"]), line["ts"]
    assert (line["error_code"] == "") == (line["status_code"] < 400) or line["status_code"] == 200


def dashboard_fields() -> tuple[set[str], set[str]]:
    """The audit line fields upstream's audit dashboard filters and groups on, and the
    ones it unwraps as numbers, read from its LogQL."""
    board = json.loads(
        upstream("deploy", "grafana", "provisioning", "dashboards", "audit.json").read_text()
    )
    exprs = [t["expr"] for panel in board["panels"] for t in panel.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"]]
    assert exprs
    fields: set[str] = set()
    numbers: set[str] = set()
    for expr in exprs:
        for pipeline in re.findall(r"\| json(.*?)(?:\[|\)|$)", expr):
            fields |= set(re.findall(r"\|\s*(\w+)\s*(?:=~|!=|==|=)", pipeline))
            numbers |= set(re.findall(r"unwrap (\w+)", pipeline))
            numbers |= set(re.findall(r"\|\s*(\w+)\s*!=\s*\d", pipeline))
        fields |= set(re.findall(r"by\s*\((\w+)\)", expr))
        fields |= set(re.findall(r"label_values\((\w+)", expr))
    return fields | numbers, numbers


def promtail_fields() -> set[str]:
    config = yaml.safe_load(upstream("deploy", "promtail", "promtail-config.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "hivenet-router-audit"]
    (stage,) = [s["json"] for s in job["pipeline_stages"] if "json" in s]
    return set(stage["expressions"].values())


def test_the_dashboard_and_promtail_read_fields_every_line_has() -> None:
    fields, numbers = dashboard_fields()
    assert {"tenant_id", "status_code", "model", "error_code", "latency_ms"} <= fields
    assert numbers == {"latency_ms", "status_code"}
    assert fields | promtail_fields() <= set(UPSTREAM_FIELDS)
    for name in numbers:
        assert UPSTREAM_FIELDS[name] is int


def test_lines_have_upstreams_fields_and_types(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), 1 << 20, 1)
    log.write(AuditRecord("r1", "-", "/v1/models", None, None, None, 401, None, None, 0.0123))
    log.write(
        AuditRecord(
            "r2",
            "acme",
            "/v1/chat/completions",
            "m1",
            "primary",
            "12D3Koo",
            200,
            15,
            42,
            1.5,
            key_id="key-1",
            source_ip="10.0.0.5",
            trace_id="ab" * 16,
        )
    )
    log.write(AuditRecord("r3", "acme", "/v1/chat/completions", "m1", None, None, 502, 3, None, 2))
    log.write_admin(AdminRecord("GET", "/admin/health", 200, "admin-1", "::1", "r4", None, 0.002))
    log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for line in lines:
        check_upstream_shape(line)
    unauthorized, served, failed, admin = lines
    assert unauthorized["tenant_id"] == "" and unauthorized["error_code"] == "unauthorized"
    assert unauthorized["key_id"] == unauthorized["trace_id"] == unauthorized["model"] == ""
    assert unauthorized["latency_ms"] == 12 and unauthorized["input_tokens"] == 0
    assert served["tenant_id"] == "acme" and served["agent_id"] == "12D3Koo"
    assert (served["input_tokens"], served["output_tokens"], served["latency_ms"]) == (15, 42, 1500)
    assert served["error_code"] == "" and served["trace_id"] == "ab" * 16
    assert failed["error_code"] == "backend_error" and failed["output_tokens"] == 0
    assert admin["kind"] == "admin" and admin["status_code"] == 200 and admin["source_ip"] == "::1"
    # This router's own names stay beside upstream's.
    assert {"time", "tenant", "status", "code", "duration_ms", "prompt_tokens"} <= set(served)


def test_an_unopenable_path_falls_back_to_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = AuditLog(str(blocker / "audit.jsonl"), 1 << 20, 1)  # a file, not a directory
    log.write(AuditRecord("r1", "acme", "/v1/models", None, None, None, 200, None, None, 0.0))
    log.close()
    said = [r.getMessage() for r in caplog.records if "audit_log_unopenable" in r.getMessage()]
    assert len(said) == 1 and "fallback=stdout" in said[0] and str(blocker) in said[0]
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["request_id"] == "r1"


def test_a_missing_directory_is_created(tmp_path: Path) -> None:
    path = tmp_path / "var" / "log" / "hivenet-router" / "audit.jsonl"
    log = AuditLog(str(path), 1 << 20, 1)
    log.write_admin(AdminRecord("GET", "/admin/health", 200))
    log.close()
    assert json.loads(path.read_text())["log_type"] == "audit"


def scope(peer: str, *headers: tuple[str, str]) -> dict:
    return {"client": (peer, 5000), "headers": [(k.encode(), v.encode()) for k, v in headers]}


@pytest.mark.parametrize(
    ("trusted", "request_scope", "expected"),
    [
        # No trusted proxies: the peer, whatever a header says.
        ("", scope("10.0.0.2", ("x-forwarded-for", "203.0.113.9")), "10.0.0.2"),
        # A peer that is not a trusted proxy: its header is the client's own word.
        ("10.0.0.0/8", scope("198.51.100.1", ("x-forwarded-for", "203.0.113.9")), "198.51.100.1"),
        ("10.0.0.0/8", scope("10.0.0.2", ("x-forwarded-for", "203.0.113.9")), "203.0.113.9"),
        # Read from the right: the left part was written by the client.
        (
            "10.0.0.0/8",
            scope("10.0.0.2", ("x-forwarded-for", "1.2.3.4, 203.0.113.9, 10.0.0.7")),
            "203.0.113.9",
        ),
        # Two header lines are one list.
        (
            "10.0.0.0/8",
            scope("10.0.0.2", ("x-forwarded-for", "1.2.3.4"), ("X-Forwarded-For", "10.1.1.1")),
            "1.2.3.4",
        ),
        ("10.0.0.0/8", scope("10.0.0.2", ("x-real-ip", "2001:db8::5")), "2001:db8::5"),
        ("10.0.0.2,::1", scope("::1", ("x-forwarded-for", "2001:db8::5")), "2001:db8::5"),
        # Hostile or broken headers: the peer.
        ("10.0.0.0/8", scope("10.0.0.2", ("x-forwarded-for", 'evil"}, 1.2.3.4')), "1.2.3.4"),
        ("10.0.0.0/8", scope("10.0.0.2", ("x-forwarded-for", "1.2.3.4, not-an-ip")), "10.0.0.2"),
        ("10.0.0.0/8", scope("10.0.0.2", ("x-forwarded-for", "")), "10.0.0.2"),
        ("10.0.0.0/8", scope("10.0.0.2", ("x-forwarded-for", "," * 100_000)), "10.0.0.2"),
        # Every hop a trusted proxy: the leftmost hop read.
        ("10.0.0.0/8", scope("10.0.0.2", ("x-forwarded-for", "10.0.0.9, 10.0.0.8")), "10.0.0.9"),
        ("10.0.0.0/8", {"headers": []}, ""),
    ],
)
def test_trusted_proxies_name_the_client(trusted: str, request_scope: dict, expected: str) -> None:
    assert TrustedProxies.parse(trusted).client_ip(request_scope) == expected


def test_a_long_chain_of_trusted_hops_is_read_only_so_far() -> None:
    hops = ", ".join(["203.0.113.9"] + ["10.0.0.1"] * (MAX_HOPS + 5))
    got = TrustedProxies.parse("10.0.0.0/8").client_ip(scope("10.0.0.2", ("x-forwarded-for", hops)))
    assert got == "10.0.0.1"


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "proxy.internal", "10.0.0.0/8,,x"])
def test_a_bad_trusted_proxy_entry_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="--trusted-proxies"):
        TrustedProxies.parse(bad)


def audit_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_live_router_audits_every_call_as_upstream(fleet: Fleet, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    router = fleet.router(
        "--trusted-proxies", "127.0.0.0/8", env={"HIVENET_ROUTER_AUDIT_LOG_PATH": str(audit)}
    )
    fleet.agent(router, "m1")
    proxied = {"X-Forwarded-For": "198.51.100.23"}
    chat = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers=proxied,
        timeout=30,
    )
    assert chat.status_code == 200
    models = httpx.get(router.url + "/v1/models", timeout=10)
    missing = httpx.get(router.url + "/v1/models/nope", timeout=10)
    table = httpx.get(router.url + "/admin/routing-table", headers=ADMIN, timeout=10)
    refused = httpx.get(router.url + "/admin/routing-table", timeout=10)
    ids = [r.headers["x-request-id"] for r in (chat, models, missing, table, refused)]
    wait_until(lambda: set(ids) <= {x["request_id"] for x in audit_lines(audit)}, what="lines")
    lines = {x["request_id"]: x for x in audit_lines(audit)}
    for line in lines.values():
        check_upstream_shape(line)
    served, listed, absent, read, unauthorized = (lines[i] for i in ids)
    assert served["source_ip"] == "198.51.100.23"  # the trusted proxy's header
    assert served["model"] == "m1" and served["agent_id"].startswith("12D3Koo")
    assert served["output_tokens"] > 0 and served["tenant_id"] == "default"
    assert listed["status_code"] == 200 and listed["source_ip"] == "127.0.0.1"
    assert (absent["status_code"], absent["error_code"]) == (404, "model_not_found")
    assert read["kind"] == "admin" and read["target"] == "/admin/routing-table"
    assert read["key_id"].startswith("admin-") and read["level"] == "info"
    assert (unauthorized["status_code"], unauthorized["error_code"]) == (401, "unauthorized")
    assert unauthorized["level"] == "error" and unauthorized["key_id"] == ""


def test_an_unopenable_audit_path_keeps_the_router_serving(fleet: Fleet, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    router = fleet.router(env={"HIVENET_ROUTER_AUDIT_LOG_PATH": str(blocker / "audit.jsonl")})
    assert router.log().count("audit_log_unopenable") == 1
    models = httpx.get(router.url + "/v1/models", timeout=10)
    assert models.status_code == 200
    rid = models.headers["x-request-id"]

    def stdout_line() -> dict | None:
        for text in router.log().splitlines():
            if text.startswith("{") and rid in text:
                return json.loads(text)
        return None

    line = wait_until(stdout_line, what="the audit line on stdout")
    check_upstream_shape(line)
