"""Every flag and variable of the Go router's configuration reference, router and agent:
accepted with its meaning, or refused with what to use instead (issue 19)."""

from __future__ import annotations

import argparse
import os

import pytest

from agent.cli import IGNORED as AGENT_IGNORED_TABLE
from agent.cli import build_parser as agent_parser
from agent.cli import main as agent_main
from agent.cli import router_from_grpc, upstream_values
from protocol.upstream_flags import ignored_warnings
from router.cli import IGNORED as ROUTER_IGNORED_TABLE
from router.cli import build_parser as router_parser
from router.cli import settings_from
from router.settings import DEFAULT_MAX_REQUEST_BYTES, UNLIMITED_REQUEST_BYTES

SECRET = "s" * 40
BASE_ENV = {"HIVENET_ROUTER_JWT_SECRET": SECRET, "HIVENET_ROUTER_ALLOW_INSECURE_ADMIN": "true"}


def serve(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], env: dict[str, str] | None = None
) -> object:
    for name in list(os.environ):
        if name.startswith("HIVENET_ROUTER_"):
            monkeypatch.delenv(name)
    for name, value in {**BASE_ENV, **(env or {})}.items():
        monkeypatch.setenv(name, value)
    args = router_parser().parse_args(["serve", *flags])
    return settings_from(args)


# (flags, environment, settings field, expected value)
ROUTER_ACCEPTED = [
    (["--http-port", "127.0.0.1:8081"], {}, "http_addr", ("127.0.0.1", 8081)),
    ([], {"HIVENET_ROUTER_HTTP_PORT": ":8082"}, "http_addr", ("0.0.0.0", 8082)),
    ([], {"HIVENET_ROUTER_METRICS_PORT": ":2113"}, "metrics_addr", ("0.0.0.0", 2113)),
    ([], {"HIVENET_ROUTER_P2P_PORT": "9100"}, "p2p_port", 9100),
    (["--p2p-listen-addr", "0.0.0.0"], {}, "p2p_listen_addr", "0.0.0.0"),
    (
        ["--p2p-announce-addr", "/dns4/r.example/tcp/9000"],
        {},
        "p2p_announce_addr",
        "/dns4/r.example/tcp/9000",
    ),
    (["--p2p-max-conns-per-ip", "64"], {}, "p2p_max_conns_per_ip", 64),
    ([], {"HIVENET_ROUTER_P2P_MAX_CONNS_PER_IP": "8"}, "p2p_max_conns_per_ip", 8),
    ([], {}, "p2p_max_conns_per_ip", 32),
    (["--policy-model-dir", "/etc/p"], {}, "policy_model_dir", "/etc/p"),
    ([], {"HIVENET_ROUTER_POLICY_MODEL_DIR": "/etc/q"}, "policy_model_dir", "/etc/q"),
    ([], {"HIVENET_ROUTER_MAX_TRIES_PER_STEP": "5"}, "max_tries_per_step", 5),
    (
        ["--max-tries-per-step", "2"],
        {"HIVENET_ROUTER_MAX_TRIES_PER_STEP": "5"},
        "max_tries_per_step",
        2,
    ),
    (["--queue-size", "7"], {}, "queue_size", 7),
    ([], {"HIVENET_ROUTER_QUEUE_SIZE": "9"}, "queue_size", 9),
    ([], {"HIVENET_ROUTER_QUEUE_DEPTH": "0"}, "queue_depth", 0),
    (["--max-concurrent", "50"], {}, "max_concurrent", 50),
    ([], {"HIVENET_ROUTER_REQUEST_TIMEOUT": "5m"}, "request_timeout", 300.0),
    (
        ["--request-timeout", "90s"],
        {"HIVENET_ROUTER_REQUEST_TIMEOUT": "5m"},
        "request_timeout",
        90.0,
    ),
    (["--health-check-interval", "5s"], {}, "health_check_interval", 5.0),
    (["--heartbeat-interval", "2s"], {}, "heartbeat_interval", 2.0),
    (["--unhealthy-after", "20s"], {}, "unhealthy_after", 20.0),
    (["--remove-after", "40s"], {}, "remove_after", 40.0),
    (["--auth-config-file", "/etc/a.yaml"], {}, "auth_file", "/etc/a.yaml"),
    ([], {"HIVENET_ROUTER_AUTH_CONFIG": "/etc/b.yaml"}, "auth_file", "/etc/b.yaml"),
    ([], {"HIVENET_ROUTER_AUTH_MODE": "none"}, "auth_mode", "none"),
    ([], {"HIVENET_ROUTER_QUOTA_BACKEND": "memory"}, "auth_mode", "none"),
    ([], {"HIVENET_ROUTER_AUDIT_LOG_PATH": "/var/log/a.jsonl"}, "audit_log", "/var/log/a.jsonl"),
    ([], {"HIVENET_ROUTER_MAX_REQUEST_BYTES": "0"}, "max_request_bytes", UNLIMITED_REQUEST_BYTES),
    ([], {"HIVENET_ROUTER_TRUSTED_PROXIES": "10.0.0.0/8"}, "trusted_proxies", "10.0.0.0/8"),
    (["--trusted-proxies", "::1,10.0.0.7"], {}, "trusted_proxies", "::1,10.0.0.7"),
    ([], {"HIVENET_ROUTER_METRICS_COMPAT": "upstream"}, "metrics_compat", "upstream"),
    (["--metrics-compat", "upstream"], {}, "metrics_compat", "upstream"),
    ([], {}, "metrics_compat", ""),
    ([], {"HIVENET_ROUTER_MAX_REQUEST_BYTES": "2048"}, "max_request_bytes", 2048),
    ([], {}, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
    ([], {"HIVENET_ROUTER_RPM_BURST_SECONDS": "10"}, "rpm_burst_seconds", 10),
    ([], {"HIVENET_ROUTER_ADMIN_API_KEYS": "a, b"}, "admin_api_keys", ["a", "b"]),
    (["--disk-db-path", "/var/lib/b"], {}, "disk_db_path", "/var/lib/b"),
    ([], {"HIVENET_ROUTER_DISK_DB_PATH": "/var/lib/c"}, "disk_db_path", "/var/lib/c"),
    (["--disk-db-ttl", "0"], {}, "disk_db_ttl", 0),
    (["--universal-flush-interval", "5s"], {}, "universal_flush_interval", 5.0),
    (["--disk-db-path", "/d", "--reset-disk-db"], {}, "reset_disk_db", True),
    ([], {"HIVENET_ROUTER_OPENAI_API_KEY": "sk-x"}, "openai_api_key", "sk-x"),
    ([], {"HIVENET_ROUTER_ANTHROPIC_API_KEY": "sk-y"}, "anthropic_api_key", "sk-y"),
    ([], {"HIVENET_ROUTER_JWT_SECRET": "t" * 32}, "jwt_secret", b"t" * 32),
]


@pytest.mark.parametrize(("flags", "env", "field", "expected"), ROUTER_ACCEPTED)
def test_router_accepts_the_go_routers_flags_and_variables(
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    env: dict[str, str],
    field: str,
    expected: object,
) -> None:
    assert getattr(serve(monkeypatch, flags, env), field) == expected


ROUTER_IGNORED = [
    (["--grpc-port", ":50051"], {}, "--grpc-port", "no gRPC port is opened"),
    (["--session-ttl", "1h"], {}, "--session-ttl", "hivenet-router token --ttl"),
    ([], {"HIVENET_ROUTER_GRPC_PORT": ":50051"}, "HIVENET_ROUTER_GRPC_PORT", "--p2p-port"),
    ([], {"HIVENET_ROUTER_SESSION_TTL": "1h"}, "HIVENET_ROUTER_SESSION_TTL", "JWT"),
]


@pytest.mark.parametrize(("flags", "env", "name", "instead"), ROUTER_IGNORED)
def test_router_go_only_flags_start_with_one_warning_each(
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    env: dict[str, str],
    name: str,
    instead: str,
) -> None:
    """Issue 47: the Go router's unit files start; each flag with no meaning here is
    named once, with what happens instead."""
    serve(monkeypatch, flags, env)  # no startup error
    args = router_parser().parse_args(["serve", *flags])
    lines = ignored_warnings(args, {**BASE_ENV, **env}, ROUTER_IGNORED_TABLE)
    assert len(lines) == 1
    assert lines[0].startswith(f"upstream_flag_ignored flag={name} ") and instead in lines[0]


ROUTER_BAD_ENV = [
    ({"HIVENET_ROUTER_REQUEST_TIMEOUT": "five minutes"}, "HIVENET_ROUTER_REQUEST_TIMEOUT="),
    ({"HIVENET_ROUTER_MAX_TRIES_PER_STEP": "three"}, "HIVENET_ROUTER_MAX_TRIES_PER_STEP="),
    ({"HIVENET_ROUTER_P2P_PORT": "nine"}, "HIVENET_ROUTER_P2P_PORT='nine'"),
    ({"HIVENET_ROUTER_TRUSTED_PROXIES": "proxy.lan"}, "--trusted-proxies: 'proxy.lan'"),
    ({"HIVENET_ROUTER_METRICS_COMPAT": "go"}, "HIVENET_ROUTER_METRICS_COMPAT='go'"),
    ({"HIVENET_ROUTER_MAX_TRIES_PER_STEP": "0"}, "--max-tries-per-step must be at least 1"),
    ({"HIVENET_ROUTER_QUEUE_DEPTH": "-1"}, "--queue-depth must be at least 0"),
    ({"HIVENET_ROUTER_QUEUE_SIZE": "0"}, "--queue-size must be at least 1"),
    ({"HIVENET_ROUTER_P2P_MAX_CONNS_PER_IP": "0"}, "--p2p-max-conns-per-ip must be at least 1"),
    ({"HIVENET_ROUTER_MAX_REQUEST_BYTES": "-5"}, "HIVENET_ROUTER_MAX_REQUEST_BYTES="),
    ({"HIVENET_ROUTER_MAX_REQUEST_BYTES": "10MB"}, "HIVENET_ROUTER_MAX_REQUEST_BYTES="),
    (
        {"HIVENET_ROUTER_AUTH_MODE": "dynamic", "HIVENET_ROUTER_ADMIN_API_KEYS": ""},
        "dynamic needs HIVENET_ROUTER_ADMIN_API_KEYS",
    ),
    (
        {"HIVENET_ROUTER_AUTH_MODE": "dynamic", "HIVENET_ROUTER_API_KEYS": "k:t"},
        "dynamic but HIVENET_ROUTER_API_KEYS is set",
    ),
    ({"HIVENET_ROUTER_AUTH_MODE": "open"}, "must be one of none, api-key"),
    ({"HIVENET_ROUTER_AUTH_MODE": "api-key"}, "needs keys"),
    ({"HIVENET_ROUTER_QUOTA_BACKEND": "badger"}, "--state-url"),
    ({"HIVENET_ROUTER_QUOTA_BACKEND": "etcd"}, "must be memory"),
    ({"HIVENET_ROUTER_RPM_BURST_SECONDS": "60"}, "from 0 to 59"),
    ({"HIVENET_ROUTER_ADMIT_FRACTION": "1.5"}, "must be greater than 0 and at most 1"),
    ({"HIVENET_ROUTER_ADMIT_FRACTION": "0"}, "HIVENET_ROUTER_ADMIT_FRACTION='0'"),
    ({"HIVENET_ROUTER_ADMIT_PARK_TIMEOUT": "soon"}, "HIVENET_ROUTER_ADMIT_PARK_TIMEOUT="),
]


@pytest.mark.parametrize(("env", "message"), ROUTER_BAD_ENV)
def test_router_invalid_values_are_startup_errors(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError) as failed:
        serve(monkeypatch, [], env)
    assert message in str(failed.value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--disk-db-ttl", "-1"], "--disk-db-ttl must be at least 0"),
        (["--universal-flush-interval", "0"], "must be positive"),
        (["--queue-size", "0"], "--queue-size must be at least 1"),
        (["--max-concurrent", "-1"], "--max-concurrent must be at least 0"),
        (["--health-check-interval", "0"], "must be positive"),
    ],
)
def test_router_invalid_flag_values_are_startup_errors(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], message: str
) -> None:
    with pytest.raises(ValueError) as failed:
        serve(monkeypatch, flags)
    assert message in str(failed.value)


@pytest.mark.parametrize(
    "flags",
    [
        ["--unhealthy-after", "5s"],  # not above the 5 s heartbeat
        ["--unhealthy-after", "40s"],  # past the 30 s removal
        ["--heartbeat-interval", "0"],
    ],
)
def test_inconsistent_liveness_timings_are_a_startup_error(
    monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    with pytest.raises(ValueError, match="--heartbeat-interval < --unhealthy-after"):
        serve(monkeypatch, flags)


def test_both_auth_flags_naming_different_files_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="keep one"):
        serve(monkeypatch, ["--auth-file", "/a.yaml", "--auth-config-file", "/b.yaml"])


def agent(args: list[str], env: dict[str, str] | None = None) -> dict[str, object]:
    parsed = agent_parser().parse_args(["--router", "/ip4/127.0.0.1/tcp/9000", *args])
    return {**vars(parsed), **upstream_values(parsed, env or {})}


AGENT_ACCEPTED = [
    ([], {}, "tags", ["production"]),
    (["--tags", "production,realtime"], {}, "tags", ["production", "realtime"]),
    (["--tags", "production, realtime"], {}, "tags", ["production", "realtime"]),
    (["--version", "1.4.2"], {}, "version", "1.4.2"),
    (
        ["--gpu-model", "NVIDIA H100"],
        {"HIVENET_ROUTER_GPU_MODEL": "A100"},
        "gpu_model",
        "NVIDIA H100",
    ),
    ([], {"HIVENET_ROUTER_GPU_MODEL": "A100"}, "gpu_model", "A100"),
    (["--deployment-id", "dep-1"], {}, "deployment_id", "dep-1"),
    ([], {"HIVENET_ROUTER_DEPLOYMENT_ID": "dep-2"}, "deployment_id", "dep-2"),
    (["--replica-id", "r-1"], {}, "replica_id", "r-1"),
    ([], {"HIVENET_ROUTER_REPLICA_ID": "r-2"}, "replica_id", "r-2"),
    (["--hide-llm"], {}, "hide_llm", True),
    (["--llm-pretty-name", "Balanced"], {}, "llm_pretty_name", "Balanced"),
    (["--llm-info", "Good balance"], {}, "llm_info", "Good balance"),
    (["--routing-signal-interval", "500ms"], {}, "heartbeat_interval", 0.5),
    ([], {}, "heartbeat_interval", 5.0),
    (["--capability", "embedding"], {}, "capability", "embedding"),
    (["--capacity", "20"], {}, "capacity", 20),
    (["--region", "EU-France"], {}, "region", "EU-France"),
    (["--organization", "Acme"], {}, "organization", "Acme"),
    (["--machine", "gpu-worker-1"], {}, "machine", "gpu-worker-1"),
    (["--engine-sample-interval", "250ms"], {}, "engine_sample_interval", 0.25),
    (["--hardware-sample-interval", "4s"], {}, "hardware_sample_interval", 4.0),
    (["--http-timeout", "30s"], {}, "http_timeout", 30.0),
    (["--stream-write-timeout", "0"], {}, "stream_write_timeout", 0.0),
    (["--identity-path", "/var/lib/a.key"], {}, "identity_path", "/var/lib/a.key"),
    (["--jwt-secret-file", "/etc/jwt"], {}, "jwt_secret_file", "/etc/jwt"),
]


@pytest.mark.parametrize(("flags", "env", "field", "expected"), AGENT_ACCEPTED)
def test_agent_accepts_the_go_agents_flags_and_variables(
    flags: list[str], env: dict[str, str], field: str, expected: object
) -> None:
    assert agent(flags, env)[field] == expected


@pytest.mark.parametrize(
    ("flags", "instead"),
    [
        (["--router-grpc", "router:50051"], "with --router it is unused"),
        (["--router-p2p", "/ip4/127.0.0.1/tcp/9000"], "unused, as in the Go agent"),
        (["--p2p-listen-port", "4001"], "listens on no port"),
    ],
)
def test_agent_go_only_flags_start_with_one_warning_each(flags: list[str], instead: str) -> None:
    parsed = agent_parser().parse_args(["--router", "/ip4/127.0.0.1/tcp/9000", *flags])
    lines = ignored_warnings(parsed, {}, AGENT_IGNORED_TABLE)
    assert len(lines) == 1
    assert lines[0].startswith(f"upstream_flag_ignored flag={flags[0]} ") and instead in lines[0]


@pytest.mark.parametrize(
    ("hostport", "dialed"),
    [
        ("192.168.1.100:50051", "/ip4/192.168.1.100/tcp/9000"),
        ("router.internal:50051", "/dns/router.internal/tcp/9000"),
        ("[2001:db8::1]:50051", "/ip6/2001:db8::1/tcp/9000"),
        ("localhost", "/dns/localhost/tcp/9000"),
    ],
)
def test_router_grpc_alone_dials_the_host_on_the_default_p2p_port(
    hostport: str, dialed: str
) -> None:
    assert router_from_grpc(hostport) == dialed


def test_agent_without_router_or_router_grpc_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_main(["--engine", "sim"])
    assert exited.value.code == 2
    assert "--router is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agent_main(["--router-grpc", ":50051"])
    assert "names no host" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tags", "production,,gpu"], "empty tag"),
        (["--heartbeat-interval", "1s", "--routing-signal-interval", "2s"], "keep one"),
        (["--heartbeat-interval", "0"], "must be positive"),
        (["--http-timeout", "0s"], "--http-timeout must be positive"),
        (["--capacity", "0"], "--capacity must be positive, not 0"),
        (["--capacity", "-3"], "--capacity must be positive, not -3"),
        (["--engine-sample-interval", "0ms"], "--engine-sample-interval must be positive"),
        (["--hardware-sample-interval", "0"], "--hardware-sample-interval must be positive"),
        (["--gpu-devices-file", "/nonexistent/gpus"], "--gpu-devices-file"),
    ],
)
def test_agent_invalid_values_are_startup_errors(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError) as failed:
        agent(flags)
    assert message in str(failed.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("GPU-1,GPU-2", {"GPU-1", "GPU-2"}),
        ("GPU-1\nGPU-2\n", {"GPU-1", "GPU-2"}),
        ("none\n", set()),
        ("", set()),
    ],
)
def test_gpu_devices_file(tmp_path: object, text: str, expected: set[str]) -> None:
    path = tmp_path / "gpus"  # type: ignore[operator]
    path.write_text(text)
    assert agent(["--gpu-devices-file", str(path)])["gpu_devices"] == expected


def test_every_flag_of_the_reference_is_known() -> None:
    """Each flag in the Go router's flag tables parses (accepted or ignored, never
    `unrecognized arguments`)."""
    router = {
        a
        for action in router_parser()._subparsers._group_actions  # type: ignore[union-attr]
        for a in action.choices["serve"]._option_string_actions
    }  # type: ignore[union-attr]
    agent_flags = set(agent_parser()._option_string_actions)
    assert isinstance(router_parser(), argparse.ArgumentParser)
    for flag in UPSTREAM_ROUTER_FLAGS:
        assert flag in router, flag
    for flag in UPSTREAM_AGENT_FLAGS:
        assert flag in agent_flags, flag


UPSTREAM_ROUTER_FLAGS = [
    "--http-port",
    "--grpc-port",
    "--metrics-port",
    "--p2p-port",
    "--p2p-listen-addr",
    "--p2p-announce-addr",
    "--p2p-max-conns-per-ip",
    "--queue-size",
    "--request-timeout",
    "--health-check-interval",
    "--unhealthy-after",
    "--remove-after",
    "--heartbeat-interval",
    "--disk-db-path",
    "--reset-disk-db",
    "--disk-db-ttl",
    "--universal-flush-interval",
    "--max-concurrent",
    "--policy-file",
    "--policy-model-dir",
    "--max-tries-per-step",
    "--queue-depth",
    "--session-ttl",
    "--jwt-secret-file",
    "--auth-config-file",
]
UPSTREAM_AGENT_FLAGS = [
    "--engine",
    "--backend-url",
    "--model",
    "--health-url",
    "--capacity",
    "--version",
    "--region",
    "--organization",
    "--machine",
    "--router-grpc",
    "--router-p2p",
    "--tags",
    "--http-timeout",
    "--stream-write-timeout",
    "--identity-path",
    "--p2p-listen-port",
    "--hardware-sample-interval",
    "--engine-sample-interval",
    "--routing-signal-interval",
    "--jwt-secret-file",
    "--gpu-devices-file",
    "--gpu-model",
    "--deployment-id",
    "--replica-id",
    "--capability",
    "--hide-llm",
    "--llm-pretty-name",
    "--llm-info",
]
