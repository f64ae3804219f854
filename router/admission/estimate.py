"""One input-token estimate per request, learned per model from the engines' exact usage.

Every check reads this one number: the B1 cap, the B2 occupancy footprint, the B4
input-tokens-per-minute bucket and the daily token budget. It is computed from the body
the client API already parsed (no second parse): the text of every message in either
protocol, Anthropic's top-level `system`, the `tools` JSON (tool schemas become part of
the prompt), and a per-message overhead for the chat template's role markers.

Tokens per character start at 1/3.2 (upstream's 3.2 bytes per token; characters here,
because counting bytes would encode every string, and the learned ratio absorbs the
difference) and move toward each exact `prompt_tokens` the model's engines report with
an EWMA of weight 0.2, clamped to 0.05-1.0 tokens per character so that one odd report
(a cached prompt, a tokenizer bug) cannot poison later estimates. Requests with images
do not train the ratio: image tokens are not proportional to any text.

Each image part counts a per-model number of tokens instead, 768 to start (a 448-672
pixel tile in today's vision encoders), learned from the exact `prompt_tokens` of
requests with images once their text estimate is taken off (same EWMA, clamped to
64-16384 tokens per image), so that images weigh on occupancy, key buckets and the
daily budget, not only on `images_max`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

DEFAULT_TOKENS_PER_CHAR = 1 / 3.2
EWMA_WEIGHT = 0.2
MIN_TOKENS_PER_CHAR = 0.05
MAX_TOKENS_PER_CHAR = 1.0
# Role markers and separators a chat template adds per message (Llama 3: 4-5 tokens,
# ChatML: 4); counted for textless messages too.
MESSAGE_OVERHEAD = 4
# A text shorter than this teaches nothing: the overhead dominates it.
MIN_LEARNING_CHARS = 64
_IMAGE_TYPES = frozenset(("image_url", "image", "input_image"))
DEFAULT_IMAGE_TOKENS = 768.0
MIN_IMAGE_TOKENS = 64.0
MAX_IMAGE_TOKENS = 16384.0


@dataclass(frozen=True, slots=True)
class InputEstimate:
    tokens: int  # estimated input tokens, overhead included
    images: int  # image parts (OpenAI `image_url`, Anthropic `image`)
    chars: int  # text characters the estimate was made from
    messages: int
    # `max_completion_tokens`, else `max_tokens` (`max_output_tokens` for /v1/responses);
    # 0: undeclared (the reservation then grows with the streamed output).
    declared_output: int
    # Token ids sent as such (embeddings' `input` as integer arrays): exact already.
    exact_tokens: int = 0
    # The part of `tokens` counted for the images (per-image estimate times images).
    image_tokens: int = 0

    @property
    def footprint(self) -> int:
        """What the request may occupy: its input and the output it may ask for."""
        return self.tokens + self.declared_output


@dataclass
class _Tally:
    chars: int = 0
    images: int = 0
    messages: int = 0
    exact: int = 0


def _content(value: Any, tally: _Tally) -> None:
    """Text and images of a message's `content`: a string, or a list of parts/blocks."""
    if isinstance(value, str):
        tally.chars += len(value)
        return
    if not isinstance(value, list):
        if isinstance(value, dict):
            _part(value, tally)
        return
    for part in value:
        if isinstance(part, str):
            tally.chars += len(part)
        elif isinstance(part, dict):
            _part(part, tally)


def _part(part: dict[str, Any], tally: _Tally) -> None:
    kind = part.get("type")
    if kind in _IMAGE_TYPES:
        tally.images += 1
        return
    text = part.get("text")
    if isinstance(text, str):
        tally.chars += len(text)
    # Anthropic's tool_use input and tool_result content are prompt text too.
    if kind == "tool_use" and "input" in part:
        tally.chars += len(orjson.dumps(part["input"]))
    elif kind == "tool_result" and "content" in part:
        _content(part["content"], tally)


def _messages(messages: Any, tally: _Tally) -> None:
    if not isinstance(messages, list):
        return
    for message in messages:
        tally.messages += 1
        if not isinstance(message, dict):
            continue
        _content(message.get("content"), tally)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            # OpenAI's tool calls: their arguments are a JSON string the model wrote.
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    for name in ("name", "arguments"):
                        value = function.get(name)
                        if isinstance(value, str):
                            tally.chars += len(value)


def _inputs(value: Any, tally: _Tally) -> None:
    """Embeddings' and completions' `input`/`prompt`: text, texts, or token ids."""
    if isinstance(value, str):
        tally.chars += len(value)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, str):
                tally.chars += len(item)
            elif isinstance(item, int):
                tally.exact += 1
            elif isinstance(item, list):
                tally.exact += len(item)
            elif isinstance(item, dict):
                # /v1/responses items: messages with content.
                tally.messages += 1
                _content(item.get("content"), tally)


def _declared(payload: dict[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            # Negative: treated as undeclared rather than shrinking the footprint.
            return max(0, value)
    return 0


def measure(payload: dict[str, Any]) -> _Tally:
    """Characters, images, messages and token ids of a parsed request body."""
    tally = _Tally()
    _messages(payload.get("messages"), tally)
    system = payload.get("system")
    if system is not None:
        tally.messages += 1
        _content(system, tally)
    tools = payload.get("tools")
    if tools:
        tally.chars += len(orjson.dumps(tools))
    for name in ("input", "prompt"):
        if name in payload:
            _inputs(payload[name], tally)
    # Rerank: the query and every document are encoded.
    query = payload.get("query")
    if isinstance(query, str):
        tally.chars += len(query)
    documents = payload.get("documents")
    if isinstance(documents, list):
        for doc in documents:
            _content(doc, tally)
    return tally


class Estimator:
    """Tokens per character for each model, and the estimate of a request."""

    def __init__(self) -> None:
        # Reset by a restart, as upstream: a few answers relearn it.
        self.ratios: dict[str, float] = {}
        self.image_tokens: dict[str, float] = {}

    def ratio(self, model: str) -> float:
        return self.ratios.get(model, DEFAULT_TOKENS_PER_CHAR)

    def per_image(self, model: str) -> float:
        return self.image_tokens.get(model, DEFAULT_IMAGE_TOKENS)

    def estimate(self, model: str, payload: dict[str, Any]) -> InputEstimate:
        tally = measure(payload)
        images = int(tally.images * self.per_image(model) + 0.5) if tally.images else 0
        tokens = (
            int(tally.chars * self.ratio(model) + 0.5)
            + tally.messages * MESSAGE_OVERHEAD
            + tally.exact
            + images
        )
        return InputEstimate(
            tokens,
            tally.images,
            tally.chars,
            tally.messages,
            _declared(payload),
            tally.exact,
            images,
        )

    def learn(self, model: str, estimate: InputEstimate, prompt_tokens: int) -> None:
        """Move the model's ratio toward what the engine counted for `estimate`'s text,
        or, with images, its per-image count toward what the text leaves."""
        if estimate.images:
            text_tokens = estimate.tokens - estimate.image_tokens
            observed = (prompt_tokens - text_tokens) / estimate.images
            observed = min(MAX_IMAGE_TOKENS, max(MIN_IMAGE_TOKENS, observed))
            per_image = self.per_image(model) * (1 - EWMA_WEIGHT) + observed * EWMA_WEIGHT
            self.image_tokens[model] = per_image
            return
        if estimate.chars < MIN_LEARNING_CHARS:
            return
        text_tokens = prompt_tokens - estimate.messages * MESSAGE_OVERHEAD - estimate.exact_tokens
        observed = min(MAX_TOKENS_PER_CHAR, max(MIN_TOKENS_PER_CHAR, text_tokens / estimate.chars))
        ratio = self.ratio(model) * (1 - EWMA_WEIGHT) + observed * EWMA_WEIGHT
        self.ratios[model] = min(MAX_TOKENS_PER_CHAR, max(MIN_TOKENS_PER_CHAR, ratio))
