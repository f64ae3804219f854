"""The admin API's views of the routing table, health, models and policy, and the
replacement of a running document (policy, auth file) by `PUT`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import trio

from protocol.errors import ErrorCode, RouterError, error_payload
from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from router.agent_detail import gpu_total
from router.capacity import WaitQueue
from router.documents import Contended, DocumentStore, PreconditionFailed, etag
from router.http.asgi import BodyTooLarge, ClientGone, Receive, Scope, Send, read_body, send_json
from router.http.preconditions import if_match, send_contended, send_precondition_failed
from router.metrics_page import Pace
from router.peers import Peer, PeerTable
from router.policy.gates import metric_value
from router.policy.models import as_json
from router.policy.store import PolicyStore


def _unix(monotonic_at: float, now: float) -> int:
    """A monotonic instant as Unix seconds, upstream's unit for `last_seen`."""
    return int(time.time() - (now - monotonic_at))


def _wall(monotonic_at: float, now: float) -> str:
    at = time.time() - (now - monotonic_at)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


def _percent(fraction: object) -> float | None:
    return round(fraction * 100, 2) if isinstance(fraction, float | int) else None


def _age(at: float, now: float) -> float | None:
    return round(now - at, 3) if at else None


def agent_view(peer: Peer, now: float) -> dict:
    stats = peer.stats
    engine: dict[str, float | str | None] = {f: metric_value(peer, f, now) for f in ENGINE_FIELDS}
    engine["age_seconds"] = _age(peer.engine_at, now)
    engine["preemptions_total"] = peer.preemptions
    hardware: dict[str, object] = {f: metric_value(peer, f, now) for f in HARDWARE_FIELDS}
    hardware["age_seconds"] = _age(peer.hardware_at, now)
    # Upstream's per-GPU array and byte counts, beside the policy's fractions.
    hardware["gpu"] = [g.to_json() for g in peer.gpus]
    hardware["gpu_power_watts"] = gpu_total(peer.gpus, "power_watts")
    hardware["gpu_vram_used_bytes"] = gpu_total(peer.gpus, "vram_used_bytes")
    hardware.update(peer.memory)
    # Upstream's nested objects, in its units (percent, not the policy's fractions).
    cpu, memory = hardware["cpu_usage_percent"], hardware["memory_used_percent"]
    hardware["cpu"] = {"usage_percent": _percent(cpu)}
    hardware["memory"] = {
        "used_percent": _percent(memory),
        "available_bytes": peer.memory.get("memory_available_bytes"),
        "total_bytes": peer.memory.get("memory_total_bytes"),
    }
    hardware["timestamp"] = _wall(peer.hardware_at, now) if peer.hardware_at else None
    return {
        "peer_id": peer.peer_id,
        "metadata": peer.metadata.to_json(),
        "status": {
            "healthy": peer.healthy and peer.connected,
            "backend_healthy": peer.backend_healthy,
            "connected": peer.connected,
            "draining": peer.draining,
            "last_seen": _wall(peer.last_seen, now),
            "active_requests": peer.active,
            "capacity_utilization": peer.load_ratio,
            "remote_addr": peer.remote_addr or None,
        },
        "universal": {
            "success_rate": stats.success_rate,
            "srtt": stats.srtt_ms,
            "consecutive_failures": stats.consecutive_failures,
            # Lifetime counts (kept across restarts by router/lifetime.py), named as
            # upstream's routing table names them.
            "successful_requests_total": stats.successes,
            "failed_requests_total": stats.failures,
            "input_tokens_total": stats.input_tokens,
            "output_tokens_total": stats.output_tokens,
            "rejected_requests_total": stats.rejections,
            "disconnections_total": stats.disconnections,
            "agent_failures_total": stats.agent_failures,
            "backend_failures_total": stats.backend_failures,
            "srtt_ms": stats.srtt_ms,
            "rttvar_ms": stats.rttvar_ms,
            "latency_state": "UNKNOWN" if stats.srtt_ms is None else "KNOWN",
        },
        "engine": engine,
        "hardware": hardware,
    }


def routing_table(table: PeerTable) -> dict:
    now = trio.current_time()
    peers = sorted(table.all(), key=lambda p: (p.metadata.model, p.peer_id))
    return {"total": len(peers), "agents": [agent_view(p, now) for p in peers]}  # upstream's


async def routing_table_json(table: PeerTable) -> bytes:
    """`routing_table`'s JSON, the same bytes, built an agent at a time with a
    checkpoint every `STEP_SECONDS`: with 1,000 agents the whole took one turn of the
    event loop 22 to 33 ms (bench.fleet's polls, issue 51), once per poll of the console.
    Each agent's view is whole; the agents are seen as they stand at their step."""
    now = trio.current_time()
    peers = sorted(table.all(), key=lambda p: (p.metadata.model, p.peer_id))
    pace = Pace()
    views = []
    for peer in peers:
        views.append(json.dumps(agent_view(peer, now), separators=(",", ":")))
        await pace.step()
    return f'{{"total":{len(peers)},"agents":[{",".join(views)}]}}'.encode()


def health(table: PeerTable, queue: WaitQueue) -> dict:
    now = trio.current_time()
    peers = table.all()
    healthy = sum(1 for p in peers if p.routable)
    queues = {model: queue.length(model) for model in table.models()}
    # Upstream's fields (`timestamp`, `queue_length`, `engine`, `version`, `region`,
    # `is_healthy`) beside this router's own.
    return {
        # Upstream's rule, which its operators' checks read: healthy while any agent is.
        "status": "healthy" if healthy else "degraded",
        "timestamp": int(time.time()),
        "total_agents": len(peers),
        "healthy_agents": healthy,
        "queue_length": sum(queues.values()),
        "queues": queues,
        "agents": [_health_row(p, now) for p in sorted(peers, key=lambda p: p.peer_id)],
    }


def _health_row(peer: Peer, now: float) -> dict[str, object]:
    return {
        "peer_id": peer.peer_id,
        "model": peer.metadata.model,
        "engine": peer.metadata.engine,
        "version": peer.metadata.version,
        "region": peer.metadata.region,
        # The agent's own link and heartbeats; its engine's health is `backend_healthy`.
        "healthy": peer.healthy and peer.connected,
        # Upstream's: whether requests may go to it, as `healthy_agents` counts (and
        # `/v1/models/{model}`'s `is_healthy`).
        "is_healthy": peer.routable,
        "backend_healthy": peer.backend_healthy,
        "active_requests": peer.active,
        "capacity": peer.metadata.capacity,
        # Unix seconds, as upstream's health checks read it (the routing table keeps
        # ISO 8601 in `status.last_seen`).
        "last_seen": _unix(peer.last_seen, now),
    }


def wants_json(accept: str | None) -> bool:
    """Whether an `Accept` header asks for JSON rather than this router's YAML: it names
    `application/json` and no YAML type (upstream's scripts read the policy as JSON)."""
    if not accept:
        return False
    types = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return "application/json" in types and not any("yaml" in t for t in types)


def policy_json(store: PolicyStore) -> dict[str, object]:
    """`GET /admin/policy` as JSON: the running global policy's fields, as upstream
    answers, with its `chain` and `version` beside them."""
    policy = store.current
    return {**as_json(policy.source), "chain": policy.chain_names(), "version": store.version()}


MAX_DOCUMENT_BYTES = 1024 * 1024


async def put_document(
    store: DocumentStore[Any],
    scope: Scope,
    receive: Receive,
    send: Send,
    extra: list[tuple[str, str]],
    accepted: Callable[[], dict],
    flat: bool = False,
) -> int:
    """Validate the body and make it `store`'s running document: 200 with `accepted()`,
    or 400 with every reason (the running document stays; `flat` as `send_rejected`); 412
    for a stale `If-Match` (router/http/preconditions.py)."""
    try:
        text = (await read_body(scope, receive, MAX_DOCUMENT_BYTES)).decode("utf-8")
    except (BodyTooLarge, UnicodeDecodeError):
        errors = store.reject([f"{store.kind} body must be UTF-8 YAML under 1 MiB"], "admin_api")
    except ClientGone:
        return 499
    else:
        try:
            errors = await store.change(lambda: store.parsed(text), "admin_api", if_match(scope))
        except PreconditionFailed as exc:
            return await send_precondition_failed(send, extra, exc.current)
        except Contended:
            return await send_contended(send, extra)
    if errors:
        return await send_rejected(send, extra, store.noun, errors, flat)
    await send_json(send, 200, {"status": "ok", **accepted()}, [*extra, etag(store.version())])
    return 200


async def send_rejected(
    send: Send, extra: list[tuple[str, str]], noun: str, errors: list[str], flat: bool = False
) -> int:
    """400 with every reason. `flat` is upstream's `{"error": "<message>"}` (what its
    scripts read from `PUT /admin/policy`), with `errors` beside it; otherwise this
    router's error object, `errors` inside it."""
    message = f"{noun} rejected: " + "; ".join(errors)
    if flat:
        await send_json(send, 400, {"error": message, "errors": errors}, extra)
        return 400
    payload = error_payload("openai", RouterError(ErrorCode.REQUEST_INVALID, message))
    payload["error"]["errors"] = errors
    await send_json(send, 400, payload, extra)
    return 400
