"""The OpenAI Node SDK (`openai`) and the Vercel AI SDK (`ai` + `@ai-sdk/openai-compatible`),
pinned in tests/clients/package.json, against a real router.

Each runs its script in tests/clients/ (the code of docs/integrations/openai-node.md and
vercel-ai-sdk.md): a streamed answer with usage, and a tool call that the engine makes,
the application (or the SDK's own step loop) runs, and whose result comes back in the
final answer. The tool's output holds a value only this test knows, so the final
answer proves the round trip through the router.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client_fleet import (
    CLIENT_KEY,
    MODEL,
    ClientFleet,
    client_fleet,
    require_node_clients,
    run_node,
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientFleet]:
    require_node_clients()
    with client_fleet(Path(tmp_path_factory.mktemp("node-sdks"))) as fleet:
        yield fleet


def _run(fleet: ClientFleet, script: str, secret: str) -> dict:
    env = {
        "ROUTER_URL": fleet.url,
        "HIVENET_ROUTER_API_KEY": CLIENT_KEY,
        "MODEL": MODEL,
        "TOOL_SECRET": secret,
    }
    return json.loads(run_node(script, env))


def test_openai_node_sdk_streams_and_runs_a_tool(fleet: ClientFleet) -> None:
    secret = uuid.uuid4().hex[:10]
    served = fleet.served("/v1/chat/completions")
    out = _run(fleet, "openai_node.mjs", secret)

    stream = out["stream"]
    assert stream["text"] == "Echo: hello from node"
    assert stream["deltas"] == 4  # one chunk per token, relayed as they came
    assert stream["finish"] == "stop"
    assert stream["usage"]["prompt_tokens"] == 3 and stream["usage"]["completion_tokens"] == 4

    # The SDK's stream helper rebuilt the call from the fragments the router relayed.
    assert out["tool_call"] == {
        "finish": "tool_calls",
        "name": "lookup_code",
        "arguments": {"key": "alpha"},
    }
    assert out["final"] == {"text": f"Echo: code for alpha is {secret}", "finish": "stop"}
    assert fleet.served("/v1/chat/completions") == served + 3


def test_vercel_ai_sdk_streams_and_runs_a_tool(fleet: ClientFleet) -> None:
    secret = uuid.uuid4().hex[:10]
    served = fleet.served("/v1/chat/completions")
    out = _run(fleet, "vercel_ai.mjs", secret)

    stream = out["stream"]
    assert stream["text"] == "Echo: hello from vercel"
    assert stream["deltas"] == 4
    assert stream["finish"] == "stop"
    assert (stream["usage"]["inputTokens"], stream["usage"]["outputTokens"]) == (3, 4)

    # generateText (whole answers) and streamText (streamed), each two steps: the call,
    # which the SDK ran itself, then the answer to its result.
    for run, key in (("tool_whole", "beta"), ("tool_stream", "gamma")):
        answer = f"code for {key} is {secret}"
        steps = out[run]["steps"]
        assert steps == [
            {
                "finish": "tool-calls",
                "calls": [{"name": "lookup_code", "input": {"key": key}}],
                "results": [answer],
                "text": "",
            },
            {"finish": "stop", "calls": [], "results": [], "text": f"Echo: {answer}"},
        ], run
        assert out[run]["text"] == f"Echo: {answer}"
    assert fleet.served("/v1/chat/completions") == served + 5
