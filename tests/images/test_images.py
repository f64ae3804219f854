"""The built images, run (opt-in: `scripts/test --images`; scripts/images builds them).

Each container runs through `buildah run --isolation chroot`: the image's own root
filesystem, user and PATH, on the host's network, without a container runtime (which
this sandbox refuses). The stack is deploy/compose.yaml's: the `router-identity`
command, the router with the image's CMD (ports moved to free ones), and two agents
through the agent image's entrypoint with the compose file's arguments.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fleet import ADMIN_KEY, SECRET, Proc, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
COMPOSE = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())
SERVICES = COMPOSE["services"]
ROUTER_IMAGE = SERVICES["router"]["image"]
AGENT_IMAGE = SERVICES["agent-1"]["image"]
HIVENET_UID = "999"


class Container:
    """A buildah working container of an image; removed on close."""

    def __init__(self, image: str) -> None:
        out = subprocess.run(["buildah", "from", image], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        self.name = out.stdout.strip()

    def argv(self, command: list[str], mounts: dict[Path, str]) -> list[str]:
        argv = ["buildah", "run", "--isolation", "chroot"]
        for host, target in mounts.items():
            argv += ["-v", f"{host}:{target}"]
        return [*argv, self.name, "--", *command]

    def run(self, command: list[str], mounts: dict[Path, str] | None = None) -> str:
        out = subprocess.run(
            self.argv(command, mounts or {}), capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, f"{command}: {out.stdout}{out.stderr}"
        return out.stdout

    def close(self) -> None:
        subprocess.run(["buildah", "rm", self.name], capture_output=True)


class ContainerProc(Proc):
    """A daemon in a container. buildah does not pass signals on, so its group gets them."""

    def start(self) -> ContainerProc:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        return self.popen.returncode


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    made: list[Container] = []
    try:
        yield made
    finally:
        for c in made:
            c.close()


@pytest.fixture
def procs() -> Iterator[list[ContainerProc]]:
    started: list[ContainerProc] = []
    try:
        yield started
    finally:
        for p in reversed(started):
            p.stop()


def image_config(image: str) -> dict:
    out = subprocess.run(
        ["podman", "image", "inspect", image], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)[0]["Config"]


def test_images_run_as_hivenet_with_their_entry_points(containers: list[Container]) -> None:
    router = image_config(ROUTER_IMAGE)
    assert router["Entrypoint"] == ["hivenet-router"]
    assert router["Cmd"][0] == "serve"
    assert set(router["ExposedPorts"]) == {"8080/tcp", "2112/tcp", "9000/tcp"}
    agent = image_config(AGENT_IMAGE)
    assert agent["Entrypoint"] == ["hivenet-agent"]
    for image, script in ((ROUTER_IMAGE, "hivenet-router"), (AGENT_IMAGE, "hivenet-agent")):
        c = Container(image)
        containers.append(c)
        assert c.run(["id", "-u"]).strip() == HIVENET_UID
        assert "usage: " + script in c.run([script, "--help"])
        # Only the finished venv is shipped: no compiler in the image.
        c.run(["sh", "-c", "! command -v gcc"])
    containers[1].run(["test", "-x", "/usr/local/bin/hivenet-agent-entrypoint"])


def test_the_compose_stack_runs_in_the_images(
    tmp_path: Path, containers: list[Container], procs: list[ContainerProc]
) -> None:
    state, peer = tmp_path / "router-state", tmp_path / "router-peer"
    for d in (state, peer):
        d.mkdir()
        os.chown(d, int(HIVENET_UID), int(HIVENET_UID))
    secret = tmp_path / "jwt_secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o644)
    secret_target = "/run/secrets/jwt_secret"

    router_c = Container(ROUTER_IMAGE)
    containers.append(router_c)
    router_mounts = {state: "/var/lib/hivenet/router", peer: "/var/lib/hivenet/peer"}
    router_c.run(["/bin/sh", "-c", *SERVICES["router-identity"]["command"]], router_mounts)
    peer_id = (peer / "router-peer-id").read_text().strip()
    assert peer_id.startswith("12D3KooW")

    http, metrics, p2p = free_port(), free_port(), free_port()
    ports = {":8080": f"127.0.0.1:{http}", ":2112": f"127.0.0.1:{metrics}", "9000": str(p2p)}
    cmd = [ports.get(word, word) for word in image_config(ROUTER_IMAGE)["Cmd"]]
    argv = router_c.argv(
        ["env", f"HIVENET_ROUTER_ADMIN_API_KEYS={ADMIN_KEY}", "hivenet-router", *cmd],
        {state: "/var/lib/hivenet/router", secret: secret_target},
    )
    router = ContainerProc("router", argv, {}, tmp_path / "router.log").start()
    procs.append(router)
    router.wait_log("router_ready", 60)
    url = f"http://127.0.0.1:{http}"

    for name in ("agent-1", "agent-2"):
        c = Container(AGENT_IMAGE)
        containers.append(c)
        agent_state = tmp_path / f"{name}-state"
        agent_state.mkdir()
        os.chown(agent_state, int(HIVENET_UID), int(HIVENET_UID))
        env = ["HIVENET_ROUTER_HOST=localhost", f"HIVENET_ROUTER_P2P_PORT={p2p}"]
        command = ["env", *env, *SERVICES[name]["entrypoint"], *SERVICES[name]["command"]]
        mounts = {
            peer: "/var/lib/hivenet/peer",
            agent_state: "/var/lib/hivenet/agent",
            secret: secret_target,
        }
        procs.append(ContainerProc(name, c.argv(command, mounts), {}, tmp_path / f"{name}.log"))
        procs[-1].start()

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def both_healthy() -> bool:
        table = httpx.get(url + "/admin/routing-table", headers=admin, timeout=5).json()
        agents = table["agents"]
        return len(agents) == 2 and all(a["status"]["healthy"] for a in agents)

    wait_until(both_healthy, 60, "both agents in the images healthy")
    model = SERVICES["agent-1"]["command"][SERVICES["agent-1"]["command"].index("--model") + 1]
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    scrape = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
    assert "hivenet_router_agents_healthy 2.0" in scrape
