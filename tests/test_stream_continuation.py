"""Stream continuation against real processes: sim agents SIGKILLed mid-stream under
load, met by the official OpenAI and Anthropic SDKs.

Every client must get one complete, well-formed stream: one id, the whole answer's text
in order with nothing repeated or missing (the sim's answer is a function of the
position, so a splice shows), the finish reason and one usage block for both parts.
A stream that no agent can continue (none left, or only an engine that cannot) ends
with the error event, as before continuation existed.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import trio

from tests.fleet import Agent, Fleet, Proc, Router, free_port, wait_until

WORDS = [f"w{i}" for i in range(30)]
PROMPT = " ".join(WORDS)
EXPECTED = "Echo: " + PROMPT
TOKENS = len(WORDS) + 1
LATENCY = "30ms"  # 31 tokens: about 0.9 s a stream, long enough to be cut


def _agent(
    fleet: Fleet, router: Router, *flags: str, engine: str = "sim", wait: bool = True
) -> Agent:
    return fleet.agent(
        router,
        "m1",
        "--capacity",
        "32",
        "--sim-token-latency",
        LATENCY,
        *flags,
        engine=engine,
        wait=wait,
    )


async def read_chat_stream(
    stream: openai.AsyncStream,
) -> tuple[set[tuple[str, int, str]], str, list[str], list[tuple[int, int]]]:
    """An SDK chat stream, read to its end: the (id, created, model) seen, the text, the
    finish reasons and the (prompt, completion) tokens of the usage-only chunk."""
    ids, text, finish, usage = set(), "", [], []
    async for chunk in stream:
        ids.add((chunk.id, chunk.created, chunk.model))
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
        # The usage chunk (every chunk carries the running count: agent/usage.py).
        if chunk.usage is not None and not chunk.choices:
            usage.append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
    return ids, text, finish, usage


async def _chat(router: Router, problems: list[str], errors: list[str]) -> None:
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            stream_options={"include_usage": True},
        )
        ids, text, finish, usage = await read_chat_stream(stream)
    except openai.APIError as exc:
        errors.append(f"chat: {exc}")
        return
    finally:
        await client.close()
    if len(ids) != 1 or text != EXPECTED or finish != ["stop"] or usage != [(30, TOKENS)]:
        problems.append(f"chat: ids={ids} text={text!r} finish={finish} usage={usage}")


async def _messages(router: Router, problems: list[str], errors: list[str]) -> None:
    client = anthropic.AsyncAnthropic(base_url=router.url, api_key="x", max_retries=0)
    try:
        stream = await client.messages.create(
            model="m1",
            max_tokens=100,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
        )
        kinds, text, stops, output = [], "", [], []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                assert event.index == 0
                text += event.delta.text
            elif event.type == "message_delta":
                stops.append(event.delta.stop_reason)
                output.append(event.usage.output_tokens)
    except anthropic.APIError as exc:
        errors.append(f"messages: {exc}")
        return
    finally:
        await client.close()
    shape = [k for k in kinds if k != "content_block_delta"]
    want = ["message_start", "content_block_start", "content_block_stop", "message_delta"]
    if shape != [*want, "message_stop"] or text != EXPECTED or stops != ["end_turn"]:
        problems.append(f"messages: events={shape} text={text!r} stop={stops}")
    if output != [TOKENS]:
        problems.append(f"messages: output_tokens={output}")


def _active(router: Router) -> dict[str, int]:
    """Slots held per live agent (a dead one stays in the table a while, unhealthy)."""
    rows = router.agents()
    return {a["peer_id"]: a["status"]["active_requests"] for a in rows if a["status"]["healthy"]}


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


async def _kill(agent: Agent) -> None:
    await trio.to_thread.run_sync(lambda: agent.stop(signal.SIGKILL))


async def test_streams_go_on_from_another_agent_when_theirs_is_killed(
    fleet: Fleet, tmp_path: Path
) -> None:
    router = fleet.router()
    agents = [_agent(fleet, router, wait=False) for _ in range(4)]
    for agent in agents:  # started together: a quarter of the wait
        router.wait_agent(agent.peer_id)
    problems: list[str] = []
    errors: list[str] = []

    # 24 streams over 4 agents; two agents killed while about a third of each stream
    # is out, the second after some streams were already moved onto it.
    async with trio.open_nursery() as nursery:
        for _ in range(12):
            nursery.start_soon(_chat, router, problems, errors)
            nursery.start_soon(_messages, router, problems, errors)
        await trio.sleep(0.35)
        await _kill(agents[0])
        await trio.sleep(0.2)
        await _kill(agents[1])
    assert not errors and not problems, (errors, problems)
    continued = router.metric("hivenet_router_stream_continuations_total", outcome="continued")
    assert continued >= 2, router.metrics()
    assert "stream_continued from=" in router.log()
    survivors = agents[2:]
    wait_until(lambda: set(_active(router)) == {a.peer_id for a in survivors}, 15, "the dead gone")
    wait_until(lambda: not any(_active(router).values()), 15, "every slot released")
    for agent in survivors:
        assert agent.sim_state()["in_flight"] == 0

    # A stream held after 5 tokens on the last sim agent; then a `custom` agent joins,
    # whose engine cannot continue a turn, and the sim agent is killed: the error event.
    await _kill(survivors[1])
    survivors[0].sim_state(stall_after_tokens=5)
    sim_port = free_port()
    engine = Proc(
        "sim",
        [sys.executable, "-m", "sim", "--model", "m1", "--port", str(sim_port)],
        fleet.env,
        tmp_path / "custom-sim.log",
    )
    fleet.procs.append(engine.start())
    url = f"http://127.0.0.1:{sim_port}"
    refused = "hivenet_router_stream_continuations_total"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_chat, router, problems, errors)
        held = lambda: survivors[0].sim_state()["in_flight"] == 1  # noqa: E731
        await trio.to_thread.run_sync(lambda: wait_until(held, 10, "the held stream"))
        await trio.to_thread.run_sync(lambda: wait_until(lambda: _up(url), 15, "the engine"))
        health = url + "/health"
        custom = await trio.to_thread.run_sync(
            lambda: _agent(
                fleet, router, "--backend-url", url, "--health-url", health, engine="custom"
            )
        )
        await _kill(survivors[0])
    assert len(errors) == 1 and "agent_disconnected" in errors[0], errors
    assert not problems, problems
    assert router.metric(refused, outcome="no_agent") == 1

    # No agent left at all: the error event too.
    errors.clear()
    state = url + "/sim/state"
    await trio.to_thread.run_sync(lambda: httpx.post(state, json={"stall_after_tokens": 5}))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_messages, router, problems, errors)
        held = lambda: httpx.get(state).json()["in_flight"] == 1  # noqa: E731
        await trio.to_thread.run_sync(lambda: wait_until(held, 10, "the held stream"))
        await _kill(custom)
    assert len(errors) == 1 and "agent_disconnected" in errors[0], errors
    assert router.metric(refused, outcome="no_agent") == 2
    assert "stream_not_continued from=" in router.log()
