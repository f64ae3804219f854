"""vLLM's own endpoints beside the OpenAI ones: `/v1/rerank` and `/tokenize` (and
llama-server's `/tokenize`, another body)."""

from __future__ import annotations

import hashlib
from functools import partial
from typing import TYPE_CHECKING, Any

from sim.asgi import Exchange, dumps
from sim.generation import RequestError, Run, content_text, conversation, words

if TYPE_CHECKING:
    from sim.app import SimEngine


def prepare_rerank(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    query = payload.get("query")
    documents = payload.get("documents")
    if not isinstance(query, str) or not isinstance(documents, list):
        raise RequestError(400, "`query` must be a string and `documents` a list")
    texts = []
    for document in documents:
        if isinstance(document, dict):
            document = document.get("text")
        if not isinstance(document, str):
            raise RequestError(400, "each document must be a string or {'text': ...}")
        texts.append(document)
    top_n = payload.get("top_n") or len(texts)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise RequestError(400, "`top_n` must be a non-negative integer")
    return partial(_rerank, engine, query, texts, top_n)


async def _rerank(
    engine: SimEngine, query: str, texts: list[str], top_n: int, exchange: Exchange
) -> None:
    query_words = words(query)
    wanted = {w.lower() for w in query_words}
    scored = []
    tokens = 0
    for index, text in enumerate(texts):
        document = words(text)
        tokens += len(query_words) + len(document)
        # Share of the query's words found in the document: deterministic and ordered
        # the way a test author expects.
        found = wanted.intersection(w.lower() for w in document)
        scored.append((len(found) / len(wanted) if wanted else 0.0, index, text))
    await engine.prefill(tokens)
    scored.sort(key=lambda item: (-item[0], item[1]))
    body = {
        "id": f"rerank-sim{engine.next_id()}",
        "model": engine.model,
        "usage": {"total_tokens": tokens},
        "results": [
            {"index": index, "document": {"text": text}, "relevance_score": score}
            for score, index, text in scored[:top_n]
        ],
    }
    await exchange.reply(200, dumps(body))


def prepare_tokenize(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    """A chat (`messages`) or a `prompt`, counted as generation counts it."""
    if "messages" in payload:
        count = len(conversation(payload["messages"])[0])
        prompt = [w for m in payload["messages"] for w in words(content_text(m.get("content")))]
    elif isinstance(payload.get("prompt"), str):
        prompt = words(payload["prompt"])
        count = len(prompt)
    else:
        raise RequestError(400, "either `messages` or `prompt` (a string) is required")
    # Word ids stand in for token ids; the count is what generation reports as usage.
    tokens = [_word_id(w) for w in prompt]
    body = dumps({"count": count, "max_model_len": engine.max_context, "tokens": tokens})

    async def run(exchange: Exchange) -> None:
        await exchange.reply(200, body)

    return run


# The id llama.cpp's models give the beginning of text, which `add_special` puts first.
_BOS = 1


def prepare_llamacpp_tokenize(engine: SimEngine, payload: dict[str, Any], started: float) -> Run:
    """llama-server's `/tokenize`: `{"content"}` in, `{"tokens": [...]}` out, no count."""
    content = payload.get("content")
    if not isinstance(content, str):
        raise RequestError(400, "`content` (a string) is required")
    tokens = [_word_id(w) for w in words(content)]
    if payload.get("add_special") is True:
        tokens.insert(0, _BOS)
    body = dumps({"tokens": tokens})

    async def run(exchange: Exchange) -> None:
        await exchange.reply(200, body)

    return run


def _word_id(word: str) -> int:
    """A word's stand-in token id."""
    return int.from_bytes(hashlib.blake2s(word.encode()).digest()[:2])
