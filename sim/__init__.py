"""The simulated engine: a small vLLM look-alike that answers deterministically.

It speaks the HTTP API of a real engine (OpenAI chat/completions/embeddings, vLLM rerank
and `/tokenize`, Anthropic messages, `/health`, `/v1/models`, vLLM-named `/metrics`), so
the agent and router meet it exactly as they meet vLLM. `--kind sglang`, `llamacpp` or
`ollama` gives another engine's health answer, model list and metrics page (Ollama:
`/api/tags`, no `/metrics`), for the agent's adapters of those engines. Answers are a
function of the prompt; timing, failures and stalls are set at start or at run time
through `/sim/state`.

The package stands apart from both daemons (it imports neither) and its HTTP server,
Hypercorn, is the optional `sim` extra: the router and an agent in front of a real engine
never load it. Run it with `python -m sim`.
"""

from __future__ import annotations

EXTRA = "sim"
MISSING_EXTRA = (
    f"the simulated engine needs the `{EXTRA}` extra (its HTTP server, Hypercorn): "
    f"pip install 'hivenet-router[{EXTRA}]'"
)


def missing_extra() -> str | None:
    """Why the simulator cannot serve in this environment, or None when it can."""
    try:
        import hypercorn  # noqa: F401
    except ImportError:
        return MISSING_EXTRA
    return None
