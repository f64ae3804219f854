"""OpenCode (`opencode-ai`, pinned in tests/clients/package.json) against a real router,
with the OpenAI-compatible provider config of docs/integrations/opencode.md.

`opencode run` streams `/v1/chat/completions` through the router; with a scripted tool
call it reads a file with its own `read` tool and sends the result back, and the final
answer carries what only the file held. OpenCode works offline once told to: without
`OPENCODE_DISABLE_MODELS_FETCH` it fetches the models.dev catalogue at start, and at
every start it installs its plugin package into its config directory from the npm
registry (in the background; a failure is a warning), which `npm_config_offline`
keeps off the network. Every other connection goes to a proxy that records and refuses
it, and the test checks that none was tried.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client_fleet import (
    CLIENT_KEY,
    MODEL,
    NODE_MODULES,
    ClientFleet,
    ClientRun,
    EgressRecorder,
    client_run,
)

OPENCODE = NODE_MODULES / ".bin" / "opencode"
PROVIDER = "hivenet"


def opencode_config(router_url: str) -> dict:
    """The project's `opencode.json`, as docs/integrations/opencode.md shows it."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Hivenet Router",
                "options": {
                    "baseURL": f"{router_url}/v1",
                    "apiKey": "{env:HIVENET_ROUTER_API_KEY}",
                },
                "models": {MODEL: {"name": "Code model (Hivenet Router)"}},
            }
        },
        "model": f"{PROVIDER}/{MODEL}",
    }


def opencode_env(home: Path) -> dict[str, str]:
    return {
        "HIVENET_ROUTER_API_KEY": CLIENT_KEY,
        # Offline: no models.dev catalogue, no update check, no registry for its plugin.
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "npm_config_offline": "true",
        # A home of its own: no config, auth or sessions of the machine's user.
        "HOME": str(home),
        "PATH": os.environ["PATH"],
        "TERM": "dumb",
    }


class OpencodeRun(ClientRun):
    def __init__(self, fleet: ClientFleet, egress: EgressRecorder, directory: Path) -> None:
        super().__init__(fleet, egress, directory)
        config = json.dumps(opencode_config(fleet.url), indent=2)
        (self.project / "opencode.json").write_text(config)

    def __call__(self, *words: str) -> list[dict]:
        """`opencode run --format json WORDS...`: its events, one JSON object a line."""
        done = subprocess.run(
            [str(OPENCODE), "run", "--format", "json", *words],
            cwd=self.project,
            env={**opencode_env(self.home), **self.egress.env()},
            capture_output=True,
            text=True,
            timeout=180,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def opencode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpencodeRun]:
    with client_run(tmp_path_factory, "opencode", OpencodeRun) as run:
        yield run


def _texts(events: list[dict]) -> list[str]:
    return [e["part"]["text"] for e in events if e.get("type") == "text"]


def test_opencode_runs_a_tool_through_the_router_and_gets_the_answer(
    opencode: OpencodeRun,
) -> None:
    secret = f"quince-{uuid.uuid4().hex[:8]}"
    notes = opencode.project / "notes.txt"
    notes.write_text(f"the secret word is {secret}\n")
    served = opencode.fleet.served("/v1/chat/completions")
    # Words as a shell passes them: `opencode run` quotes an argument with a space in
    # it, so the JSON has none.
    arguments = json.dumps({"filePath": str(notes)}, separators=(",", ":"))
    events = opencode("Read", "my", "notes.", "sim:call", "read", arguments)
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    # Turn 1: the engine's call, which OpenCode ran with its own read tool.
    assert len(tools) == 1, events
    assert tools[0]["tool"] == "read"
    assert tools[0]["state"]["status"] == "completed"
    assert tools[0]["state"]["input"] == {"filePath": str(notes)}
    assert secret in tools[0]["state"]["output"]
    # Turn 2: the engine answered the tool's result, and that answer reached OpenCode.
    texts = _texts(events)
    assert texts and texts[-1].startswith("Echo: ") and secret in texts[-1]
    assert opencode.fleet.served("/v1/chat/completions") >= served + 2
    assert opencode.egress.attempts() == []
