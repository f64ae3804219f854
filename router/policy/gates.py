"""The seven gates of one policy step, evaluated as a single pass over the model's pool.

Each agent is walked through the gates in the seeds' order and stops at the first one
it fails; the survivors are ranked by the step's strategy. Only when nothing survives
does a second pass explain which gate drained the pool and why, so a routing decision
that finds an agent builds no strings.

The pass is compiled once per policy step into straight-line Python with the step's
values bound as constants (as `dataclasses` does for `__init__`). A generic loop over
match fields and rules measured about 0.65 µs per agent, 65 µs per decision at 100
agents and 8.6 ms at 10,000; the compiled pass was about 0.34 µs per agent. It is now
0.18 µs (bench.decision, three runs against 0743f26 on one machine): the static gates
(3 and 4, the agent's frozen metadata) run once per pool, which PeerTable replaces on
every join and leave; least-loaded is folded into the pass over the rest (no survivors
list, no second walk); gate 2 reads the four flags rather than the property; and gate
7 reads a snapshot's age only for a value that violates a rule. Least-loaded then walks
an agent through the dynamic gates only when it is lighter than its choice so far, so
most agents of a large pool cost a load comparison: 0.08 to 0.16 µs per agent where
the full walk cost 0.30 to 0.71 on the same (slower) host.

Each gate is written down once, in `GATES`: its number and name, its reference check
(plain Python, which the tests hold the compiled pass to), its fragment of the compiled
pass and its drain detail. `GATE_NAMES`, the compiled passes and `_drained` are all
built from that table, so the seeds' order lives in one place. A drain is explained by
a second compiled pass that notes which gate removed each agent, then the draining
gate's reference check on its agents alone: as fast as the hand-written explanation it
replaced (`bench.decision`'s drain columns).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from operator import itemgetter

from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from router.peers import HISTORY_FIELDS, AgentMetadata, Peer
from router.policy.rank import Ranking, RankRequest
from router.policy.schema import GATE_FIELDS, MATCH_FIELDS, Rule, Step
from router.policy.signals import STALE_AFTER_PERIODS, history_value, metric_value

# Gate 2's detail counts each removed agent under its first reason, in this order.
_HEALTH_REASONS = ("disconnected", "unhealthy", "backend_unhealthy", "draining")


@dataclass(slots=True)
class Evaluation:
    best: Peer | None  # the strategy's choice; None when the step's pool is drained
    # How many agents passed every gate; None when the pass did not count them
    # (least-loaded checks only the agents lighter than its choice so far).
    survivors: int | None
    drain: str | None  # e.g. 'gate[4] match [engine(got="",want="vllm")=2]'
    # Drained, but an agent stopped only by its full capacity would otherwise be
    # eligible: waiting in the capacity queue for a free slot can help.
    waitable: bool
    gate: int | None = None  # the gate that drained the pool (1-7); None when not drained


def is_probe(peer: Peer, step: Step, now: float) -> bool:
    """Whether `peer` passes `step` only as its breaker's probe: half-open, and one of
    the step's history rules would exclude it."""
    stats = peer.stats
    if not stats.half_open(now):
        return False
    for rule in step.exclude_if:
        if rule.field in HISTORY_FIELDS:
            value = history_value(stats, rule.field)
            if value is not None and rule.violated(value):
                return True
    return False


def evaluate(
    pool: Sequence[Peer],
    step: Step,
    capability: str,
    failed: AbstractSet[str],
    now: float,
    ranking: Ranking | None = None,
    request: RankRequest | None = None,
) -> Evaluation:
    """Run gates 1-7 of `step` over `pool` (the model's agents, in peer-ID order).

    `ranking` is the router's (a fresh one when absent: what round-robin and
    prefix-aware remember then lasts one call); `request` the request being routed.
    """
    if not pool:
        return Evaluation(None, 0, _drain(MODEL_FILTER, {}), False, MODEL_FILTER.number)
    compiled = _compiled(step)
    eligible = compiled.eligible(pool, capability)
    if step.strategy == LEAST_LOADED:
        best = compiled.lightest(eligible, failed, now)
        if best is not None:
            return Evaluation(best, None, None, False)
    else:
        survivors = compiled.dynamic(eligible, failed, now)
        if survivors:
            if ranking is None:
                ranking = Ranking()
            if request is None:
                request = RankRequest(pool[0].metadata.model, {})
            best = ranking.pick(step.strategy, step.strategy_params, survivors, request, now)
            return Evaluation(best, len(survivors), None, False)
    return _drained(pool, step, capability, failed, now)


# --- the gate table ------------------------------------------------------------------


@dataclass(slots=True)
class Context:
    """What a reference check reads besides the agent: one request's step and state."""

    step: Step
    capability: str
    failed: AbstractSet[str]
    now: float
    wants: tuple[tuple[str, str], ...]  # the step's non-empty match fields, in order


def context(step: Step, capability: str, failed: AbstractSet[str], now: float) -> Context:
    return Context(step, capability, failed, now, _compiled(step).wants)


# A fragment's helpers: `const` binds a policy value as a constant and returns its
# name; `reject(condition, indent)` is the lines that remove an agent for which the
# condition holds (skip it in the survivors pass, note it in the removals pass).
Const = Callable[[object], str]
Reject = Callable[[str, str], list[str]]
_IN_LOOP = " " * 8


@dataclass(frozen=True, slots=True)
class Gate:
    """One of the seven gates.

    `check` is the reference: the detail keys under which `peer` is removed (several
    for gate 4, which lists every mismatching field), or none when it passes. `source`
    is the gate's part of the compiled passes: lines in the pool loop that `reject` a
    failing agent; a fragment may use the locals an earlier gate bound (`md`, `active`,
    `capacity`). `detail` turns the removal counts into the drain's bracket. A `static`
    gate reads only the agent's metadata (frozen) and the request's capability, so its
    verdict holds for as long as the pool is the same object.
    """

    number: int
    name: str
    check: Callable[[Peer, Context], list[str]]
    source: Callable[[Step, Const, Reject], list[str]]
    detail: Callable[[dict[str, int]], str]
    static: bool = False


def _counts(groups: dict[str, int]) -> str:
    return ",".join(f"{key}={count}" for key, count in groups.items() if count)


# Gate 1: the pool is the model's agents (PeerTable.for_model), so every agent in it
# passes; an empty pool is the drain, and `evaluate` reports it before any pass.
def _model_check(peer: Peer, ctx: Context) -> list[str]:
    return []


def _model_source(step: Step, const: Const, reject: Reject) -> list[str]:
    return []


def _health_check(peer: Peer, ctx: Context) -> list[str]:
    reason = _health_reason(peer)
    return [reason] if reason else []


def _health_source(step: Step, const: Const, reject: Reject) -> list[str]:
    # Peer.routable spelled out: Python 3.11 does not specialise a property's load, and
    # the call cost 40 ns per agent, a sixth of the pass (bench.decision).
    return reject(
        "not (peer.healthy and peer.backend_healthy and peer.connected) or peer.draining",
        _IN_LOOP,
    )


def _health_detail(counts: dict[str, int]) -> str:
    return _counts({reason: counts.get(reason, 0) for reason in _HEALTH_REASONS})


def _capability_check(peer: Peer, ctx: Context) -> list[str]:
    got = peer.metadata.capability
    if got == ctx.capability:
        return []
    return [f"capability(got={_quote(got)},want={_quote(ctx.capability)})"]


def _capability_source(step: Step, const: Const, reject: Reject) -> list[str]:
    return [f"{_IN_LOOP}md = peer.metadata", *reject("md.capability != capability", _IN_LOOP)]


def _match_check(peer: Peer, ctx: Context) -> list[str]:
    return _mismatches(peer.metadata, ctx.wants, ctx.step.match.tags)


def _match_source(step: Step, const: Const, reject: Reject) -> list[str]:
    lines: list[str] = []
    for name in MATCH_FIELDS:
        want = getattr(step.match, name)
        if want:
            lines += reject(f"md.{name} != {const(want)}", _IN_LOOP)
    for tag in step.match.tags:
        lines += reject(f"{const(tag)} not in md.tags", _IN_LOOP)
    return lines


def _prev_failures_check(peer: Peer, ctx: Context) -> list[str]:
    return ["prev_failed"] if peer.peer_id in ctx.failed else []


def _prev_failures_source(step: Step, const: Const, reject: Reject) -> list[str]:
    # Nearly every request has no failed agent yet: the empty set is not searched.
    return reject("failed and peer.peer_id in failed", _IN_LOOP)


def _capacity_check(peer: Peer, ctx: Context) -> list[str]:
    return ["at_capacity"] if peer.active >= peer.metadata.capacity else []


def _capacity_source(step: Step, const: Const, reject: Reject) -> list[str]:
    return [
        f"{_IN_LOOP}active = peer.active",
        f"{_IN_LOOP}capacity = peer.metadata.capacity",
        *reject("active >= capacity", _IN_LOOP),
    ]


def _exclude_if_check(peer: Peer, ctx: Context) -> list[str]:
    rule = first_violation(peer, ctx.step.exclude_if, ctx.now)
    return [rule.field] if rule is not None else []


def _exclude_if_source(step: Step, const: Const, reject: Reject) -> list[str]:
    return _compile_rules(step.exclude_if, const, reject)


# Upstream's detail: the model has no agent (the session says `no_agents` instead when
# the request's own filters, not the registry, emptied the pool).
MODEL_FILTER = Gate(
    1, "model_filter", _model_check, _model_source, lambda _: "model_not_registered"
)
CAPACITY = Gate(6, "capacity", _capacity_check, _capacity_source, _counts)
GATES: tuple[Gate, ...] = (
    MODEL_FILTER,
    Gate(2, "health", _health_check, _health_source, _health_detail),
    Gate(3, "capability", _capability_check, _capability_source, _counts, static=True),
    Gate(4, "match", _match_check, _match_source, _counts, static=True),
    Gate(5, "prev_failures", _prev_failures_check, _prev_failures_source, _counts),
    CAPACITY,
    Gate(7, "exclude_if", _exclude_if_check, _exclude_if_source, _counts),
)
GATE_NAMES: tuple[str, ...] = tuple(gate.name for gate in GATES)


# --- the compiled pass ---------------------------------------------------------------

_Pass = Callable[[Sequence[Peer], str, AbstractSet[str], float], list]
_Static = Callable[[Sequence[Peer], str], list]
_Dynamic = Callable[[Sequence[Peer], AbstractSet[str], float], list]
_Lightest = Callable[[Sequence[Peer], AbstractSet[str], float], Peer | None]
_SYMBOL = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
LEAST_LOADED = "least-loaded"


@dataclass(frozen=True, slots=True)
class _Compiled:
    step: Step  # kept alive, so its id() is not reused while the entry exists
    survivors: _Pass  # pool in, the agents that pass every gate out
    removals: _Pass  # pool in, (gate number, agent) for each removed agent out
    static: _Static  # pool in, the agents that pass the static gates (3 and 4) out
    dynamic: _Dynamic  # those in, the agents that pass the other gates out
    # Those in, the dynamic survivors' least-loaded agent out: the ranking folded into
    # the pass, with no survivors list and no second walk (`_KINDS`).
    lightest: _Lightest
    # What the drain explanation reads of the step, worked out once.
    wants: tuple[tuple[str, str], ...]
    # Its load is what waiting changes, so a full agent's capacity_utilization is moot.
    rules_when_free: tuple[Rule, ...]
    # (model, capability) -> (the model's latest pool, its agents that pass the static
    # gates); one entry per model, so a replaced pool is let go at the next decision.
    pools: dict[tuple[str, str], tuple[Sequence[Peer], Sequence[Peer]]] = field(
        default_factory=dict
    )

    def eligible(self, pool: Sequence[Peer], capability: str) -> Sequence[Peer]:
        """The agents of `pool` that pass gates 3 and 4, worked out once per pool.

        PeerTable's pools are tuples replaced whenever an agent joins or leaves and
        metadata is frozen, so the same tuple has the same answer. Any other sequence
        may have changed in place and is filtered every time. `pool` is not empty.
        """
        if type(pool) is not tuple:
            return self.static(pool, capability)
        key = (pool[0].metadata.model, capability)
        entry = self.pools.get(key)
        if entry is not None and entry[0] is pool:
            return entry[1]
        passed = self.static(pool, capability)
        kept: Sequence[Peer] = pool if len(passed) == len(pool) else tuple(passed)
        if len(self.pools) >= _POOLS_PER_STEP:
            self.pools.clear()
        self.pools[key] = (pool, kept)
        return kept


# Policies change only on reload, so a few compiled steps serve every live request.
# Keyed by id() with the step kept alive in the value, which stops the id being reused;
# hashing the nested frozen dataclasses on every request would cost more than the gates.
_compiled_steps: dict[int, _Compiled] = {}
_CACHE_SIZE = 64
# A step's pools, one per model and capability it serves: far above what one fleet
# serves, so the clear is only a bound.
_POOLS_PER_STEP = 1024


def _compiled(step: Step) -> _Compiled:
    entry = _compiled_steps.get(id(step))
    if entry is not None and entry.step is step:
        return entry
    wants = tuple((name, getattr(step.match, name)) for name in MATCH_FIELDS)
    static = [gate for gate in GATES if gate.static]
    dynamic = [gate for gate in GATES if not gate.static]
    entry = _Compiled(
        step,
        _compile(step, GATES, "survivors"),
        _compile(step, GATES, "removals"),
        _compile(step, static, "static"),
        _compile(step, dynamic, "dynamic"),
        _compile(step, dynamic, "lightest"),
        tuple((name, want) for name, want in wants if want),
        tuple(r for r in step.exclude_if if r.field != "capacity_utilization"),
    )
    if len(_compiled_steps) >= _CACHE_SIZE:
        _compiled_steps.clear()
    _compiled_steps[id(step)] = entry
    return entry


# What each kind of pass takes, starts with, checks of an agent before its gates, does
# with a survivor, and returns.
_KINDS: dict[str, tuple[str, list[str], list[str], list[str], str]] = {
    "survivors": (
        "pool, capability, failed, now",
        ["out = []"],
        [],
        ["out.append(peer)"],
        "out",
    ),
    "removals": ("pool, capability, failed, now", ["out = []"], [], [], "out"),
    "static": ("pool, capability", ["out = []"], [], ["out.append(peer)"], "out"),
    "dynamic": ("pool, failed, now", ["out = []"], [], ["out.append(peer)"], "out"),
    # strategy.least_loaded inline: the first lowest active/capacity in peer-ID order,
    # integers cross-multiplied. An agent no lighter than the best so far cannot be the
    # choice whatever its gates say, so they are checked only for one that is lighter:
    # most agents of a large pool cost two loads and a comparison (bench.decision).
    # The first agent is lighter than the start's 1/0, unless its capacity is 0, which
    # gate 6 would remove anyway.
    "lightest": (
        "pool, failed, now",
        ["best = None", "best_active = 1", "best_capacity = 0"],
        [
            "active = peer.active",
            "capacity = peer.metadata.capacity",
            "if active * best_capacity >= best_active * capacity:",
            "    continue",
        ],
        ["best, best_active, best_capacity = peer, active, capacity"],
        "best",
    ),
}


def _compile(step: Step, gates: Sequence[Gate], kind: str) -> Callable:
    """`gates` of `step` as one generated function, from the table's fragments.

    The survivors pass returns the agents that pass; the removals pass, run only when
    none does, returns `(gate number, agent)` for each agent at the gate that removed
    it, which is all the drain explanation needs to find the draining gate. A decision
    runs the static gates once per pool (`_Compiled.eligible`), then `lightest` for
    least-loaded or `dynamic` for the other strategies.

    Only names from this module's own tables reach the source text; every value that
    comes from the policy (match values, tags, thresholds) is bound as a constant in
    the function's namespace, so a policy cannot inject code.
    """
    constants: dict[str, object] = {"STALE": STALE_AFTER_PERIODS}

    def const(value: object) -> str:
        name = f"C{len(constants)}"
        constants[name] = value
        return name

    body: list[str] = []
    for gate in gates:

        def reject(condition: str, indent: str, number: int = gate.number) -> list[str]:
            lines = [f"{indent}if {condition}:"]
            if kind == "removals":
                lines.append(f"{indent}    out.append(({number}, peer))")
            return [*lines, f"{indent}    continue"]

        body += gate.source(step, const, reject)
    args, start, before, passed, result = _KINDS[kind]
    source = "\n".join(
        [
            f"def {kind}({args}):",
            *(f"    {line}" for line in start),
            "    for peer in pool:",
            *(f"{_IN_LOOP}{line}" for line in before),
            *body,
            *(f"{_IN_LOOP}{line}" for line in passed),
            f"    return {result}",
        ]
    )
    namespace = dict(constants)
    exec(compile(source, f"<gates of policy step {step.name!r}>", "exec"), namespace)
    return namespace[kind]  # type: ignore[no-any-return]


def _compile_rules(rules: tuple[Rule, ...], const: Const, reject: Reject) -> list[str]:
    """Gate 7, grouped by where each value comes from; any violation excludes.

    Grouping changes the order rules are checked in, which only the drain detail's
    "first violated rule" depends on, and that is computed by the generic checks.
    """
    for rule in rules:
        # Steps normally come from the schema, but one built by hand must not reach
        # the generated source with a field or operator of its own.
        if rule.field not in GATE_FIELDS or rule.op not in _SYMBOL:
            raise ValueError(f"invalid rule {rule!r}")

    def compare(value: str, rule: Rule, indent: str, unless: str = "") -> list[str]:
        return reject(f"{value} {_SYMBOL[rule.op]} {const(rule.threshold)}{unless}", indent)

    def of(*fields: str) -> list[Rule]:
        return [rule for rule in rules if rule.field in fields]

    lines: list[str] = []
    for rule in of("capacity_utilization"):
        lines += compare("active / capacity", rule, "        ")
    for snapshot, fields in (("engine", ENGINE_FIELDS), ("hardware", HARDWARE_FIELDS)):
        group = of(*fields)
        if group:
            # The value first, its snapshot's age only for a violation: most agents
            # are within the rules, and skipping the age saved 25 ns per agent and rule
            # group (bench.decision). A stale snapshot's value is unknown, which passes.
            fresh = f" and now - peer.{snapshot}_at <= STALE * peer.{snapshot}_interval"
            lines.append(f"        values = peer.{snapshot}")
            for rule in group:
                lines.append(f"        value = values.get({rule.field!r})")
                lines += compare("value is not None and value", rule, "        ", fresh)
    for rule in of("srtt"):
        lines.append("        srtt = peer.stats.srtt_ms")
        lines += compare("srtt is not None and srtt", rule, "        ")
    history = of("success_rate", "consecutive_failures")
    if history:
        lines += [
            "        stats = peer.stats",
            "        total = stats.successes + stats.failures",
            # No history yet: both values are missing, and a missing metric passes.
            "        if total:",
        ]
        for rule in history:
            value = (
                "stats.successes / total"
                if rule.field == "success_rate"
                else "stats.consecutive_failures"
            )
            # A half-open or closed breaker lets the agent past its history (peers.py);
            # read only for a violation, so an agent within the rule pays nothing.
            lines += compare(value, rule, "            ", " and now < stats.probe_at")
    return lines


# --- the drain explanation -----------------------------------------------------------


def _drained(
    pool: Sequence[Peer],
    step: Step,
    capability: str,
    failed: AbstractSet[str],
    now: float,
) -> Evaluation:
    """Explain an empty result: which gate removed the last agents, and why.

    Every agent stops at its first failing gate, so the gate that drained the pool is
    the last one that removed anyone, and its removals are the detail. The compiled
    removals pass says which gate removed each agent; the reference checks then say
    why, for the draining gate's agents only.
    """
    compiled = _compiled(step)
    removed: list[tuple[int, Peer]] = compiled.removals(pool, capability, failed, now)
    number = max(removed, key=_NUMBER)[0]
    gate = GATES[number - 1]
    check = gate.check
    ctx = Context(step, capability, failed, now, compiled.wants)
    counts: dict[str, int] = {}  # in the order first seen, as the detail lists them
    for peer in [peer for n, peer in removed if n == number]:
        why = check(peer, ctx)
        if not why:
            raise RuntimeError(f"gates disagree on {peer.peer_id} in step {step.name}")
        for key in why:
            counts[key] = counts.get(key, 0) + 1
    rules = compiled.rules_when_free
    full = [peer for n, peer in removed if n == CAPACITY.number]
    waitable = bool(full) and any(first_violation(peer, rules, now) is None for peer in full)
    return Evaluation(None, 0, _drain(gate, counts), waitable, number)


_NUMBER = itemgetter(0)


def first_violation(peer: Peer, rules: Sequence[Rule], now: float) -> Rule | None:
    """The first rule, in policy order, that `peer` violates; missing metrics pass."""
    for rule in rules:
        value = metric_value(peer, rule.field, now)
        if value is not None and rule.violated(value):
            return rule
    return None


def _mismatches(
    md: AgentMetadata, wants: tuple[tuple[str, str], ...], tags: tuple[str, ...]
) -> list[str]:
    """Gate 4's detail groups for one agent; empty when it matches.

    Every mismatching field is listed, so one log line shows all that would have to
    change; an agent may therefore count in several groups.
    """
    groups: list[str] = []
    for name, want in wants:
        got = getattr(md, name)
        if got != want:
            groups.append(f"{name}(got={_quote(got)},want={_quote(want)})")
    for tag in tags:
        if tag not in md.tags:
            groups.append(f"tags(missing={_quote(tag)})")
    return groups


def _health_reason(peer: Peer) -> str:
    """Why gate 2 removes `peer` ('' when it passes), the most fundamental cause first."""
    if peer.routable:
        return ""
    if not peer.connected:
        return "disconnected"
    if not peer.healthy:
        return "unhealthy"
    if not peer.backend_healthy:
        return "backend_unhealthy"
    if peer.draining:
        return "draining"
    return "unhealthy"  # whatever else Peer.routable may come to check


def _quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _drain(gate: Gate, counts: dict[str, int]) -> str:
    """The seeds' `gate[<number>] <gate-name> [<detail>]`."""
    return f"gate[{gate.number}] {gate.name} [{gate.detail(counts)}]"
