"""What the router would do with a request now, without sending anything anywhere.

`POST /admin/explain`, `hivenet-router explain` and the console's Explain view answer
from here. Nothing is re-implemented: the choice is the routing core's own
(`gates.evaluate` with the router's `Ranking`, whose `pick` remembers nothing; only
`chosen`, which this never calls, does), each agent's verdict is each gate's reference
check from `gates.GATES`, a step's drain is `Evaluation.drain`, and the provider
fallback is `Dispatcher.provider_for`. So the answer is the first try's decision of a
request sent now; a forward that then fails is the one thing it cannot foresee.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.logs import quote
from router.capacity import WaitQueue
from router.peers import Peer, PeerTable
from router.policy.admission import shed
from router.policy.gates import GATES, LEAST_LOADED, Context, context, evaluate, first_violation
from router.policy.rank import Ranking, RankRequest
from router.policy.rank_metrics import LowestMetric
from router.policy.rank_prefix import PrefixAware
from router.policy.rank_round_robin import RoundRobin
from router.policy.schema import Policy, ProviderFallback, Step
from router.policy.signals import metric_value

# A request to explain is a model, a few headers and at most a prompt: 256 KiB holds
# a long chat; anything larger is refused before it is parsed.
MAX_EXPLAIN_BYTES = 256 * 1024
MAX_HEADERS = 64
_SYMBOL = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}


class ExplainInvalid(ValueError):
    """What is wrong with an explain body, in words for the caller."""


@dataclass
class ExplainRequest:
    model: str
    tenant: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    messages: list[Any] | None = None
    path: str = "/v1/chat/completions"

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model}
        if self.messages is not None:
            body["messages"] = self.messages
        return body


def parse_request(body: object, endpoints: dict[str, tuple[str, str]]) -> ExplainRequest:
    """The explain body, checked field by field; raises ExplainInvalid."""
    if not isinstance(body, dict):
        raise ExplainInvalid("body must be a JSON object")
    unknown = sorted(set(body) - {"model", "tenant", "headers", "messages", "path"})
    if unknown:
        raise ExplainInvalid(f"unknown fields: {', '.join(unknown)}")
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > 512:
        raise ExplainInvalid("`model` must be a non-empty string of at most 512 characters")
    tenant = body.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or len(tenant) > 256):
        raise ExplainInvalid("`tenant` must be a string of at most 256 characters")
    headers = body.get("headers") or {}
    if not isinstance(headers, dict) or len(headers) > MAX_HEADERS:
        raise ExplainInvalid(f"`headers` must be an object of at most {MAX_HEADERS} strings")
    for name, value in headers.items():
        if not isinstance(value, str):
            raise ExplainInvalid(f"`headers.{name}` must be a string")
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise ExplainInvalid("`messages` must be a list of chat messages")
    path = body.get("path", "/v1/chat/completions")
    if not isinstance(path, str) or path not in endpoints:
        raise ExplainInvalid(f"`path` must be one of {', '.join(sorted(endpoints))}")
    lowered = {str(k).lower(): v for k, v in headers.items()}
    return ExplainRequest(model, tenant, lowered, messages, path)


@dataclass
class Explainer:
    """The router's own pieces an explanation reads; nothing here changes them."""

    table: PeerTable
    queue: WaitQueue
    ranking: Ranking
    policy_for: Callable[[str], Policy]
    # Policy and capability in, the provider a request would fall back to out (or None).
    provider_for: Callable[[Policy, str, str], ProviderFallback | None]
    clock: Callable[[], float]

    def explain(
        self, req: ExplainRequest, capability: str, tenant: str, priority: int
    ) -> dict[str, Any]:
        now = self.clock()
        policy = self.policy_for(req.model)
        pool = self.table.for_model(req.model)
        rank_request = RankRequest(req.model, req.payload())
        out: dict[str, Any] = {
            "model": req.model,
            "path": req.path,
            "capability": capability,
            "tenant": tenant,
            "priority": priority,
            "chain": policy.chain_names(),
            "agents": len(pool),
            "steps": [],
            "chosen": None,
        }
        if policy.shed_if is not None:
            hit = shed(policy.shed_if, tenant, priority, req.model, pool, self.queue)
            if hit is not None:
                out["shed"] = {"step": "shed_if", "rule": hit.detail()}
                out["outcome"] = "load_shed"
                return out
        # Agents whose engine lately said it lacks this path: a real request starts each
        # step with them failed (gate 5) and asks them nothing (router/session.py).
        lacking = frozenset(p.peer_id for p in pool if p.lacks and p.lacks_path(req.path, now))
        reasons: list[str] = []
        for step in policy.steps:
            if step.shed_if is not None:
                hit = shed(step.shed_if, tenant, priority, req.model, pool, self.queue)
                if hit is not None:
                    reasons.append(f"{step.name}: shed_if [{hit.detail()}]")
                    out["steps"].append({"name": step.name, "shed": hit.detail()})
                    out["shed"] = {"step": step.name, "rule": hit.detail()}
                    out["outcome"] = "load_shed"
                    out["reason"] = " | ".join(reasons)
                    return out
            view = self._step(step, pool, capability, rank_request, now, lacking)
            out["steps"].append(view)
            if view["chosen"] is not None:
                out["chosen"] = view["chosen"]
                out["chosen_step"] = step.name
                out["outcome"] = "routed"
                return out
            reasons.append(f"{step.name}: {view['drain']}")
        reason = " | ".join(reasons)
        provider = self.provider_for(policy, capability, req.path)
        waits = any(s.get("waitable") for s in out["steps"])
        out["outcome"] = "provider_fallback" if provider is not None else "exhausted"
        out["exhaustion"] = {
            # The seeds' policy_exhausted line, as the router would write it.
            "reason": reason,
            "chain": f"[{'→'.join(policy.chain_names())}]",
            "tried": f"{len(reasons)}/{len(policy.steps)}",
            # A step drained only by full agents queues the request first (--queue-depth).
            "would_queue": waits,
            "error": _error_code(pool, waits, bool(lacking)),
        }
        out["provider_fallback"] = (
            {"engine": provider.engine, "model": provider.model} if provider is not None else None
        )
        return out

    def _step(
        self,
        step: Step,
        pool: Sequence[Peer],
        capability: str,
        rank_request: RankRequest,
        now: float,
        failed: frozenset[str] = frozenset(),
    ) -> dict[str, Any]:
        ev = evaluate(pool, step, capability, failed, now, self.ranking, rank_request)
        ctx = context(step, capability, failed, now)
        agents = [agent_verdicts(peer, ctx) for peer in pool]
        survivors = [p for p, a in zip(pool, agents, strict=True) if a["excluded_by"] is None]
        return {
            "name": step.name,
            "strategy": step.strategy,
            "agents": agents,
            "ranking": self._ranking(step, survivors, rank_request, now),
            "chosen": ev.best.peer_id if ev.best is not None else None,
            "drain": ev.drain,
            "drained_gate": ev.gate,
            "waitable": ev.waitable,
        }

    def _ranking(
        self, step: Step, survivors: Sequence[Peer], request: RankRequest, now: float
    ) -> list[dict[str, Any]]:
        """The survivors in the strategy's order with the value it ranks by. The order
        is what the strategy's signal says; the choice itself is `evaluate`'s."""
        unit = self.ranking.unit(step.strategy)
        rows = []
        for peer in survivors:
            load = peer.active / peer.metadata.capacity if peer.metadata.capacity else math.inf
            row: dict[str, Any] = {"peer_id": peer.peer_id, "load": round(load, 4)}
            if isinstance(unit, LowestMetric):
                row["signal"] = unit.field
                row["score"] = metric_value(peer, unit.field, now)
            elif isinstance(unit, PrefixAware):
                tree = unit.tree(request.model, step.strategy_params.block_chars)
                depth = (
                    tree.match(request.blocks(step.strategy_params.block_chars)[0]) if tree else {}
                )
                row["signal"] = "prefix_blocks_matched"
                row["score"] = depth.get(peer.peer_id, 0)
            elif step.strategy == LEAST_LOADED:
                row["signal"] = "active/capacity"
                row["score"] = row["load"]
            rows.append(row)
        if isinstance(unit, RoundRobin):
            last = unit._last.get(request.model, "")
            after = [r for r in rows if r["peer_id"] > last]
            rows = after + [r for r in rows if r["peer_id"] <= last]
            for turn, row in enumerate(rows):
                row["signal"], row["score"] = "turn", turn
        elif isinstance(unit, PrefixAware):
            rows.sort(key=lambda r: (-r["score"], r["load"], r["peer_id"]))
        else:
            unknown = -math.inf if step.strategy == "lowest-srtt" else math.inf
            rows.sort(
                key=lambda r: (
                    unknown if r.get("score") is None else r["score"],
                    r["load"],
                    r["peer_id"],
                )
            )
        return rows


def agent_verdicts(peer: Peer, ctx: Context) -> dict[str, Any]:
    """`peer` at each of the seven gates, in the seeds' words, and the first it fails."""
    gates = []
    excluded_by = None
    for gate in GATES:
        why = gate.check(peer, ctx)
        if why and gate.number == 7:
            why = [_rule_words(peer, ctx)]
        verdict = f"gate[{gate.number}] {gate.name} [{','.join(why)}]" if why else None
        gates.append({"gate": gate.number, "name": gate.name, "pass": not why, "why": verdict})
        if verdict is not None and excluded_by is None:
            excluded_by = verdict
    md = peer.metadata
    return {
        "peer_id": peer.peer_id,
        "machine": md.machine,
        "engine": md.engine,
        "active": peer.active,
        "capacity": md.capacity,
        "gates": gates,
        "excluded_by": excluded_by,
    }


def _rule_words(peer: Peer, ctx: Context) -> str:
    """Gate 7's rule with the agent's value: `waiting_requests=12 > 8`."""
    rule = first_violation(peer, ctx.step.exclude_if, ctx.now)
    if rule is None:  # the check and first_violation are one function: cannot happen
        return "exclude_if"
    value = metric_value(peer, rule.field, ctx.now)
    return f"{rule.field}={_number(value)} {_SYMBOL[rule.op]} {_number(rule.threshold)}"


def _number(value: object) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.4g}"
    return quote(str(value))


def _error_code(pool: Sequence[Peer], waits: bool, lacking: bool = False) -> str:
    if not pool:
        return "model_not_found"
    if lacking:
        # The session's exhaustion names the missing route first (RoutingSession._exhausted).
        return "endpoint_not_supported"
    return "no_capacity" if waits else "no_agents_available"


def exclusions(
    table: PeerTable, policy_for: Callable[[str], Policy], now: float
) -> dict[str, list[dict[str, Any]]]:
    """Each agent's first failing gate at each step of its model's policy, now, as
    an `llm`-less request of the agent's own capability would meet them."""
    out: dict[str, list[dict[str, Any]]] = {}
    for model in table.models():
        policy = policy_for(model)
        for peer in table.for_model(model):
            rows = []
            for step in policy.steps:
                ctx = context(step, peer.metadata.capability, frozenset(), now)
                rows.append(
                    {"step": step.name, "excluded_by": agent_verdicts(peer, ctx)["excluded_by"]}
                )
            out[peer.peer_id] = rows
    return out
