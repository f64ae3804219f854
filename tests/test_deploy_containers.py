"""deploy/compose.yaml and deploy/containers/: the files agree with each other and run.

No container runs here (the sandbox refuses them; `scripts/images` builds the images
and runs them through buildah's chroot isolation, opt-in). So this file checks
statically that the compose file, the Containerfiles, the Prometheus and Grafana
provisioning and INTERFACE.md name the same services, ports, paths and flags, that
the daemons' own argument parsers accept the commands the files give them, and then
runs the compose file's wiring for real on this host: its `router-identity` command
makes the key and the peer-ID file, a router serves with that key, and two agents
started through deploy/containers/agent-entrypoint, with the compose file's arguments
and the JWT secret from a file only, join it and answer a request.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import httpx
import yaml

from agent.cli import build_parser as agent_parser
from protocol.p2p import load_or_create_identity, peer_id_of
from router.cli import build_parser as router_parser
from router.cli import settings_from
from tests.fleet import ADMIN_KEY, SECRET, VENV_BIN, Fleet, Proc, wait_until

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
SECRET_TARGET = "/run/secrets/jwt_secret"


@dataclass(frozen=True)
class Containerfile:
    """The instructions of a Containerfile, continuation lines joined."""

    instructions: list[tuple[str, str]]

    @classmethod
    def read(cls, name: str) -> Containerfile:
        text = (DEPLOY / "containers" / name).read_text()
        text = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
        out = []
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                word, _, rest = line.partition(" ")
                out.append((word.upper(), rest.strip()))
        return cls(out)

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]

    def json(self, word: str) -> list[str]:
        (value,) = self.all(word)
        return json.loads(value)

    def final_stage(self) -> Containerfile:
        starts = [i for i, (w, _) in enumerate(self.instructions) if w == "FROM"]
        return Containerfile(self.instructions[starts[-1] :])


ROUTER_IMAGE = Containerfile.read("router.Containerfile")
AGENT_IMAGE = Containerfile.read("agent.Containerfile")


def interface_default(flag: str) -> str:
    """The router's own default for a port flag (INTERFACE.md's: `:8080`, `:2112`, `9000`);
    a flag whose variable twin may set it parses to None and is resolved as `serve` does."""
    parsed = vars(router_parser().parse_args(["serve"]))[flag.lstrip("-").replace("-", "_")]
    if parsed is not None:
        return str(parsed)
    env = {"HIVENET_ROUTER_ADMIN_API_KEYS": "k", "HIVENET_ROUTER_JWT_SECRET": "s" * 32}
    with mock.patch.dict(os.environ, env):
        settings = settings_from(router_parser().parse_args(["serve"]))
    return str(getattr(settings, flag.lstrip("-").replace("-", "_")))


def published(service: str) -> dict[int, str]:
    """Container port → the host address it is published on ('' for every interface)."""
    out = {}
    for spec in SERVICES[service].get("ports", []):
        parts = spec.split(":")
        out[int(parts[-1])] = parts[0] if len(parts) == 3 else ""
    return out


def volume_mounts(service: str) -> dict[str, tuple[str, bool]]:
    """Target → (source, read-only) of a service's volumes."""
    out = {}
    for spec in SERVICES[service].get("volumes", []):
        source, target, *mode = spec.split(":")
        out[target] = (source, mode == ["ro"])
    return out


def agent_services() -> list[str]:
    return [name for name in SERVICES if name.startswith("agent-")]


def agent_args(service: str) -> argparse.Namespace:
    """The agent's parsed arguments; the entry point adds --router."""
    return agent_parser().parse_args([*SERVICES[service]["command"], "--router", "x"])


# --- static ----------------------------------------------------------------------------


def test_compose_runs_a_router_two_sim_agents_prometheus_and_grafana() -> None:
    assert set(SERVICES) == {
        "router-identity",
        "router",
        "agent-1",
        "agent-2",
        "prometheus",
        "grafana",
    }
    for name in agent_services():
        args = agent_args(name)
        assert args.engine == "sim"
        assert args.jwt_secret_file == SECRET_TARGET
        assert SERVICES[name]["secrets"] == ["jwt_secret"]
    assert len({agent_args(name).machine for name in agent_services()}) == 2


def test_bind_mounts_name_files_of_this_checkout_and_named_volumes_are_declared() -> None:
    declared = set(COMPOSE["volumes"])
    used = set()
    for name in SERVICES:
        for source, _ in volume_mounts(name).values():
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared
    secret = COMPOSE["secrets"]["jwt_secret"]["file"]
    # The secret is the operator's, never committed.
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(DEPLOY / secret)], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0, f"deploy/{secret} must be in .gitignore"


def test_router_ports_are_interface_md_defaults_and_only_http_and_p2p_are_public() -> None:
    cmd = ROUTER_IMAGE.final_stage().json("CMD")
    args = router_parser().parse_args(cmd)
    assert args.http_port == interface_default("--http-port") == ":8080"
    assert args.metrics_port == interface_default("--metrics-port") == ":2112"
    assert str(args.p2p_port) == interface_default("--p2p-port") == "9000"
    assert args.p2p_listen_addr == "0.0.0.0"
    assert args.jwt_secret_file == SECRET_TARGET
    exposed = {int(p) for p in " ".join(ROUTER_IMAGE.final_stage().all("EXPOSE")).split()}
    assert exposed == {8080, 2112, 9000}
    assert published("router") == {8080: "", 9000: "", 2112: "127.0.0.1"}
    for name in ("prometheus", "grafana"):
        assert set(published(name).values()) == {"127.0.0.1"}, name
    assert SERVICES["router"]["secrets"] == ["jwt_secret"]
    admin = SERVICES["router"]["environment"]["HIVENET_ROUTER_ADMIN_API_KEYS"]
    assert admin.startswith("${HIVENET_ROUTER_ADMIN_API_KEYS:?"), "no default admin key"


def test_router_identity_feeds_the_router_and_the_agents_the_same_paths() -> None:
    identity = SERVICES["router-identity"]
    script = identity["command"][0]
    key = router_parser().parse_args(ROUTER_IMAGE.final_stage().json("CMD")).identity_path
    assert f"--identity-path {key}" in script
    peer_file = re.search(r"> (\S+)", script).group(1)
    state = volume_mounts("router")
    assert (
        state[str(Path(key).parent)][0]
        == volume_mounts("router-identity")[str(Path(key).parent)][0]
    )
    peer_dir = str(Path(peer_file).parent)
    assert volume_mounts("router-identity")[peer_dir][1] is False
    entrypoint = (DEPLOY / "containers/agent-entrypoint").read_text()
    assert f"HIVENET_ROUTER_PEER_ID_FILE:-{peer_file}" in entrypoint
    assert "HIVENET_ROUTER_P2P_PORT:-9000" in entrypoint
    assert "HIVENET_ROUTER_HOST:-router" in entrypoint
    for name in agent_services():
        source, read_only = volume_mounts(name)[peer_dir]
        assert source == volume_mounts("router-identity")[peer_dir][0] and read_only
        # The router's key stays with the router: agents get the peer ID only.
        assert str(Path(key).parent) not in volume_mounts(name)
        depends = SERVICES[name]["depends_on"]
        assert "router" in depends
    assert SERVICES["router"]["depends_on"]["router-identity"]["condition"] == (
        "service_completed_successfully"
    )


def test_prometheus_scrapes_the_router_and_loads_the_rules() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (target,) = jobs["hivenet-router"]["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "router" and f":{port}" == interface_default("--metrics-port")
    mounts = volume_mounts("prometheus")
    (rules_glob,) = config["rule_files"]
    assert mounts[str(Path(rules_glob).parent)] == ("./prometheus/rules", True)
    assert mounts["/etc/prometheus/prometheus.yml"] == ("./prometheus/prometheus.yml", True)
    assert "--config.file=/etc/prometheus/prometheus.yml" in SERVICES["prometheus"]["command"]


def test_grafana_provisions_the_datasource_and_the_dashboards() -> None:
    mounts = volume_mounts("grafana")
    assert mounts["/etc/grafana/provisioning"] == ("./grafana/provisioning", True)
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/hivenet.yml").read_text())[
        "providers"
    ][0]
    assert mounts[provider["options"]["path"]] == ("./grafana/dashboards", True)
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert source["url"] == "http://prometheus:9090"
    assert 9090 in published("prometheus")


def test_images_install_the_console_scripts_the_files_run() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert ROUTER_IMAGE.final_stage().json("ENTRYPOINT") == ["hivenet-router"]
    assert AGENT_IMAGE.final_stage().json("ENTRYPOINT") == ["hivenet-agent"]
    assert {"hivenet-router", "hivenet-agent"} <= set(scripts)
    for image in (ROUTER_IMAGE, AGENT_IMAGE):
        final = image.final_stage()
        assert final.all("USER") == ["hivenet"]
        env = " ".join(final.all("ENV"))
        assert "PATH=/opt/hivenet/venv/bin:" in env
        assert "COPY --from=build /opt/hivenet/venv /opt/hivenet/venv" in [
            "COPY " + c for c in final.all("COPY")
        ]
    copied = [c.split()[0] for c in AGENT_IMAGE.final_stage().all("COPY") if "--from" not in c]
    assert copied == ["deploy/containers/agent-entrypoint"]
    assert os.access(DEPLOY / "containers/agent-entrypoint", os.X_OK)
    for name in agent_services():
        assert SERVICES[name]["entrypoint"] == ["hivenet-agent-entrypoint"]
    assert "/usr/local/bin/hivenet-agent-entrypoint" in AGENT_IMAGE.final_stage().all("COPY")[-1]


def test_the_build_context_keeps_what_the_images_need() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        return any(
            fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns
        )

    needed = ["pyproject.toml", "README.md", "LICENSE", "deploy/containers/agent-entrypoint"]
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    needed += [p.rstrip("*") + "/__init__.py" for p in packages]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not ignored(path), f".dockerignore drops {path}, which the build needs"
    assert ignored(".venv") and ignored(".git") and ignored("router_identity.key")


# --- the wiring, run on this host ---------------------------------------------------------


def compose_command(service: str, paths: dict[str, Path]) -> list[str]:
    """The service's command with its container paths moved under this test's directory."""
    words = []
    for word in SERVICES[service]["command"]:
        for container, host in paths.items():
            word = word.replace(container, str(host))
        words.append(word)
    return words


def test_compose_wiring_router_identity_entrypoint_and_two_agents(fleet: Fleet) -> None:
    root = fleet.dir
    paths = {
        "/var/lib/hivenet/router": root / "router-state",
        "/var/lib/hivenet/peer": root / "router-peer",
        SECRET_TARGET: root / "jwt_secret",
    }
    for d in ("router-state", "router-peer"):
        (root / d).mkdir()
    (root / "jwt_secret").write_text(SECRET + "\n")
    env = {**fleet.env, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    env.pop("HIVENET_ROUTER_JWT_SECRET")

    (script,) = compose_command("router-identity", paths)
    assert SERVICES["router-identity"]["entrypoint"] == ["/bin/sh", "-c"]
    subprocess.run(["/bin/sh", "-c", script], env=env, check=True, timeout=60)
    key = root / "router-state/identity.key"
    peer_id = (root / "router-peer/router-peer-id").read_text().strip()
    assert peer_id == str(peer_id_of(load_or_create_identity(key)))
    # Run again, as compose does on every `up`: the key and the peer ID stay.
    subprocess.run(["/bin/sh", "-c", script], env=env, check=True, timeout=60)
    assert (root / "router-peer/router-peer-id").read_text().strip() == peer_id

    router = fleet.router(start=False)
    router.argv[router.argv.index("--identity-path") + 1] = str(key)
    router.argv += ["--jwt-secret-file", str(paths[SECRET_TARGET])]
    router.peer_id = peer_id
    router.env = env
    router.start()

    agents = []
    for name in agent_services():
        state = root / f"{name}-state"
        state.mkdir()
        argv = ["/bin/sh", str(DEPLOY / "containers/agent-entrypoint")]
        argv += compose_command(name, {**paths, "/var/lib/hivenet/agent": state})
        agent_env = {
            **env,
            "HIVENET_ROUTER_HOST": "localhost",
            "HIVENET_ROUTER_P2P_PORT": str(router.p2p_port),
            "HIVENET_ROUTER_PEER_ID_FILE": str(root / "router-peer/router-peer-id"),
        }
        proc = Proc(name, argv, agent_env, root / f"{name}.log")
        fleet.procs.append(proc)
        agents.append(proc.start())
    model = agent_args("agent-1").model

    def both_healthy() -> bool:
        table = router.agents()
        return len(table) == 2 and all(a["status"]["healthy"] for a in table)

    wait_until(both_healthy, 30, "both compose agents healthy")
    assert {a["metadata"]["machine"] for a in router.agents()} == {"agent-1", "agent-2"}
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert router.metric("hivenet_router_agents_healthy") == 2
    assert (
        httpx.get(
            router.url + "/admin/health", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).json()["healthy_agents"]
        == 2
    )
    assert all(a.alive() for a in agents)


def test_agent_entrypoint_refuses_an_unresolvable_router_host(tmp_path: Path) -> None:
    peer = tmp_path / "peer-id"
    peer.write_text("12D3KooWKZ2NN7VepQcGXYvdZ3edLbRBg3FmVCmMLeeyYmwPMoC4\n")
    out = subprocess.run(
        ["/bin/sh", str(DEPLOY / "containers/agent-entrypoint"), "--model", "m"],
        env={
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
            "HIVENET_ROUTER_HOST": "no-such-host.invalid",
            "HIVENET_ROUTER_PEER_ID_FILE": str(peer),
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert "cannot resolve router host no-such-host.invalid" in out.stderr
