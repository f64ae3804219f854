"""prefix-aware with real processes: a router, three simulated agents with a prefix cache,
the official OpenAI SDK. A conversation keeps going back to the agent that holds its
prefix and is served from that engine's cache; another one goes where there is room."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

from tests.fleet import Agent, Fleet

POLICY = """\
routing_policy:
  match: {}
  strategy: prefix-aware
"""


def served_by(agents: list[Agent], call: Callable[[], Any]) -> tuple[Agent, Any]:
    """Run `call` and name the one agent whose engine counted the request."""
    before = [a.sim_state()["requests_total"] for a in agents]
    result = call()
    after = [a.sim_state()["requests_total"] for a in agents]
    moved = [a for a, b, c in zip(agents, before, after, strict=True) if c != b]
    assert len(moved) == 1, (before, after)
    return moved[0], result


def turn(messages: list[dict]) -> Callable[[openai.OpenAI], Any]:
    def call(client: openai.OpenAI) -> Any:
        return client.chat.completions.create(model="m1", messages=messages, max_tokens=8)

    return call


def test_a_conversation_sticks_to_its_cache_and_another_goes_elsewhere(
    fleet: Fleet, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    router = fleet.router("--policy-file", str(policy), "--stream-slot-release", "end")
    agents = sorted((fleet.agent(router, wait=False) for _ in range(3)), key=lambda a: a.peer_id)
    fleet.join(*agents)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    first_system = "You answer questions about the tide tables of Brittany. " * 12
    chat = [
        {"role": "system", "content": first_system},
        {"role": "user", "content": "When is high tide at Saint-Malo tomorrow morning?"},
    ]
    # Nothing remembered and every agent idle: least-loaded's tie-break, the lowest ID.
    home, answer = served_by(agents, lambda: turn(chat)(client))
    assert home is agents[0]
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    chat += [
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "And in the evening?"},
    ]

    # While the conversation's next turn streams from its agent (slowly, so the slot stays
    # held to the stream's end), a conversation that shares nothing goes to an idle agent.
    home.sim_state(token_latency=1.0)
    stream = client.chat.completions.create(model="m1", messages=chat, max_tokens=40, stream=True)
    try:
        first = next(chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
        assert first.choices[0].delta.content
        assert router.agent(home.peer_id)["status"]["active_requests"] == 1
        other_chat = [
            {"role": "system", "content": "You translate recipes from French. " * 12},
            {"role": "user", "content": "Traduisez : deux oeufs, un verre de lait."},
        ]
        elsewhere, other_answer = served_by(agents, lambda: turn(other_chat)(client))
    finally:
        stream.close()
    home.sim_state(token_latency=0.0)
    assert elsewhere is not home
    assert other_answer.usage.prompt_tokens_details.cached_tokens == 0

    # The conversation's third turn returns home and finds its prefix in that cache.
    chat += [
        {"role": "assistant", "content": "It is at 19:40."},
        {"role": "user", "content": "Thank you. What about the day after?"},
    ]
    again, third = served_by(agents, lambda: turn(chat)(client))
    assert again is home
    assert third.usage.prompt_tokens_details.cached_tokens > 0
    # And the other conversation's second turn returns to where it went.
    other_chat += [
        {"role": "assistant", "content": other_answer.choices[0].message.content},
        {"role": "user", "content": "Et : une pincée de sel."},
    ]
    back, second = served_by(agents, lambda: turn(other_chat)(client))
    assert back is elsewhere
    assert second.usage.prompt_tokens_details.cached_tokens > 0
