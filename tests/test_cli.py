"""`hivenet-router identity` and `hivenet-router token`, and both commands' defaults, as
INTERFACE.md names them."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import jwt
import pytest

from agent.cli import build_parser as agent_parser
from agent.cli import upstream_values
from router.cli import build_parser as router_parser
from router.cli import settings_from
from router.fleet.shared_port import bind_shared
from tests.fleet import SECRET, VENV_BIN, free_port

ROUTER = str(VENV_BIN / "hivenet-router")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ROUTER, *args], capture_output=True, text=True, timeout=60, env=env or dict(os.environ)
    )


def test_identity_creates_a_private_key_once_and_prints_a_stable_peer_id(tmp_path: Path) -> None:
    key = tmp_path / "state" / "router_identity.key"
    first = run("identity", "--identity-path", str(key), "--p2p-port", "9123")
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    peer_line, addr_line = first.stdout.strip().splitlines()
    peer_id = peer_line.removeprefix("peer_id: ")
    assert peer_id.startswith("12D3KooW")
    assert addr_line == f"/ip4/127.0.0.1/tcp/9123/p2p/{peer_id}"
    again = run("identity", "--identity-path", str(key), "--p2p-port", "9123")
    assert again.stdout == first.stdout
    announced = run(
        "identity", "--identity-path", str(key), "--p2p-announce-addr", "/ip4/203.0.113.7/tcp/9000"
    )
    assert f"/ip4/203.0.113.7/tcp/9000/p2p/{peer_id}" in announced.stdout.splitlines()


def test_an_announce_address_that_is_no_multiaddr_stops_the_router(tmp_path: Path) -> None:
    """Upstream: an invalid announce value stops router startup; `identity` and
    `serve` (one check for both) say why and exit 2."""
    key = str(tmp_path / "router_identity.key")
    env = {**os.environ, "HIVENET_ROUTER_JWT_SECRET": SECRET, "HIVENET_ROUTER_ADMIN_API_KEYS": "k"}
    some_peer = "12D3KooWGQaEXi5zdK6sv4u1rjM8EQrfH3GnjJb8GrmyrXrU2yZ8"
    for command, bad, why in (
        ("identity", "not-a-multiaddr", "is not a multiaddr"),
        ("identity", "/ip4/203.0.113.7/tcp/port", "is not a multiaddr"),
        ("identity", f"/ip4/203.0.113.7/tcp/9000/p2p/{some_peer}", "leave out /p2p/"),
        ("serve", "not-a-multiaddr", "is not a multiaddr"),
    ):
        out = run(command, "--identity-path", key, "--p2p-announce-addr", bad, env=env)
        assert out.returncode == 2, (command, bad, out.stdout, out.stderr)
        assert "--p2p-announce-addr" in out.stderr and why in out.stderr, out.stderr
    dns = run("identity", "--identity-path", key, "--p2p-announce-addr", "/dns4/r.example/tcp/9")
    peer_id = dns.stdout.splitlines()[0].removeprefix("peer_id: ")
    assert dns.returncode == 0 and f"/dns4/r.example/tcp/9/p2p/{peer_id}" in dns.stdout


def test_token_is_an_hs256_jwt_for_the_peer_with_the_ttl(tmp_path: Path) -> None:
    env = {**os.environ, "HIVENET_ROUTER_JWT_SECRET": SECRET}
    out = run("token", "--peer-id", "12D3KooWexample", "--ttl", "2h", env=env)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert jwt.get_unverified_header(token)["alg"] == "HS256"
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert claims["sub"] == "12D3KooWexample"
    assert abs(claims["exp"] - time.time() - 7200) < 60
    # The file wins over the environment.
    secret_file = tmp_path / "secret"
    secret_file.write_text("f" * 40 + "\n")
    from_file = run("token", "--peer-id", "p", "--jwt-secret-file", str(secret_file), env=env)
    jwt.decode(from_file.stdout.strip(), "f" * 40, algorithms=["HS256"])


def test_token_without_a_usable_secret_is_a_clear_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HIVENET_ROUTER_JWT_SECRET"}
    missing = run("token", "--peer-id", "p", env=env)
    assert missing.returncode == 2
    assert "JWT secret is required" in missing.stderr
    short = run("token", "--peer-id", "p", env={**env, "HIVENET_ROUTER_JWT_SECRET": "short"})
    assert short.returncode == 2
    assert "at least 32" in short.stderr


@pytest.mark.parametrize("which", ["--p2p-port", "--p2p-ws-port"])
def test_a_router_whose_agent_port_is_taken_stops_and_says_so(tmp_path: Path, which: str) -> None:
    """py-libp2p starts the listeners it can and keeps quiet about the rest: with its
    agent port taken the router used to log router_listening and router_ready, and no
    agent could reach it."""
    env = {**os.environ, "HIVENET_ROUTER_JWT_SECRET": SECRET, "HIVENET_ROUTER_ADMIN_API_KEYS": "k"}
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = {"--p2p-port": str(free_port()), "--p2p-ws-port": str(free_port())}
        ports[which] = str(taken)
        out = run(
            "serve",
            *("--identity-path", str(tmp_path / "k"), "--http-port", f"127.0.0.1:{free_port()}"),
            *("--metrics-port", f"127.0.0.1:{free_port()}"),
            *(item for flag, port in ports.items() for item in (flag, port)),
            env=env,
        )
    assert out.returncode != 0
    log = out.stdout + out.stderr
    assert f"cannot listen for agents on /ip4/127.0.0.1/tcp/{taken}" in log, log[-2000:]
    assert "Address already in use" in log
    assert "router_ready" not in log


def test_serve_defaults_are_interface_md_s(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("HIVENET_ROUTER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "k")
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", SECRET)
    s = settings_from(router_parser().parse_args(["serve"]))
    assert (s.http_addr[1], s.metrics_addr[1], s.p2p_port) == (8080, 2112, 9000)
    assert (s.p2p_listen_addr, s.p2p_announce_addr) == ("127.0.0.1", None)
    assert (s.identity_path, s.policy_file) == ("./router_identity.key", None)
    assert (s.max_tries_per_step, s.queue_depth, s.request_timeout) == (3, 30, 60.0)
    assert (s.heartbeat_interval, s.unhealthy_after, s.remove_after) == (5.0, 15.0, 30.0)


def test_agent_defaults_are_interface_md_s() -> None:
    args = agent_parser().parse_args(["--router", "/ip4/127.0.0.1/tcp/9000/p2p/x"])
    assert (args.model, args.capacity, args.capability, args.engine) == ("", 10, "llm", "vllm")
    assert (args.region, args.organization, args.machine) == ("", "", socket.gethostname())
    assert args.identity_path == "./agent_identity.key"
    assert (args.engine_sample_interval, args.hardware_sample_interval) == (0.5, 2.0)
    assert (args.http_timeout, args.stream_write_timeout) == (120.0, 60.0)
    values = upstream_values(args, {})
    assert (values["tags"], values["heartbeat_interval"]) == (["production"], 5.0)


def test_the_drain_and_health_flags_refuse_what_makes_no_sense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HIVENET_ROUTER_JWT_SECRET", SECRET)
    monkeypatch.setenv("HIVENET_ROUTER_ADMIN_API_KEYS", "k")
    monkeypatch.delenv("HIVENET_ROUTER_DRAIN_DELAY", raising=False)
    default = settings_from(router_parser().parse_args(["serve"]))
    assert (default.drain_delay, default.drain_timeout, default.health_min_agents) == (5, 30, 0)
    monkeypatch.setenv("HIVENET_ROUTER_DRAIN_DELAY", "1500ms")
    monkeypatch.setenv("HIVENET_ROUTER_HEALTH_MIN_AGENTS", "2")
    from_env = settings_from(router_parser().parse_args(["serve"]))
    assert (from_env.drain_delay, from_env.health_min_agents) == (1.5, 2)
    with pytest.raises(SystemExit):  # argparse: not a duration
        router_parser().parse_args(["serve", "--drain-delay", "-1s"])
    with pytest.raises(ValueError, match="--health-min-agents must be at least 0"):
        settings_from(router_parser().parse_args(["serve", "--health-min-agents", "-1"]))
    # The supervisor's sockets, which only it passes: anything else is refused at start.
    with open(os.devnull, "rb") as not_a_socket:
        for fd in (not_a_socket.fileno(), 100_000, -1, 2**70):
            for flag in ("--supervisor-fd", "--listen-fd"):
                with pytest.raises(ValueError, match="is not an open socket"):
                    settings_from(router_parser().parse_args(["serve", flag, str(fd)]))
    a, b = socket.socketpair()
    with a, b:
        args = router_parser().parse_args(["serve", "--supervisor-fd", str(a.fileno())])
        assert settings_from(args).supervisor_fd == a.fileno()
    # The worker's share of the HTTP port: it serves the port the supervisor bound.
    (shared,) = bind_shared(("127.0.0.1", 0), 1)
    with shared:
        args = router_parser().parse_args(["serve", "--listen-fd", str(shared.fileno())])
        assert settings_from(args).http_addr[1] == shared.getsockname()[1]


def test_an_infinity_agent_must_name_its_capability(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main as agent_main

    router = "/ip4/127.0.0.1/tcp/9000/p2p/x"
    assert agent_main(["--router", router, "--engine", "infinity"]) == 2
    assert "--capability embedding or reranker" in capsys.readouterr().err
