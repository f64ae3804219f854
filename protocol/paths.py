"""The client API paths both daemons know: the router routes them, the agent checks
its engine serves them."""

from __future__ import annotations

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"

API_PATHS = frozenset({CHAT, COMPLETIONS, RESPONSES, MESSAGES, EMBEDDINGS, RERANK})
# The endpoints that generate text: they hold KV cache on an engine.
GENERATIVE = frozenset({CHAT, MESSAGES, COMPLETIONS, RESPONSES})
