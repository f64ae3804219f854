"""Starting a real vLLM (CPU build) for the real-engine checks.

`scripts/real-engines` installs it in its own cache (HIVENET_VLLM_VENV) and writes the
tiny random-weight Llama (HIVENET_TINY_LLAMA); the environment below is what a 2-core
machine with no GPU and no model hub needs (../shared/notes/real-vllm.md): without
`nobind` vLLM pins its worker to core 0, without the host IPs its internal sockets bind
the host's external address, and float32 is 2.7 times faster than bfloat16 there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.fleet import free_port, wait_until

SERVED = "tiny"
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_bin() -> str:
    return str(Path(os.environ["HIVENET_VLLM_VENV"]) / "bin" / "vllm")


@contextmanager
def vllm_server(log_dir: Path, model: str, served: str, *flags: str) -> Iterator[str]:
    """A `vllm serve` of `model` as `served`; yields its URL once healthy (30 to 50 s)."""
    port = free_port()
    argv = [
        vllm_bin(),
        "serve",
        model,
        *("--host", "127.0.0.1", "--port", str(port), "--served-model-name", served),
        *("--dtype", "float32", "--enforce-eager"),
        *flags,
    ]
    log_path = log_dir / f"vllm-{served}.log"
    with engine_server(argv, {**os.environ, **ENV}, log_path, port, 240) as url:
        yield url


@contextmanager
def engine_server(
    argv: list[str], env: dict[str, str], log_path: Path, port: int, seconds: float
) -> Iterator[str]:
    """An engine server started from `argv`; yields its URL once `/health` answers 200
    (`seconds` at the most), stops it however the test ends."""
    # Its own process group: vLLM runs its engine core and worker as child processes,
    # which go with it when the test ends however it ends. Not a session of its own: with
    # the kernel's autogroup scheduling (on here), a CPU vLLM in its own session kept
    # the tests' processes, router and agents included, off both CPUs for 0.3 to 12.5 s
    # at a time under load (bench/stalls.py saw 40 s of it in one module); in the
    # tests' session, none over 0.1 s in a whole run.
    with open(log_path, "ab") as log:
        server = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
        )
    url = f"http://127.0.0.1:{port}"
    name = Path(argv[0]).name

    def healthy() -> bool:
        if server.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"{name} exited:\n{tail}")
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, seconds, f"{name} healthy")
        yield url
    finally:
        stop_group(server)


def stop_group(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (vLLM shuts its children down), SIGKILL
    after 20 s."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(5)
    except ProcessLookupError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)  # any child left behind


def gauge(url: str, name: str) -> float:
    """A vLLM metric's value (summed over its label sets)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


def first_then_any(folder: Path) -> str:
    """A policy file: requests go to the agent of region `first` while it lives, then
    to any other (the fallback), so a test knows which agent to kill, and a
    continuation has somewhere to go."""
    policy = folder / "policy.yaml"
    policy.write_text(
        "routing_policy:\n  match:\n    region: first\n  strategy: least-loaded\n"
        "fallback_chain:\n  - name: any\n    strategy: least-loaded\n"
    )
    return str(policy)


def messages_stream(base: str, body: dict, kill: Any | None, after: int = 0) -> dict:
    """A `/v1/messages` stream of `body` read through the raw SSE, every event checked;
    `kill` (an agent) is SIGKILLed once `after` text deltas have arrived. Its text,
    input and output tokens, stop reason, and when the kill and the end came."""
    out: dict = {"text": "", "input": None, "output": None, "stop": None, "times": []}
    deltas, started = 0, time.monotonic()
    with httpx.stream(
        "POST", base + "/v1/messages", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            assert event["type"] != "error", event
            if event["type"] == "message_start":
                out["input"] = event["message"]["usage"]["input_tokens"]
            elif event["type"] == "content_block_delta":
                out["text"] += event["delta"].get("text", "")
                deltas += 1
                if kill is not None and deltas == after:
                    out["times"].append(("kill", round(time.monotonic() - started, 3)))
                    kill.stop(signal.SIGKILL)
                    out["times"].append(("killed", round(time.monotonic() - started, 3)))
            elif event["type"] == "message_delta":
                out["stop"] = event["delta"].get("stop_reason")
                out["output"] = event["usage"]["output_tokens"]
    out["times"].append(("end", round(time.monotonic() - started, 3)))
    return out
