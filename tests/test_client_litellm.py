"""LiteLLM's Python SDK (`litellm`, pinned in the `test` extra) against a real router,
configured as docs/integrations/litellm.md shows: `openai/<model>` with the router's
`/v1` as `api_base` and a client key.

tests/clients/litellm_client.py runs in its own process (LiteLLM changes logging and
takes seconds to import; the pytest process stays clean): a whole answer, a streamed
one rebuilt by `stream_chunk_builder` with its usage, and a tool call whose result the
engine answers. LiteLLM's cost map is its local copy (`LITELLM_LOCAL_MODEL_COST_MAP`),
and a proxy that records and refuses shows that it tried to reach nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client_fleet import (
    CLIENT_KEY,
    CLIENTS,
    MODEL,
    ClientFleet,
    EgressRecorder,
    client_fleet,
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClientFleet, EgressRecorder]]:
    directory = Path(tmp_path_factory.mktemp("litellm"))
    egress = EgressRecorder(directory)
    try:
        with client_fleet(directory) as fleet:
            yield fleet, egress
    finally:
        egress.close()


def test_litellm_whole_stream_and_tool_call(fleet: tuple[ClientFleet, EgressRecorder]) -> None:
    router, egress = fleet
    secret = uuid.uuid4().hex[:10]
    served = router.served("/v1/chat/completions")
    env = {
        **os.environ,
        **egress.env(),
        "ROUTER_URL": router.url,
        "HIVENET_ROUTER_API_KEY": CLIENT_KEY,
        "MODEL": MODEL,
        "TOOL_SECRET": secret,
        # LiteLLM otherwise downloads its model price list at import.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    done = subprocess.run(
        [sys.executable, str(CLIENTS / "litellm_client.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["whole"] == {"text": "Echo: hello from litellm", "finish": "stop", "usage": [3, 4]}
    assert out["stream"] == {"deltas": 4, "text": "Echo: stream from litellm", "usage": [3, 4]}
    assert out["tool_call"] == {
        "finish": "tool_calls",
        "name": "lookup_code",
        "arguments": {"key": "delta"},
    }
    assert out["final"] == f"Echo: code for delta is {secret}"
    assert router.served("/v1/chat/completions") == served + 4
    assert egress.attempts() == []
