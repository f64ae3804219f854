"""The systemd units: `systemd-analyze verify`, and their exact ExecStart lines run here.

The units name /opt/hivenet/.venv/bin/..., which does not exist on a test machine, and
`verify` fails on an ExecStart binary it cannot find. So verify runs on a temporary copy
whose only change is that prefix, rewritten to this checkout's venv. The run test reads
the ExecStart lines from the unit files, expands them as systemd does (Environment=,
EnvironmentFile= taken from configs/*.env.example with test ports and secrets, %i, %S,
`${VAR}` as one word, `$VAR` split at spaces), starts them with a clean environment
and a NOTIFY_SOCKET the test listens on, and waits for READY=1 from the main process.
Where the kernel allows, the children also run with NoNewPrivileges and
MemoryDenyWriteExecute set, as the units ask.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from protocol.durations import parse_duration
from protocol.p2p import load_or_create_identity, peer_id_of
from tests.fleet import ADMIN_KEY, SECRET, VENV_BIN, free_port, free_ports, wait_until

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
CONFIGS = ROOT / "configs"
ROUTER_UNIT = UNITS / "hivenet-router.service"
AGENT_UNIT = UNITS / "hivenet-agent@.service"
INSTALL_ROOT = "/opt/hivenet/"
INSTALL_PREFIX = INSTALL_ROOT + ".venv/bin/"
AGENT_EXAMPLES = ("vllm", "sglang", "llamacpp", "ollama")


# --- reading units the way systemd does (the parts these units use) -------------------


@dataclass
class Unit:
    path: Path
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path) -> Unit:
        unit = cls(path)
        section = ""
        logical = ""
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not logical and (not line or line[0] in "#;"):
                continue
            if line.endswith("\\"):
                logical += line[:-1] + " "
                continue
            line, logical = logical + line, ""
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                unit.sections.setdefault(section, [])
                continue
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not a key=value line: {line!r}"
            unit.sections[section].append((key.strip(), value.strip()))
        return unit

    def values(self, key: str, section: str = "Service") -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]

    def value(self, key: str, section: str = "Service") -> str:
        found = self.values(key, section)
        assert found, f"{self.path.name}: no {key}= in [{section}]"
        return found[-1]

    def defaults(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for assignment in self.values("Environment"):
            for word in shlex.split(assignment):
                name, _, value = word.partition("=")
                env[name] = value
        return env


def read_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile=: KEY=value lines, comments, optional quotes."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), (path.name, line)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[name] = value
    return env


def write_env_file(source: Path, target: Path, overrides: dict[str, str]) -> dict[str, str]:
    """The example with some values replaced; each replaced key must be in the example."""
    example = read_env_file(source)
    missing = set(overrides) - set(example)
    assert not missing, f"{source.name} does not document {sorted(missing)}"
    lines = []
    for raw in source.read_text().splitlines():
        name = raw.partition("=")[0].strip()
        if not raw.lstrip().startswith("#") and name in overrides:
            raw = f'{name}="{overrides[name]}"'
        lines.append(raw)
    target.write_text("\n".join(lines) + "\n")
    return read_env_file(target)


def specifiers(text: str, instance: str, state_root: Path) -> str:
    def one(m: re.Match[str]) -> str:
        spec = m.group(1)
        if spec == "%":
            return "%"
        if spec == "i":
            return instance
        if spec == "S":
            return str(state_root)
        raise AssertionError(f"unit uses specifier %{spec}, which this test does not map")

    return re.sub(r"%(.)", one, text)


def expand_command(line: str, env: dict[str, str]) -> list[str]:
    """ExecStart= expansion: `$VAR` alone is split at whitespace, `${VAR}` is one word."""
    argv: list[str] = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            argv += env.get(whole.group(1), "").split()
            continue
        argv.append(
            re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word)
        )
    return argv


def braced_variables(line: str) -> set[str]:
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", line))


def to_checkout(argv: list[str]) -> list[str]:
    assert argv[0].startswith(INSTALL_PREFIX), argv[0]
    return [str(VENV_BIN / argv[0][len(INSTALL_PREFIX) :]), *argv[1:]]


# --- the systemd side the test plays: notify socket, sandbox bits ---------------------


class NotifySocket:
    """A unix datagram socket in the place of systemd's, with the sender's credentials."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages: list[tuple[int, dict[str, str]]] = []

    def wait_for(self, key: str, value: str, pid: int | None, timeout: float) -> dict[str, str]:
        """The first message from `pid` (None: any process) with key=value; earlier ones
        are kept."""
        deadline = time.monotonic() + timeout
        while True:
            for sender, fields in self.messages:
                if pid in (sender, None) and fields.get(key) == value:
                    self.messages.remove((sender, fields))
                    return fields
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key}={value} from pid {pid}: {self.messages}")
            self.sock.settimeout(left)
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            sender = -1
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    sender = struct.unpack("iII", payload[:12])[0]
            lines = data.decode().splitlines()
            self.messages.append(
                (sender, dict(line.split("=", 1) for line in lines if "=" in line))
            )

    def close(self) -> None:
        self.sock.close()


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NO_NEW_PRIVS = 38
PR_SET_MDWE = 65
PR_GET_MDWE = 66
PR_MDWE_REFUSE_EXEC_GAIN = 1


def mdwe_supported() -> bool:
    """PR_SET_MDWE (Linux 6.3+): the kernel's own MemoryDenyWriteExecute."""
    return _libc.prctl(PR_GET_MDWE, 0, 0, 0, 0) >= 0


def sandbox_for(unit: Unit) -> tuple[object, list[str]]:
    """A preexec_fn applying what of the unit's sandbox a process can apply to itself."""
    flags = []
    if unit.value("NoNewPrivileges") == "yes":
        flags.append("NoNewPrivileges")
    if unit.value("MemoryDenyWriteExecute") == "yes" and mdwe_supported():
        flags.append("MemoryDenyWriteExecute")

    def apply() -> None:
        if "NoNewPrivileges" in flags and _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        if "MemoryDenyWriteExecute" in flags and _libc.prctl(
            PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0
        ):
            raise OSError(ctypes.get_errno(), "PR_SET_MDWE")

    return apply, flags


@dataclass
class Service:
    """One unit started the way systemd would start it."""

    unit: Unit
    instance: str
    env: dict[str, str]
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def start_service(
    unit: Unit, instance: str, env_file: Path, root: Path, notify: NotifySocket
) -> Service:
    state = root / "state"
    assert unit.value("EnvironmentFile").startswith("/etc/hivenet/")
    env = {**unit.defaults(), **read_env_file(env_file)}
    argv = to_checkout(expand_command(specifiers(unit.value("ExecStart"), instance, state), env))
    for directory in unit.values("StateDirectory"):  # systemd creates these before start
        (state / specifiers(directory, instance, state)).mkdir(parents=True, exist_ok=True)
    workdir = Path(specifiers(unit.value("WorkingDirectory"), instance, state))
    workdir = state / workdir.relative_to("/var/lib")
    name = unit.path.name.replace("@", f"@{instance}")
    log = root / f"{name}.log"
    preexec, _ = sandbox_for(unit)
    # systemd's environment for a service: the unit's, plus PATH and the notify socket.
    service_env = {**env, "PATH": "/usr/local/bin:/usr/bin:/bin", "NOTIFY_SOCKET": str(notify.path)}
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv,
            env=service_env,
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )
    return Service(unit, instance, env, argv, popen, log)


def stop_service(service: Service, notify: NotifySocket) -> int:
    """KillSignal=, then STOPPING=1 from the main process, then exit within TimeoutStopSec."""
    sig = signal.Signals[service.unit.value("KillSignal")]
    service.popen.send_signal(sig)
    notify.wait_for("STOPPING", "1", service.popen.pid, 10)
    return service.popen.wait(parse_duration(service.unit.value("TimeoutStopSec")))


@contextlib.contextmanager
def running(*services: Service) -> Iterator[None]:
    try:
        yield
    finally:
        for s in services:
            if s.popen.poll() is None:
                s.popen.kill()
                s.popen.wait(10)


# --- tests ----------------------------------------------------------------------------


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing in CI: scripts/setup installs it (systemd)")
        pytest.skip(
            "systemd-analyze is not installed (apt-get install systemd); scripts/setup installs it"
        )
    return path


def checkout_copies(directory: Path) -> list[Path]:
    """The units with only the install prefix rewritten to this checkout's venv."""
    copies = []
    for unit in (ROUTER_UNIT, AGENT_UNIT):
        text = unit.read_text()
        assert INSTALL_PREFIX in text
        copy = directory / unit.name
        copy.write_text(text.replace(INSTALL_PREFIX, f"{VENV_BIN}/"))
        copies.append(copy)
    return copies


def assert_units_verify(directory: Path, *names: str) -> None:
    """`systemd-analyze verify` on the checkout's copies of the units, as instance
    `names`: it exits 0 and says nothing about ours."""
    analyze = systemd_analyze()
    checkout_copies(directory)
    for name in names:
        r = subprocess.run(
            [analyze, "verify", "--man=no", f"./{name}"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=60,
        )
        # verify exits 0 on warnings too (an unknown key, a bad value): none may name us.
        ours = [line for line in (r.stdout + r.stderr).splitlines() if "hivenet" in line]
        assert r.returncode == 0 and not ours, (name, r.returncode, r.stdout, r.stderr)


def test_systemd_analyze_verify_passes_on_the_units(tmp_path: Path) -> None:
    assert_units_verify(tmp_path, "hivenet-router.service", "hivenet-agent@vllm.service")


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    """The check above is not vacuous: a typo and a missing binary are both reported."""
    analyze = systemd_analyze()
    router = checkout_copies(tmp_path)[0]
    router.write_text(router.read_text().replace("KillMode=mixed", "KillMode=mixd"))
    r = subprocess.run(
        [analyze, "verify", "--man=no", "./hivenet-router.service"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "KillMode" in r.stderr or "kill mode" in r.stderr, r.stderr
    r = subprocess.run(
        [analyze, "verify", "--man=no", str(ROUTER_UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "/opt/hivenet/.venv/bin/hivenet-router" in r.stderr


def test_units_are_sandboxed(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    checkout_copies(tmp_path)
    for name in ("hivenet-router.service", "hivenet-agent@vllm.service"):
        r = subprocess.run(
            [analyze, "security", "--offline=yes", "--no-pager", f"./{name}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if "--offline" in r.stderr and "unrecognized" in r.stderr:
            # CI's Debian 12 has systemd 252: an older one there would hide this check.
            if os.environ.get("CI"):
                pytest.fail("systemd-analyze in CI predates --offline (systemd 250)")
            pytest.skip("systemd-analyze security --offline needs systemd 250 or newer")
        level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
        assert level is not None, (r.stdout[-2000:], r.stderr)
        # 0 (locked down) .. 10 (unprotected); "OK" is below 4.
        assert float(level.group(1)) <= 2.5, (name, level.group(1))


def test_units_declare_what_operations_rely_on() -> None:
    for path in (ROUTER_UNIT, AGENT_UNIT):
        unit = Unit.read(path)
        assert unit.value("Type") == "notify"
        assert unit.value("Restart") == "on-failure"
        assert unit.value("User") == "hivenet"
        assert unit.value("KillSignal") == "SIGTERM"
        assert unit.value("EnvironmentFile").startswith("/etc/hivenet/")
        assert unit.value("ExecStart").startswith(INSTALL_PREFIX)
        for setting in (
            "NoNewPrivileges",
            "ProtectHome",
            "PrivateTmp",
            "ProtectKernelTunables",
            "ProtectKernelModules",
            "ProtectControlGroups",
            "RestrictNamespaces",
            "LockPersonality",
            "MemoryDenyWriteExecute",
            "RestrictRealtime",
        ):
            assert unit.value(setting) == "yes", (path.name, setting)
        assert unit.value("ProtectSystem") == "strict"
        assert unit.value("CapabilityBoundingSet") == ""
        assert set(unit.value("RestrictAddressFamilies").split()) == {
            "AF_UNIX",
            "AF_INET",
            "AF_INET6",
        }
        # The identity key lives in the unit's state directory (kept across restarts).
        state = unit.value("StateDirectory")
        assert f"--identity-path %S/{state}/" in unit.value("ExecStart")
        # Stopping waits out the drain (plus the router's 5 s wind-down), never less.
        drain = next(v for k, v in unit.defaults().items() if k.endswith("_DRAIN_TIMEOUT"))
        assert parse_duration(unit.value("TimeoutStopSec")) >= parse_duration(drain) + 10
        # The install (docs/getting-started/first-fleet.md) unpacks this repository into
        # /opt/hivenet: the page is in it.
        docs = unit.value("Documentation", "Unit")
        assert docs.startswith(f"file:{INSTALL_ROOT}"), docs
        assert (ROOT / docs.removeprefix(f"file:{INSTALL_ROOT}")).is_file(), docs
    router = Unit.read(ROUTER_UNIT)
    assert router.value("ExecReload") == "/bin/kill -HUP $MAINPID"
    assert router.value("PrivateDevices") == "yes"
    # NVML needs /dev/nvidia*: no PrivateDevices or closed device policy on the agent.
    agent = Unit.read(AGENT_UNIT)
    assert not agent.values("PrivateDevices") and not agent.values("DevicePolicy")
    assert agent.value("EnvironmentFile") == "/etc/hivenet/agent-%i.env"


@pytest.mark.parametrize("example", ["router", *AGENT_EXAMPLES])
def test_env_examples_fill_every_execstart_variable(example: str, tmp_path: Path) -> None:
    """Each example sets what the ExecStart line uses, and the flags it makes parse."""
    unit = Unit.read(ROUTER_UNIT if example == "router" else AGENT_UNIT)
    path = CONFIGS / (
        "router.env.example" if example == "router" else f"agent-{example}.env.example"
    )
    env = {**unit.defaults(), **read_env_file(path)}
    line = specifiers(unit.value("ExecStart"), example, tmp_path)
    # Every ${VAR} is set (an unset one becomes an empty argument) by the unit or example.
    for name in braced_variables(line):
        assert name in env, (path.name, name)
        if name != "HIVENET_AGENT_MODEL" and name != "HIVENET_AGENT_BACKEND_URL":
            assert env[name], (path.name, name, "empty")
    argv = expand_command(line, env)
    if example == "router":
        from router.cli import build_parser as router_parser

        args = router_parser().parse_args(argv[1:])
        assert args.command == "serve"
    else:
        from agent.cli import build_parser as agent_parser

        args = agent_parser().parse_args(argv[1:])
        assert args.engine == example
        assert args.model and args.capacity > 0 and args.backend_url
        assert args.router[0].startswith("/ip4/") and "/p2p/" in args.router[0]


def router_etc(tmp_path: Path, http: int, metrics: int, p2p: int, args: str = "") -> Path:
    """An /etc/hivenet of the router unit's files on these loopback ports: the secret,
    the default policy and `router.env` from its example (`args`: HIVENET_ROUTER_ARGS)."""
    etc = tmp_path / "etc"
    etc.mkdir()
    secret = etc / "jwt-secret"
    secret.write_text(SECRET + "\n")
    policy = etc / "policy.yaml"
    shutil.copy(CONFIGS / "policies" / "default.yaml", policy)
    values = {
        "HIVENET_ROUTER_HTTP_PORT": f"127.0.0.1:{http}",
        "HIVENET_ROUTER_METRICS_PORT": f"127.0.0.1:{metrics}",
        "HIVENET_ROUTER_P2P_PORT": str(p2p),
        "HIVENET_ROUTER_P2P_LISTEN_ADDR": "127.0.0.1",
        "HIVENET_ROUTER_POLICY_FILE": str(policy),
        "HIVENET_JWT_SECRET_FILE": str(secret),
        "HIVENET_ROUTER_ADMIN_API_KEYS": ADMIN_KEY,
    }
    if args:
        values["HIVENET_ROUTER_ARGS"] = args
    write_env_file(CONFIGS / "router.env.example", etc / "router.env", values)
    return etc


def test_exec_start_lines_run_become_ready_reload_and_stop(tmp_path: Path) -> None:
    """Router and a vLLM agent from their units' ExecStart lines, with sd_notify for real."""
    http, metrics, p2p = free_port(), free_port(), free_port()
    etc = router_etc(tmp_path, http, metrics, p2p)
    secret, policy = etc / "jwt-secret", etc / "policy.yaml"
    # A short directory: a unix socket path must fit in 108 bytes.
    sockets = Path(tempfile.mkdtemp(prefix="hn-notify-"))
    router_notify = NotifySocket(sockets / "router")
    agent_notify = NotifySocket(sockets / "agent")
    router_unit, agent_unit = Unit.read(ROUTER_UNIT), Unit.read(AGENT_UNIT)
    router = start_service(router_unit, "", etc / "router.env", tmp_path, router_notify)
    engine_port = free_port()
    example = read_env_file(CONFIGS / "agent-vllm.env.example")
    model = example["HIVENET_AGENT_MODEL"]
    # The vLLM look-alike stands in for vLLM: the agent runs with --engine vllm.
    engine = subprocess.Popen(
        [
            str(VENV_BIN / "python"),
            "-m",
            "sim",
            "--model",
            model,
            "--port",
            str(engine_port),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    agent: Service | None = None
    try:
        ready = router_notify.wait_for("READY", "1", router.popen.pid, 30)
        assert "serving" in ready.get("STATUS", "")
        key = tmp_path / "state" / "hivenet" / "router" / "router_identity.key"
        assert key.exists(), "the identity key is created in the state directory"
        peer_id = peer_id_of(load_or_create_identity(key))
        base = f"http://127.0.0.1:{http}"
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{engine_port}/health").is_success, 20, "the engine"
        )

        write_env_file(
            CONFIGS / "agent-vllm.env.example",
            etc / "agent-vllm.env",
            {
                "HIVENET_AGENT_ROUTER": f"/ip4/127.0.0.1/tcp/{p2p}/p2p/{peer_id}",
                "HIVENET_AGENT_BACKEND_URL": f"http://127.0.0.1:{engine_port}",
                "HIVENET_JWT_SECRET_FILE": str(secret),
            },
        )
        agent = start_service(agent_unit, "vllm", etc / "agent-vllm.env", tmp_path, agent_notify)
        with running(router, agent):
            agent_notify.wait_for("READY", "1", agent.popen.pid, 30)
            assert (tmp_path / "state/hivenet/agent-vllm/agent_identity.key").exists()

            def listed() -> dict | None:
                agents = httpx.get(base + "/admin/routing-table", headers=admin).json()["agents"]
                return next((a for a in agents if a["status"]["healthy"]), None)

            row = wait_until(listed, 20, "the agent in the routing table")
            assert row["metadata"]["model"] == model
            assert row["metadata"]["engine"] == "vllm"
            assert row["metadata"]["region"] == "EU-France"  # from HIVENET_AGENT_ARGS
            assert row["metadata"]["capacity"] == int(example["HIVENET_AGENT_CAPACITY"])
            r = httpx.post(
                base + "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "from units"}]},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "Echo: from units"

            # ExecReload=, with $MAINPID as systemd sets it: the policy file is re-read.
            shutil.copy(CONFIGS / "policies" / "fallback-chain.yaml", policy)
            reload = router_unit.value("ExecReload").replace("$MAINPID", str(router.popen.pid))
            subprocess.run(shlex.split(reload), check=True, timeout=10)
            router_notify.wait_for("RELOADING", "1", router.popen.pid, 10)
            router_notify.wait_for("READY", "1", router.popen.pid, 10)
            running_policy = httpx.get(base + "/admin/policy", headers=admin).text
            assert running_policy == policy.read_text()
            assert "policy_reloaded origin=file" in router.text()

            # systemctl stop: KillSignal=, STOPPING=1, a clean exit within TimeoutStopSec.
            assert stop_service(agent, agent_notify) == 0
            assert "agent_stopped" in agent.text()
            assert stop_service(router, router_notify) == 0
            assert "router_stopped" in router.text()
    finally:
        engine.terminate()
        engine.wait(10)
        router_notify.close()
        agent_notify.close()
        shutil.rmtree(sockets, ignore_errors=True)


def notify_sender(unit: Unit, service: Service) -> int | None:
    """Whose notifications systemd takes (NotifyAccess=): the main process's, or with
    `all` any process of the service's (None)."""
    access = unit.value("NotifyAccess")
    assert access in ("main", "all"), access
    return service.popen.pid if access == "main" else None


def test_the_router_unit_with_workers_becomes_ready_and_stops(tmp_path: Path) -> None:
    """`serve --workers 2` from the unit: the supervisor is the main process and never
    notifies; the workers, its children, say READY=1 and STOPPING=1, and systemd must
    take them (without READY=1 it stops the unit after TimeoutStartSec)."""
    http = free_port()
    etc = router_etc(tmp_path, http, free_ports(2), free_ports(2), "--workers 2")
    sockets = Path(tempfile.mkdtemp(prefix="hn-notify-"))
    notify = NotifySocket(sockets / "router")
    unit = Unit.read(ROUTER_UNIT)
    router = start_service(unit, "", etc / "router.env", tmp_path, notify)
    try:
        with running(router):
            ready = notify.wait_for("READY", "1", notify_sender(unit, router), 30)
            assert "serving" in ready.get("STATUS", "")
            assert httpx.get(f"http://127.0.0.1:{http}/health", timeout=5).status_code == 200
            router.popen.send_signal(signal.Signals[unit.value("KillSignal")])
            notify.wait_for("STOPPING", "1", notify_sender(unit, router), 10)
            assert router.popen.wait(parse_duration(unit.value("TimeoutStopSec"))) == 0
            # The unit is active once one worker is: the other may not have been ready.
            assert "router_stopped" in router.text()
            assert "workers_stopped count=2" in router.text()
    finally:
        notify.close()
        shutil.rmtree(sockets, ignore_errors=True)


def test_sandbox_flags_are_applied_to_the_children(tmp_path: Path) -> None:
    """The run test above really runs under NoNewPrivileges (and MDWE where possible)."""
    preexec, flags = sandbox_for(Unit.read(AGENT_UNIT))
    assert "NoNewPrivileges" in flags
    status = subprocess.run(
        ["cat", "/proc/self/status"],
        preexec_fn=preexec,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert re.search(r"NoNewPrivs:\s+1", status)
    if "MemoryDenyWriteExecute" in flags:
        code = (
            "import mmap\n"
            "try:\n"
            "    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "except OSError:\n"
            "    print('refused')\n"
        )
        out = subprocess.run(
            [str(VENV_BIN / "python"), "-c", code],
            preexec_fn=preexec,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.strip() == "refused"


def test_sd_notify_paths_abstract_names_and_no_supervisor(tmp_path: Path) -> None:
    from protocol.sdnotify import sd_notify

    assert sd_notify("READY=1", {}) is False  # not under systemd: a no-op
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "n"))
        assert sd_notify("READY=1\nSTATUS=x", {"NOTIFY_SOCKET": str(tmp_path / "n")})
        assert sock.recv(100) == b"READY=1\nSTATUS=x"
    name = f"hivenet-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)  # systemd writes an abstract name with a leading @
        assert sd_notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(100) == b"STOPPING=1"
    # A supervisor that went away must not take the daemon with it.
    assert sd_notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False
