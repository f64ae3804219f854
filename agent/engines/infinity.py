"""Infinity (`infinity_emb v2`): embeddings and reranking, OpenAI-style, `/health`.

Started with `INFINITY_URL_PREFIX=/v1` (as upstream's guide has it) it serves
`/v1/embeddings`, `/v1/rerank` and `/v1/models`; `/health` stays at the root. One
Infinity process can serve several models: each agent represents one of them, named by
`--model` (else the first of `/v1/models`), with `--capability embedding` or
`reranker` (the CLI refuses `llm`: Infinity has no chat). Its Prometheus page counts
HTTP requests, not the engine's queue or cache, so no engine gauges are read, as
upstream's agent reads none.
"""

from __future__ import annotations

from agent.engines.base import EngineAdapter
from protocol.paths import EMBEDDINGS, RERANK


class InfinityAdapter(EngineAdapter):
    name = "infinity"
    default_backend_url = "http://localhost:7997"
    metrics_path = None
    api_paths = frozenset({EMBEDDINGS, RERANK})


ADAPTER = InfinityAdapter()
