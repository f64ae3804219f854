"""Claude Code (`@anthropic-ai/claude-code`, pinned in tests/clients/package.json) against
a real router, configured as docs/integrations/claude-code.md tells its users.

`claude -p` streams Anthropic `/v1/messages` through the router to an agent; with a
scripted tool call it reads a file with its own Read tool, sends the result back, and
the final answer that reaches it carries what only the file held. Claude Code never
reaches the internet here: its non-essential traffic is off, and every connection that
is not to the router goes to a proxy that records and refuses it.
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
    CONTEXT,
    MODEL,
    NODE_MODULES,
    ClientRun,
    client_run,
)

CLAUDE = NODE_MODULES / ".bin" / "claude"


def claude_env(router_url: str, home: Path) -> dict[str, str]:
    """The environment docs/integrations/claude-code.md gives, word for word."""
    return {
        "ANTHROPIC_BASE_URL": router_url,
        "ANTHROPIC_AUTH_TOKEN": CLIENT_KEY,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        # The model's real window and a bounded answer: Claude Code assumes its own
        # models' (and asks for 32,000 output tokens) unless told.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(CONTEXT),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024",
        # No update checks, telemetry, error reports or other non-inference traffic.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        # A home of its own: no login, settings or history of the machine's user.
        "HOME": str(home),
        "PATH": os.environ["PATH"],
        "TERM": "dumb",
    }


class ClaudeRun(ClientRun):
    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**claude_env(self.fleet.url, self.home), **self.egress.env()}
        return subprocess.run(
            [str(CLAUDE), *args],
            cwd=self.project,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            stdin=subprocess.DEVNULL,
        )


@pytest.fixture(scope="module")
def claude(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClaudeRun]:
    with client_run(tmp_path_factory, "claude", ClaudeRun) as run:
        yield run


def test_claude_p_gets_its_answer_through_the_router(claude: ClaudeRun) -> None:
    before = claude.fleet.engine_requests()
    served = claude.fleet.served("/v1/messages")
    done = claude("-p", "hello through the router", "--model", "sonnet")
    assert done.returncode == 0, done.stdout + done.stderr
    # The simulated engine's answer echoes the user's turn (Claude Code adds a reminder).
    assert done.stdout.startswith("Echo: ")
    assert "hello through the router" in done.stdout
    assert claude.fleet.engine_requests() > before
    # The router served it for the client key's tenant.
    assert claude.fleet.served("/v1/messages") > served
    assert claude.egress.attempts() == []


def test_claude_code_runs_a_tool_and_gets_the_final_answer(claude: ClaudeRun) -> None:
    secret = f"marmalade-{uuid.uuid4().hex[:8]}"
    notes = claude.project / "notes.txt"
    notes.write_text(f"the secret word is {secret}\n")
    prompt = "Read my notes. sim:call Read " + json.dumps({"file_path": str(notes)})
    done = claude("-p", prompt, "--model", "sonnet", "--output-format", "stream-json", "--verbose")
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    blocks = [
        (event["type"], block)
        for event in events
        if event.get("type") in ("assistant", "user")
        for block in event["message"]["content"]
        if isinstance(block, dict)
    ]
    kinds = [(role, block["type"]) for role, block in blocks]
    # Turn 1: the engine's tool call; Claude Code runs Read and sends the result back;
    # turn 2: the answer, which reaches the client.
    assert kinds == [("assistant", "tool_use"), ("user", "tool_result"), ("assistant", "text")]
    call = blocks[0][1]
    assert call["name"] == "Read" and call["input"] == {"file_path": str(notes)}
    result = blocks[1][1]
    assert result["tool_use_id"] == call["id"] and secret in json.dumps(result["content"])
    final = events[-1]
    assert final["type"] == "result" and final["subtype"] == "success"
    assert final["num_turns"] == 2
    # What only the file held came back through the engine's second answer.
    assert secret in final["result"] and final["result"].startswith("Echo: ")
    assert claude.egress.attempts() == []
