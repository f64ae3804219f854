"""`/v1/completions` and `/v1/responses` through the router, with the official SDK, and
the agent's capability check for an endpoint its engine lacks.

One router with an auth file (so tokens are charged to a tenant from the engines'
usage), a simulated agent for `m1`, and for the rerank model `rr` a simulated agent
plus an agent with `--engine ollama` in front of the same simulated engine: Ollama has
no rerank API, so that agent refuses `/v1/rerank` before asking its engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from agent.answers import SSEChecker
from agent.engines import get_adapter
from agent.usage import UsageTap
from protocol.usage import normalize
from router.tenants.config import hash_key
from tests.fleet import Agent, Fleet, Router, wait_until

KEY = "hnr-test-endpoints-key"
AUTH = f"""
tenants:
  ep:
    keys: ["{hash_key(KEY)}"]
    tokens_per_day: 100000
"""
# One try per request, turn about: a refusal by the Ollama agent that used the try would
# leave every other `rr` request without an answer.
POLICY = """
routing_policy:
  strategy: round-robin
  max_tries: 1
"""


class EndpointFleet:
    def __init__(self, fleet: Fleet, tmp: Path) -> None:
        auth = tmp / "auth.yaml"
        auth.write_text(AUTH)
        policy = tmp / "policy.yaml"
        policy.write_text(POLICY)
        self.router: Router = fleet.router("--auth-file", str(auth), "--policy-file", str(policy))
        self.sim: Agent = fleet.agent(self.router, "m1", "--sim-token-latency", "2ms", wait=False)
        self.rerank: Agent = fleet.agent(self.router, "rr", "--capability", "reranker")
        engine = self.rerank.sim_url()
        ollama_flags = ["--capability", "reranker", "--backend-url", engine]
        ollama_flags += ["--health-url", engine + "/health"]
        self.ollama_rr: Agent = fleet.agent(
            self.router, "rr", *ollama_flags, engine="ollama", wait=False
        )
        self.ollama_only: Agent = fleet.agent(
            self.router, "ro", *ollama_flags, engine="ollama", wait=False
        )
        fleet.join(self.sim, self.ollama_rr, self.ollama_only)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.router.url + "/v1", api_key=KEY, max_retries=0, timeout=30
        )

    def tokens(self) -> float:
        return self.router.metric("hivenet_router_tenant_tokens_total", tenant="ep")


@pytest.fixture(scope="module")
def ep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EndpointFleet]:
    tmp = Path(tmp_path_factory.mktemp("endpoints"))
    fleet = Fleet(tmp)
    try:
        yield EndpointFleet(fleet, tmp)
    finally:
        fleet.close()


def test_completions_plain_and_streamed_with_usage_charged(ep: EndpointFleet) -> None:
    client = ep.client()
    before = ep.tokens()
    answer = client.completions.create(model="m1", prompt="alpha beta gamma", max_tokens=8)
    assert answer.choices[0].text == "Echo: alpha beta gamma"
    assert answer.usage is not None
    charged = before + answer.usage.prompt_tokens + answer.usage.completion_tokens
    wait_until(lambda: ep.tokens() == charged, 5, "completion usage charged")
    # The client did not ask for usage: the agent asked the engine, and took it out.
    chunks = list(client.completions.create(model="m1", prompt="alpha beta gamma", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Echo: alpha beta gamma"
    assert all(c.usage is None for c in chunks)
    charged += answer.usage.prompt_tokens + answer.usage.completion_tokens
    wait_until(lambda: ep.tokens() == charged, 5, "streamed completion usage charged")


def test_responses_plain_and_streamed_with_usage_charged(ep: EndpointFleet) -> None:
    client = ep.client()
    before = ep.tokens()
    answer = client.responses.create(model="m1", input="one two three", max_output_tokens=20)
    assert answer.output_text == "Echo: one two three"
    assert answer.status == "completed"
    assert answer.usage is not None
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (3, 4)
    charged = before + answer.usage.input_tokens + answer.usage.output_tokens
    wait_until(lambda: ep.tokens() == charged, 5, "response usage charged")
    kinds: list[str] = []
    text = ""
    final = None
    stream = client.responses.create(
        model="m1", input=[{"role": "user", "content": "one two three"}], stream=True
    )
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 4  # one event per token
    assert text == "Echo: one two three"
    assert final is not None and final.usage is not None and final.usage.output_tokens == 4
    charged += final.usage.input_tokens + final.usage.output_tokens
    wait_until(lambda: ep.tokens() == charged, 5, "streamed response usage charged")
    # The SDK's stream helper, which needs each item announced before its deltas.
    with client.responses.stream(model="m1", input="one two") as helped:
        deltas = [e.delta for e in helped if e.type == "response.output_text.delta"]
        response = helped.get_final_response()
    assert "".join(deltas) == response.output_text == "Echo: one two"


def test_new_endpoints_check_their_fields(ep: EndpointFleet) -> None:
    client = ep.client()
    with pytest.raises(openai.BadRequestError) as missing:
        client.post("/responses", body={"model": "m1"}, cast_to=httpx.Response)
    assert missing.value.body["code"] == "request_invalid"  # type: ignore[index]
    assert "'input' is required" in missing.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as wrong:
        client.completions.create(model="m1", prompt="x", max_tokens=-1)
    assert "'max_tokens' must be a non-negative integer" in str(wrong.value)


def test_engine_without_the_endpoint_is_refused_by_its_agent(ep: EndpointFleet) -> None:
    client = httpx.Client(base_url=ep.router.url, timeout=30)
    headers = {"authorization": f"Bearer {KEY}"}
    body = {"query": "q", "documents": ["a", "b"]}
    # Only an Ollama agent serves `ro`: a clear 404, not a backend error.
    refused = client.post("/v1/rerank", json={"model": "ro", **body}, headers=headers)
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert error["code"] == "endpoint_not_supported"
    assert "engine ollama does not serve /v1/rerank" in error["message"]
    # `rr` has an Ollama agent and a sim agent: every request is served, by the sim,
    # though half of them are sent to the Ollama agent first.
    for _ in range(6):
        served = client.post("/v1/rerank", json={"model": "rr", **body}, headers=headers)
        assert served.status_code == 200, served.text
    for agent in (ep.ollama_rr, ep.ollama_only):
        row = ep.router.agent(agent.peer_id)
        assert row is not None
        # Not charged to the agent: its engine was never asked.
        assert row["universal"]["consecutive_failures"] == 0
        assert row["status"]["healthy"]
    assert (
        ep.router.metric("hivenet_router_forward_failures_total", code="endpoint_not_supported")
        >= 1
    )
    # The engine behind the Ollama agents was asked only by the sim agent.
    assert ep.rerank.sim_state()["requests_total"] == 6


# --- the pieces, without processes ---------------------------------------------------------


def test_each_adapter_names_the_endpoints_its_engine_serves() -> None:
    for engine in ("vllm", "sglang", "llamacpp", "ollama", "custom", "sim"):
        adapter = get_adapter(engine)
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
            assert adapter.serves(path), (engine, path)
        # Paths the check does not know about are the engine's to answer.
        assert adapter.serves("/tokenize")
    assert not get_adapter("ollama").serves("/v1/rerank")
    assert get_adapter("vllm").serves("/v1/rerank")


def test_responses_usage_counts_input_and_output_tokens() -> None:
    usage = {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 8},
        "output_tokens": 5,
        "total_tokens": 17,
    }
    # Not the total as the prompt (the rerank rule): cached tokens are inside input_tokens.
    assert normalize(usage) == {"prompt_tokens": 12, "completion_tokens": 5}
    tap = UsageTap({"body": b"{}", "stream": True, "path": "/v1/responses"})
    assert not tap.of_event({"type": "response.created", "response": {"usage": None}})
    assert not tap.of_event({"type": "response.completed", "response": {"usage": usage}})
    assert tap.usage == {"prompt_tokens": 12, "completion_tokens": 5}


def test_a_responses_stream_ends_at_its_terminal_event() -> None:
    checker = SSEChecker()
    created = b'event: response.created\ndata: {"type":"response.created"}\n\n'
    assert checker.feed(created) == created and not checker.finished
    # A hostile `type` (not a string) is data like any other, never a crash.
    odd = b'data: {"type":[1]}\n\n'
    assert checker.feed(odd) == odd and not checker.finished
    done = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
    assert checker.feed(done) == done and checker.finished
