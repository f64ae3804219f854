"""The simulated engine's scripted tool calls (sim/tools.py), met by the official SDKs'
own tool-call parsers: whole and streamed, OpenAI and Anthropic, and the turn that
carries the tool's result back."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import trio

from sim.__main__ import serve_sim
from sim.app import create_sim_app
from sim.tools import ToolCall, scripted_call

MODEL = "sim/tool-model"
ARGS = {"path": "/tmp/notes.txt", "lines": [1, 2]}
PROMPT = f"please sim:call read_file {json.dumps(ARGS)} now"
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
ANTHROPIC_TOOLS = [{"name": "read_file", "input_schema": {"type": "object"}}]


async def _start(nursery: trio.Nursery) -> str:
    app = create_sim_app(MODEL, token_latency=0.001)
    port = await nursery.start(serve_sim, app, "127.0.0.1", 0)
    return f"http://127.0.0.1:{port}"


def test_the_directive_needs_an_offered_tool_and_a_user_turn() -> None:
    user = {"role": "user", "content": PROMPT}
    assert scripted_call({"messages": [user], "tools": OPENAI_TOOLS}) == ToolCall(
        "read_file", json.dumps(ARGS)
    )
    assert scripted_call({"messages": [user], "tools": ANTHROPIC_TOOLS}) is not None
    # Not offered, forbidden, or not the last turn's: a text answer, as a model gives.
    assert scripted_call({"messages": [user]}) is None
    assert scripted_call({"messages": [user], "tools": [{"name": "other"}]}) is None
    assert scripted_call({"messages": [user], "tools": OPENAI_TOOLS, "tool_choice": "none"}) is None
    # System messages after the user's turn (Claude Code's environment) are passed over.
    system = {"role": "system", "content": "env"}
    assert scripted_call({"messages": [user, system], "tools": OPENAI_TOOLS}) is not None
    result = {"role": "tool", "tool_call_id": "c1", "content": "done"}
    assert scripted_call({"messages": [user, result], "tools": OPENAI_TOOLS}) is None
    # Hostile or broken arguments script nothing, and never raise.
    deep = "sim:call read_file " + '{"a":' * 100_000
    for text in ("sim:call read_file [1]", "sim:call read_file {bad", "sim:call read_file", deep):
        message = {"role": "user", "content": text}
        assert scripted_call({"messages": [message], "tools": OPENAI_TOOLS}) is None
    for payload in ({}, {"messages": "x"}, {"messages": [1]}, {"messages": [], "tools": 3}):
        assert scripted_call(payload) is None
    # The arguments' fragments join back to the exact JSON.
    call = ToolCall("t", json.dumps(ARGS))
    assert "".join(call.pieces()) == call.arguments and len(call.pieces()) > 1


async def test_openai_tool_call_whole_and_streamed_then_the_result(nursery: trio.Nursery) -> None:
    url = await _start(nursery)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": PROMPT}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "read_file"
    assert json.loads(calls[0].function.arguments) == ARGS
    assert whole.usage is not None and whole.usage.completion_tokens == len(
        ToolCall("read_file", json.dumps(ARGS)).pieces()
    )

    # The SDK's own stream accumulator rebuilds the call from its fragments.
    async with client.chat.completions.stream(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, stream_options={"include_usage": True}
    ) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.tool_calls is not None
    assert streamed.message.tool_calls[0].id.startswith("call_sim")
    assert json.loads(streamed.message.tool_calls[0].function.arguments) == ARGS
    assert (
        final.usage is not None and final.usage.completion_tokens == whole.usage.completion_tokens
    )

    # The client ran the tool and sends its result: the answer is about the result.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [calls[0].model_dump()],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "line one; line two"},
    ]
    after = await client.chat.completions.create(model=MODEL, messages=messages, tools=OPENAI_TOOLS)
    assert after.choices[0].finish_reason == "stop"
    assert after.choices[0].message.content == "Echo: line one; line two"

    # Cut by max_tokens: `length`, as an engine cuts a call short.
    cut = await client.chat.completions.create(
        model=MODEL, messages=messages[:1], tools=OPENAI_TOOLS, max_tokens=1
    )
    assert cut.choices[0].finish_reason == "length"


async def test_anthropic_tool_use_whole_and_streamed_then_the_result(
    nursery: trio.Nursery,
) -> None:
    url = await _start(nursery)
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    whole = await client.messages.create(
        model=MODEL, max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS
    )
    assert whole.stop_reason == "tool_use"
    block = whole.content[0]
    assert block.type == "tool_use" and block.name == "read_file" and block.input == ARGS

    async with client.messages.stream(
        model=MODEL, max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS
    ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = final.content[0]
    assert streamed.type == "tool_use" and streamed.input == ARGS
    assert final.usage.output_tokens == whole.usage.output_tokens

    messages += [
        {"role": "assistant", "content": [block.model_dump()]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": block.id, "content": "the file says hi"}
            ],
        },
    ]
    after = await client.messages.create(
        model=MODEL, max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS
    )
    assert after.stop_reason == "end_turn"
    assert after.content[0].type == "text" and after.content[0].text == "Echo: the file says hi"


async def test_a_tool_result_is_counted_as_the_prompt_it_is(nursery: trio.Nursery) -> None:
    """`/tokenize` and the answer's usage agree on a conversation with a tool result,
    so count_tokens through the router keeps matching what the engine bills."""
    url = await _start(nursery)
    messages = [
        {"role": "user", "content": "run it"},
        {"role": "tool", "tool_call_id": "c1", "content": "three words here"},
    ]
    async with httpx.AsyncClient(base_url=url) as client:
        count = (await client.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
        answer = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages}
        )
    assert answer.json()["usage"]["prompt_tokens"] == count["count"] == 5
