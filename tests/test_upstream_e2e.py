"""The Go router's own files and unit files, unchanged, end to end (issue 19): every
policy and auth file of `../shared/upstream/` passes its check command and serves
requests; the bare-metal deployment's router and agent route a request."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import trio

from router.lifetime import FILE_NAME
from tests.fleet import ADMIN_KEY, SECRET, VENV_BIN, Fleet, Proc, Router, free_port, wait_until

REPO = Path(__file__).resolve().parent.parent


def _upstream_root() -> Path:
    """`../shared/upstream` beside the clone; for a git worktree, beside its main clone."""
    beside = REPO.parent / "shared" / "upstream"
    if beside.exists():
        return beside
    common = subprocess.run(
        ["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(common).parent.parent / "shared" / "upstream" if common else beside


UPSTREAM = _upstream_root()
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def upstream(*parts: str) -> Path:
    """A file of the Go router's checkout. A clone outside this workspace has none: the
    test skips, naming the folder; CI (CI=1), which has it, fails instead."""
    path = UPSTREAM.joinpath(*parts)
    if not path.exists():
        why = (
            f"{path} is missing: these tests read the Go router's own files from"
            " ../shared/upstream/ beside the clone (its policies, auth files and deploy docs)"
        )
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def upstream_files(folder: str) -> list[Path]:
    files = sorted(upstream(folder).glob("*.yaml"))
    assert files, f"no YAML under {UPSTREAM / folder}"
    return files


def check(command: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "hivenet-router"), command, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("name", ["policies", "deploy/auth"])
def test_every_upstream_file_passes_its_check(name: str) -> None:
    command = "check-policy" if name == "policies" else "check-auth"
    for path in upstream_files(name):
        done = check(command, path)
        assert done.returncode == 0, f"{path}: {done.stderr}"
    policy = check("check-policy", upstream("policies", "_default.yaml")).stdout
    assert "429 concurrency_limit_exceeded, Retry-After: 1" in policy
    assert "tags include 'production'" in policy
    auth = check("check-auth", upstream("deploy", "auth", "auth.api-key.yaml")).stdout
    assert "api.mode=api-key admin.mode=api-key" in auth
    assert "tenant Hivenet Router: models=* keys=1 requests_per_minute=100" in auth
    assert "no key can match it" in auth


@contextmanager
def vllm_backend(model: str) -> Iterator[str]:
    """The simulated engine as a vLLM server: upstream's policies match `engine: vllm`."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "--model", model, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, what="sim backend")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def chat(router: Router, model: str, key: str = "none") -> httpx.Response:
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_upstream_policy_directory_routes_sheds_and_reloads(fleet: Fleet, tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    for path in upstream_files("policies"):
        shutil.copyfile(path, policies / path.name)
    router = fleet.router("--policy-model-dir", str(policies))
    with vllm_backend("m1") as backend, vllm_backend("llama3:70b") as large:
        # Upstream's primary step: vLLM, EU-France, tagged production (the default tag).
        agent = fleet.agent(
            router, "m1", "--backend-url", backend, "--region", "EU-France", engine="vllm"
        )
        fleet.agent(router, "llama3:70b", "--backend-url", large, "--region", "US", engine="vllm")
        assert chat(router, "m1").status_code == 200
        assert router.metric("hivenet_router_policy_primary_routed_total", model="m1") == 1
        # llama3:70b follows its own file: its primary step takes any vLLM agent, where
        # the global chain would have fallen back to global-any.
        assert chat(router, "llama3:70b").status_code == 200
        primary = "hivenet_router_policy_primary_routed_total"
        assert router.metric(primary, model="llama3:70b") == 1
        named = httpx.get(router.url + "/admin/policy/models", headers=ADMIN, timeout=10).json()
        assert named["llama3-large"]["models"] == ["llama3:70b", "llama3:70b-instruct"]
        assert named["llama3-large"]["chain"] == ["routing_policy", "global-any"]
        # Upstream's view: the document itself, as JSON, beside ours.
        assert named["llama3-large"]["routing_policy"]["strategy"] == "least-loaded"

        # Front-door shed_if: the pool's mean KV use over 0.90 is 429 before any step.
        httpx.post(backend + "/sim/state", json={"kv_cache_utilization": 0.95}, timeout=5)
        wait_until(
            lambda: router.agent(agent.peer_id)["engine"]["kv_cache_utilization"] == 0.95,
            what="kv reported",
        )
        shed = chat(router, "m1")
        assert shed.status_code == 429
        assert shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == "concurrency_limit_exceeded"
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
        # The other model's pool is not hot: its requests pass the same door.
        assert chat(router, "llama3:70b").status_code == 200

        # Admin API: a second document may not take a model the first owns (409) ...
        body = "models: [llama3:70b]\nrouting_policy:\n  strategy: least-loaded\n"
        url = router.url + "/admin/policy/models/other"
        conflict = httpx.put(url, content=body, headers=ADMIN, timeout=10)
        assert conflict.status_code == 409
        assert "already belongs to policy 'llama3-large'" in conflict.json()["error"]["message"]
        # ... a document without models is refused, every reason given ...
        bad = httpx.put(url, content="routing_policy:\n  strategy: least-loaded\n", headers=ADMIN)
        assert bad.status_code == 400 and "models: missing" in bad.json()["error"]["message"]
        # ... and DELETE is idempotent and hands the models back to the global policy.
        for _ in range(2):
            gone = httpx.delete(router.url + "/admin/policy/models/llama3-large", headers=ADMIN)
            assert gone.json() == {"status": "policy deleted", "name": "llama3-large"}
        assert httpx.get(router.url + "/admin/policy/models", headers=ADMIN).json() == {}
        assert chat(router, "llama3:70b").status_code == 200
        fallback = "hivenet_router_policy_fallback_routed_total"
        assert router.metric(fallback, model="llama3:70b") == 1
        created = httpx.put(url, content=body, headers=ADMIN, timeout=10)
        assert created.json() == {
            "status": "policy updated",
            "name": "other",
            "models": ["llama3:70b"],
        }
        assert httpx.get(url, headers=ADMIN).json()["origin"] == "admin_api"

    # SIGHUP rereads the directory: the file is back; a broken edit keeps the rest.
    httpx.delete(url, headers=ADMIN)
    (policies / "broken.yaml").write_text("models: [m9]\nrouting_policy:\n  strategy: fastest\n")
    router.send_signal(signal.SIGHUP)
    router.wait_log(r"policy_reload_failed origin=file .*unknown strategy 'fastest'")
    named = wait_until(
        lambda: httpx.get(router.url + "/admin/policy/models", headers=ADMIN).json() or None,
        what="directory reloaded",
    )
    assert set(named) == {"llama3-large"}


def test_upstream_policy_dir_with_an_invalid_file_is_a_startup_error(
    fleet: Fleet, tmp_path: Path
) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    shutil.copyfile(upstream("policies", "llama3-large.yaml"), policies / "a.yaml")
    shutil.copyfile(upstream("policies", "llama3-large.yaml"), policies / "b.yaml")
    router = fleet.router("--policy-model-dir", str(policies), start=False)
    done = subprocess.run(router.argv, env=router.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "b: model 'llama3:70b' already belongs to policy 'a'" in done.stderr


def keygen(tenant: str) -> tuple[str, str]:
    out = subprocess.run(
        [str(VENV_BIN / "hivenet-router"), "keygen", "--tenant", tenant],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    fields = dict(line.split(": ", 1) for line in out.splitlines()[:3])
    assert fields["key"].startswith("sk-hivenet-") and len(fields["hash"]) == 64
    assert f'owner: "{tenant}"' in out and f'key_hash: "{fields["hash"]}"' in out
    return fields["key"], fields["hash"]


UPSTREAM_SHAPE = """
api:
  mode: api-key
  keys:
    - key_hash: "{allowed}"
      key_preview: "sk-...a"
      metadata: {{name: "limited", owner: "acme"}}
      models: [m1]
      quota: {{requests_per_minute: 1}}
    - key_hash: "{expired}"
      metadata: {{name: "old", owner: "beta", expires_at: "01-01-2020"}}
    - key_hash: "{quoted}"
      metadata: {{name: "quoted", owner: "gamma"}}
      quota:
        per_model:
          m1: {{requests_per_minute_per_replica: 0, tokens_per_day: 0}}
admin:
  mode: api-key
"""


def test_upstream_auth_file_serves_end_to_end(fleet: Fleet) -> None:
    source = upstream("deploy", "auth", "auth.api-key.yaml")
    router = fleet.router("--auth-config-file", str(source))
    fleet.join(fleet.agent(router, "m1", wait=False), fleet.agent(router, "m2", wait=False))
    # Unchanged, its one key is a placeholder: every client is refused, as upstream.
    refused = chat(router, "m1", "sk-hivenet-anything")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert httpx.get(router.url + "/admin/health", timeout=10).status_code == 401

    # Filled in as its comments say (keygen's hash in place of the placeholder).
    key, digest = keygen("Hivenet Router")
    filled = source.read_text().replace("replace-with-sha256-hex-from-keygen", digest)
    put = httpx.put(router.url + "/admin/auth", content=filled, headers=ADMIN, timeout=10)
    assert put.status_code == 200, put.text
    answer = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
    raw = answer.chat.completions.with_raw_response.create(
        model="m2", messages=[{"role": "user", "content": "x"}]
    )
    assert raw.parse().choices[0].message.content
    # The quota headers upstream's clients read: the bucket after this request, and the
    # day's budget before its tokens are charged.
    assert raw.headers["x-ratelimit-remaining-requests"] == "99"
    assert raw.headers["x-ratelimit-remaining-tokens"] == "500000"

    # Expiry, model allowlist, quota: upstream's codes for each.
    limited, limited_hash = keygen("acme")
    old, old_hash = keygen("beta")
    quoted, quoted_hash = keygen("gamma")
    text = UPSTREAM_SHAPE.format(allowed=limited_hash, expired=old_hash, quoted=quoted_hash)
    assert httpx.put(router.url + "/admin/auth", content=text, headers=ADMIN).status_code == 200
    expired = chat(router, "m1", old)
    assert expired.status_code == 401
    assert "expired" in expired.json()["error"]["message"]
    forbidden = chat(router, "m2", limited)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "model_forbidden"
    assert forbidden.json()["error"]["message"] == "your API key does not have access to model: m2"
    # A model `quota.per_model` does not declare: upstream's strict enumeration, 429.
    assert chat(router, "m1", quoted).status_code == 200
    undeclared = chat(router, "m2", quoted)
    assert undeclared.status_code == 429, undeclared.text
    assert undeclared.json()["error"] == {
        "code": "rate_limit_exceeded",
        "message": "no quota declared for model m2 on this API key",
        "type": undeclared.json()["error"]["type"],
        "source": "router",
    }
    headers = {"Authorization": f"Bearer {limited}"}
    listed = httpx.get(router.url + "/v1/models", headers=headers, timeout=10).json()
    assert [card["id"] for card in listed["data"]] == ["m1"]
    hidden = httpx.get(router.url + "/v1/models/m2", headers=headers, timeout=10)
    assert hidden.status_code == 404
    detail = httpx.get(router.url + "/v1/models/m1", headers=headers, timeout=10).json()
    assert [a["is_healthy"] for a in detail["agents"]["list"]] == [True]
    first = chat(router, "m1", limited)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-remaining-tokens" not in first.headers  # no daily budget: no header
    over = chat(router, "m1", limited)
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(over.headers["retry-after"]) >= 1
    assert over.headers["x-ratelimit-remaining-requests"] == "0"  # upstream's, on the 429


def test_cors_preflight_and_headers(fleet: Fleet) -> None:
    router = fleet.router(env={"HIVENET_ROUTER_API_KEYS": "k1:web"})
    fleet.agent(router, "m1")
    asked = "authorization, content-type"
    pre = httpx.options(
        router.url + "/v1/chat/completions",
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": asked,
        },
        timeout=10,
    )
    # Answered before authentication: browsers send no credentials on a preflight.
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == asked
    assert "OPTIONS" not in router.log()  # preflights are neither logged nor audited
    answer = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Origin": "https://app.example", "Authorization": "Bearer k1"},
        timeout=30,
    )
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "*"
    exposed = [h.strip() for h in answer.headers["access-control-expose-headers"].split(",")]
    # Anthropic's SDK reads the request ID as `request-id`: a browser must show it that.
    assert "X-Request-ID" in exposed and "request-id" in exposed
    # Without an Origin nothing changes, and a plain OPTIONS is no preflight.
    plain = chat(router, "m1", "k1")
    assert "access-control-allow-origin" not in plain.headers
    assert httpx.options(router.url + "/v1/models", timeout=10).status_code != 204


def test_display_fields_hide_llm_and_agents_list(fleet: Fleet) -> None:
    router = fleet.router()
    shown = fleet.agent(
        router,
        "m1",
        "--llm-pretty-name",
        "Balanced · M1",
        "--llm-info",
        "Good balance",
        "--deployment-id",
        "dep-1",
        "--replica-id",
        "r-7",
        "--version",
        "1.2.3",
    )
    fleet.agent(router, "secret-model", "--hide-llm")
    listed = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
    # Hidden from the list (upstream still lists it), still served and still inspectable.
    assert [card["id"] for card in listed] == ["m1"]
    assert listed[0]["pretty_name"] == "Balanced · M1" and listed[0]["info"] == "Good balance"
    assert chat(router, "secret-model").status_code == 200
    hidden = httpx.get(router.url + "/v1/models/secret-model", timeout=10).json()
    assert hidden["hide_llm"] is True
    detail = httpx.get(router.url + "/v1/models/m1", timeout=10).json()
    [entry] = detail["agents"]["list"]
    assert entry["peer_id"] == shown.peer_id and entry["version"] == "1.2.3"
    assert entry["is_healthy"] is True and isinstance(entry["last_seen"], int)
    # The admin list is the same cards (hidden ones included, marked), as upstream's.
    admin = {card["id"]: card for card in router.admin("/admin/models")["data"]}
    assert admin["m1"]["pretty_name"] == "Balanced · M1" and admin["m1"]["info"] == "Good balance"
    assert admin["secret-model"]["hide_llm"] is True
    metadata = router.agent(shown.peer_id)["metadata"]
    assert metadata["deployment_id"] == "dep-1" and metadata["replica_id"] == "r-7"
    assert metadata["tags"] == ["production"]


async def test_max_concurrent_and_queue_size_answer_queue_full(fleet: Fleet) -> None:
    router = fleet.router("--max-concurrent", "1", "--queue-size", "1")
    # The first answer holds the one slot past the 5 s a request waits for a queue place.
    agent = fleet.agent(router, "m1", "--sim-ttft", "7s", "--capacity", "8")
    async with httpx.AsyncClient(timeout=60) as client:

        async def ask(results: list[int]) -> None:
            body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
            r = await client.post(router.url + "/v1/chat/completions", json=body)
            results.append(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "queue_full"
                assert r.headers["retry-after"] == "1"

        results: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, results)
            # The first request holds the slot once the agent has it in hand.
            while True:
                if router.agent(agent.peer_id)["status"]["active_requests"] >= 1:
                    break
                await trio.sleep(0.05)
            # One slot, taken: the next request waits, the one after waits 5 s for a
            # place in the queue of 1, and is refused.
            nursery.start_soon(ask, results)
            nursery.start_soon(ask, results)
    assert sorted(results) == [200, 200, 503]


def unit_command(doc: str, binary: str) -> list[str]:
    """The ExecStart of `binary` in a systemd unit of `doc`, as argv."""
    start = doc.index(f"ExecStart=/opt/hivenet-router/{binary}")
    lines = []
    for line in doc[start:].splitlines():
        lines.append(line.strip().removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(lines).split()[1:]


def doc_environment(doc: str, binary: str) -> dict[str, str]:
    """`Environment=` lines of the unit that runs `binary`."""
    start = doc.index(f"ExecStart=/opt/hivenet-router/{binary}")
    unit = doc[start : doc.index("[Install]", start)]
    pairs = [
        line.removeprefix("Environment=")
        for line in unit.splitlines()
        if line.startswith("Environment=")
    ]
    return dict(pair.split("=", 1) for pair in pairs)


def loopback_with_port_free(port: int) -> str:
    """A 127.a.b.c address on which `port` is free. The guide's libp2p port 9000 stays
    as written (the agent's `--router-grpc HOST:50051` implies it), on an address of
    this test's own, so a parallel run or another service on 127.0.0.1:9000 is no
    obstacle."""
    for _ in range(50):
        address = "127." + ".".join(str(random.randint(1, 254)) for _ in range(3))
        with socket.socket() as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
        return address
    pytest.fail(f"no loopback address with port {port} free")


def test_bare_metal_deployment_routes_a_request(fleet: Fleet, tmp_path: Path) -> None:
    """Issue 47: the guide's unit command lines run unchanged apart from ports and
    paths (and the example network's address): no `serve`, `--grpc-port` and the
    agent's `--router-grpc` each start with one warning line."""
    doc = upstream("docs", "deploy", "bare-metal.mdx").read_text()
    router_argv = unit_command(doc, "hivenet-router")
    agent_argv = unit_command(doc, "hivenet-agent")
    env_file = doc[doc.index("ROUTER_IP=") :].split("```")[0]
    variables = dict(line.split("=", 1) for line in env_file.split())
    assert variables == {
        "ROUTER_IP": "192.168.1.100",
        "AGENT_REGION": "EU-Primary",
        "AGENT_CAPACITY": "32",
    }
    for binary in ("hivenet-router", "hivenet-agent"):  # "Check that both binaries start"
        assert (
            subprocess.run([str(VENV_BIN / binary), "--help"], capture_output=True).returncode == 0
        )

    # The guide's directories (`install -d`), under the test's own.
    root = tmp_path / "root"
    lib, logs, etc = root / "var/lib/hivenet-router", root / "var/log/hivenet-router", root / "etc"
    for folder in (lib / "badger", lib / "agent", logs, etc):
        folder.mkdir(parents=True)
    (etc / "jwt.secret").write_text(SECRET + "\n")

    def paths(arg: str) -> str:
        for prefix in ("/var/lib/", "/var/log/", "/etc/hivenet-router/"):
            if arg.startswith(prefix):
                return str(root / arg.lstrip("/").replace("etc/hivenet-router/", "etc/"))
        return arg

    http, metrics = free_port(), free_port()
    router_ip = loopback_with_port_free(9000)
    # Ports only: the client API and metrics keep their flags, on free ports.
    ports = {":8080": f":{http}", ":2112": f":{metrics}", "0.0.0.0": router_ip}
    argv = [ports.get(arg, paths(arg)) for arg in router_argv]
    assert "serve" not in argv and "--grpc-port" in argv and "9000" in argv
    env = {k: v for k, v in fleet.env.items() if not k.startswith("HIVENET_ROUTER_")}
    unit_env = doc_environment(doc, "hivenet-router")
    assert set(unit_env) == {"HIVENET_ROUTER_AUDIT_LOG_PATH", "HIVENET_ROUTER_ALLOW_INSECURE_ADMIN"}
    unit_env = {k: paths(v) for k, v in unit_env.items()}
    audit = Path(unit_env["HIVENET_ROUTER_AUDIT_LOG_PATH"])
    router_proc = Proc(
        "router",
        [str(VENV_BIN / "hivenet-router"), *argv],
        {**env, **unit_env},
        tmp_path / "router.log",
        cwd=lib,  # WorkingDirectory=/var/lib/hivenet-router: the identity key lands there
    )
    fleet.procs.append(router_proc)
    router_proc.start()
    router_proc.wait_log("router_ready")
    assert (lib / "router_identity.key").exists()
    ignored = [line for line in router_proc.log().splitlines() if "upstream_flag_ignored" in line]
    assert len(ignored) == 1 and "flag=--grpc-port" in ignored[0], ignored

    variables["ROUTER_IP"] = router_ip
    with vllm_backend("m1") as backend:
        backend_port = backend.rsplit(":", 1)[1]
        argv = []
        for arg in agent_argv:
            for name, var in variables.items():
                arg = arg.replace("${" + name + "}", var)
            argv.append(paths(arg.replace(":8888", f":{backend_port}")))
        assert "--router" not in argv and "--model" not in argv
        agent_proc = Proc(
            "agent",
            [str(VENV_BIN / "hivenet-agent"), *argv],
            env,
            tmp_path / "agent.log",
            cwd=lib / "agent",
        )
        fleet.procs.append(agent_proc)
        agent_proc.start()
        url = f"http://127.0.0.1:{http}"
        wait_until(
            lambda: httpx.get(url + "/v1/models", timeout=5).json()["data"] or None,
            timeout=30,
            what="agent registered",
        )
        assert (lib / "agent" / "identity.key").exists()
        ignored = [
            line for line in agent_proc.log().splitlines() if "upstream_flag_ignored" in line
        ]
        assert len(ignored) == 1 and "flag=--router-grpc" in ignored[0], ignored
        card = httpx.get(url + "/v1/models/m1", timeout=5).json()
        assert card["agents"]["regions"] == ["EU-Primary"]
        assert card["agents"]["total_capacity"] == 32
        reply = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        answer = reply.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert answer.choices[0].message.content
    # The admin API is open, as that unit's HIVENET_ROUTER_ALLOW_INSECURE_ADMIN says.
    assert httpx.get(url + "/admin/health", timeout=5).status_code == 200
    wait_until(lambda: audit.exists() and audit.read_text(), what="audit line")
    # Its --disk-db-path keeps the agents' history for the next start.
    router_proc.stop()
    with sqlite3.connect(lib / "badger" / FILE_NAME) as db:
        assert db.execute("SELECT sum(successes) FROM agent_history").fetchone()[0] == 1
