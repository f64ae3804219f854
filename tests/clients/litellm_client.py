"""LiteLLM's Python SDK against the router, as docs/integrations/litellm.md shows it: a
whole answer, a streamed one with usage, and a tool call whose result goes back. Run by
tests/test_client_litellm.py with the project's venv; prints one JSON object."""

import json
import os

import litellm

ROUTER = os.environ["ROUTER_URL"]
SECRET = os.environ["TOOL_SECRET"]
# Its cost lookup does not know the router's model names and says so on stderr.
litellm.suppress_debug_info = True
# LiteLLM's OpenAI-compatible route: `openai/<the router's model name>` and the router's
# /v1 as the base.
common = {
    "model": f"openai/{os.environ['MODEL']}",
    "api_base": f"{ROUTER}/v1",
    "api_key": os.environ["HIVENET_ROUTER_API_KEY"],
    "num_retries": 0,
    "timeout": 75,
}

whole = litellm.completion(messages=[{"role": "user", "content": "hello from litellm"}], **common)

chunks = list(
    litellm.completion(
        messages=[{"role": "user", "content": "stream from litellm"}],
        stream=True,
        stream_options={"include_usage": True},
        **common,
    )
)
streamed = litellm.stream_chunk_builder(chunks)

tools = [
    {
        "type": "function",
        "function": {
            "name": "lookup_code",
            "description": "The access code for a key",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}},
                "required": ["key"],
            },
        },
    }
]
messages = [{"role": "user", "content": 'Find the code. sim:call lookup_code {"key": "delta"}'}]
asked = litellm.completion(messages=messages, tools=tools, **common)
call = asked.choices[0].message.tool_calls[0]
arguments = json.loads(call.function.arguments)
messages += [
    asked.choices[0].message.model_dump(),
    {
        "role": "tool",
        "tool_call_id": call.id,
        "content": f"code for {arguments['key']} is {SECRET}",
    },
]
final = litellm.completion(messages=messages, tools=tools, **common)

print(
    json.dumps(
        {
            "whole": {
                "text": whole.choices[0].message.content,
                "finish": whole.choices[0].finish_reason,
                "usage": [whole.usage.prompt_tokens, whole.usage.completion_tokens],
            },
            "stream": {
                "deltas": sum(1 for c in chunks if c.choices and c.choices[0].delta.content),
                "text": streamed.choices[0].message.content,
                "usage": [streamed.usage.prompt_tokens, streamed.usage.completion_tokens],
            },
            "tool_call": {
                "finish": asked.choices[0].finish_reason,
                "name": call.function.name,
                "arguments": arguments,
            },
            "final": final.choices[0].message.content,
        }
    )
)
