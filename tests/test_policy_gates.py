"""The seven gates, least-loaded ranking and the drain details, against the seeds."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from router.peers import AgentMetadata, Peer, PeerTable, UniversalStats
from router.policy import gates
from router.policy.gates import GATE_NAMES, evaluate, first_violation, metric_value
from router.policy.rank import STRATEGIES, least_loaded
from router.policy.schema import GATE_FIELDS, Match, Rule, Step, load_policy

NOW = 1_000.0
NO_FAILURES: frozenset[str] = frozenset()


async def _send(message: dict) -> None:
    del message


def peer(
    peer_id: str,
    *,
    model: str = "m",
    capability: str = "llm",
    engine: str = "vllm",
    capacity: int = 10,
    active: int = 0,
    region: str = "",
    organization: str = "",
    machine: str = "",
    gpu_model: str = "",
    tags: tuple[str, ...] = (),
    healthy: bool = True,
    backend_healthy: bool = True,
    connected: bool = True,
    draining: bool = False,
    engine_metrics: dict[str, float | None] | None = None,
    hardware_metrics: dict[str, float | None] | None = None,
    engine_at: float = NOW,
    hardware_at: float = NOW,
    stats: UniversalStats | None = None,
) -> Peer:
    return Peer(
        peer_id=peer_id,
        metadata=AgentMetadata(
            model=model,
            capability=capability,
            engine=engine,
            capacity=capacity,
            region=region,
            organization=organization,
            machine=machine,
            gpu_model=gpu_model,
            tags=tags,
        ),
        send=_send,
        connected_at=0.0,
        last_seen=NOW,
        healthy=healthy,
        backend_healthy=backend_healthy,
        connected=connected,
        draining=draining,
        active=active,
        engine=dict(engine_metrics or {}),
        hardware=dict(hardware_metrics or {}),
        engine_at=engine_at,
        hardware_at=hardware_at,
        stats=stats or UniversalStats(),
    )


def step(*rules: Rule, **match: Any) -> Step:
    return Step("routing_policy", Match(**match), tuple(rules), "least-loaded", 0)


ANY = step()


def counting(s: Step) -> Step:
    """`s` with a strategy that ranks every survivor, so its pass counts them
    (least-loaded does not)."""
    return dataclasses.replace(s, strategy="round-robin")


def run(pool: list[Peer], s: Step = ANY, failed: frozenset[str] = NO_FAILURES, cap: str = "llm"):
    return evaluate(pool, s, cap, failed, NOW)


def best_id(pool: list[Peer], s: Step = ANY, failed: frozenset[str] = NO_FAILURES) -> str | None:
    result = run(pool, s, failed)
    return result.best.peer_id if result.best else None


# --- ranking ---------------------------------------------------------------------------


def test_least_loaded_worked_example_from_the_seeds() -> None:
    pool = [peer("A", active=4, capacity=20), peer("B", active=8, capacity=20)]
    pool.append(peer("C", active=5, capacity=10))
    assert least_loaded(pool) is pool[0]
    assert best_id(pool) == "A"
    # Order does not matter for distinct ratios.
    assert least_loaded([pool[2], pool[1], pool[0]]) is pool[0]


def test_ties_go_to_the_first_agent_in_peer_id_order() -> None:
    pool = [peer("a1", active=1, capacity=3), peer("a2", active=2, capacity=6)]
    assert least_loaded(pool) is pool[0]
    assert best_id(pool) == "a1"
    pool = [peer("a1", active=3, capacity=10), peer("a2", active=0, capacity=4)]
    pool.append(peer("a3", active=0, capacity=40))
    assert best_id(pool) == "a2"


def test_ratios_are_compared_exactly() -> None:
    # These ratios differ from 1/3 by less than a float can tell, so a float
    # comparison would see ties and keep the first agent in both cases.
    third = peer("b", active=1, capacity=3)
    below = peer("a", active=10**17, capacity=3 * 10**17 + 1)
    above = peer("a", active=10**17 + 1, capacity=3 * 10**17)
    assert below.load_ratio == third.load_ratio == above.load_ratio
    assert least_loaded([third, below]) is below
    assert least_loaded([above, third]) is third


def test_least_loaded_of_nothing_is_none() -> None:
    assert least_loaded([]) is None


def test_strategy_tables() -> None:
    # Upstream's policy reference lists every one; least-loaded stays the default.
    assert list(STRATEGIES) == [
        "least-loaded",
        "lowest-srtt",
        "round-robin",
        "prefix-aware",
        "lowest-kv-cache",
        "lowest-queue",
        "best-ttft",
        "best-itl",
    ]


# --- gates 1 to 3 ----------------------------------------------------------------------


def test_gate1_empty_pool() -> None:
    result = run([])
    assert (result.best, result.survivors) == (None, 0)
    assert result.drain == "gate[1] model_filter [model_not_registered]"
    assert result.waitable is False


@pytest.mark.parametrize(
    ("pool", "drain"),
    [
        ([peer("a", healthy=False), peer("b", healthy=False)], "gate[2] health [unhealthy=2]"),
        (
            [peer("a", backend_healthy=False), peer("b", healthy=False)],
            "gate[2] health [unhealthy=1,backend_unhealthy=1]",
        ),
        (
            [peer("a", connected=False, healthy=False), peer("b", draining=True)],
            "gate[2] health [disconnected=1,draining=1]",
        ),
    ],
)
def test_gate2_health(pool: list[Peer], drain: str) -> None:
    result = run(pool)
    assert (result.best, result.survivors, result.drain) == (None, 0, drain)


def test_gate2_keeps_healthy_agents() -> None:
    pool = [peer("a", backend_healthy=False), peer("b", active=9), peer("c", draining=True)]
    assert best_id(pool) == "b"
    assert run(pool, counting(ANY)).survivors == 1


def test_gate3_capability() -> None:
    pool = [peer("a", capability="embedding"), peer("b", capability="embedding")]
    assert run(pool).drain == 'gate[3] capability [capability(got="embedding",want="llm")=2]'
    pool.append(peer("c", capability="reranker"))
    assert run(pool).drain == (
        'gate[3] capability [capability(got="embedding",want="llm")=2,'
        'capability(got="reranker",want="llm")=1]'
    )
    assert run(pool, cap="reranker").best is pool[2]


# --- gate 4: static match --------------------------------------------------------------


def test_gate4_drain_example_from_the_seeds() -> None:
    pool = [peer("a", engine=""), peer("b", engine="")]
    result = run(pool, step(engine="vllm"))
    assert result.drain == 'gate[4] match [engine(got="",want="vllm")=2]'
    assert result.waitable is False


def test_gate4_region_is_exact() -> None:
    s = step(region="EU")
    assert best_id([peer("a", region="EU-France")], s) is None
    assert run([peer("a", region="EU-France")], s).drain == (
        'gate[4] match [region(got="EU-France",want="EU")=1]'
    )
    assert best_id([peer("a", region="EU")], s) == "a"
    assert best_id([peer("a", region="eu")], s) is None  # case-sensitive


@pytest.mark.parametrize("field", ["region", "engine", "organization", "machine", "gpu_model"])
def test_gate4_each_field(field: str) -> None:
    s = step(**{field: "X"})
    pool = [peer("a", **{field: "Y"}), peer("b", **{field: "X"}), peer("c", **{field: "x"})]
    assert best_id(pool, s) == "b"
    assert run(pool, counting(s)).survivors == 1
    result = run([pool[0], pool[2]], s)
    assert result.drain == (
        f'gate[4] match [{field}(got="Y",want="X")=1,{field}(got="x",want="X")=1]'
    )


def test_gate4_tags_must_all_be_present() -> None:
    s = step(tags=("production", "high-memory"))
    assert best_id([peer("a", tags=("production", "high-memory", "a100"))], s) == "a"
    only_production = [peer("a", tags=("production",))]
    assert best_id(only_production, s) is None
    assert run(only_production, s).drain == 'gate[4] match [tags(missing="high-memory")=1]'
    nothing = [peer("a"), peer("b", tags=("production",))]
    assert run(nothing, s).drain == (
        'gate[4] match [tags(missing="production")=1,tags(missing="high-memory")=2]'
    )


def test_gate4_lists_every_mismatching_field() -> None:
    s = step(region="EU-France", engine="vllm", tags=("production",))
    pool = [peer("a", region="US", engine="sglang"), peer("b", region="US", tags=("production",))]
    assert run(pool, s).drain == (
        'gate[4] match [region(got="US",want="EU-France")=2,'
        'engine(got="sglang",want="vllm")=1,tags(missing="production")=1]'
    )


def test_gate4_all_fields_and_quoting() -> None:
    s = step(
        region="EU-France",
        engine="vllm",
        organization="ml-team",
        machine="gpu-worker-1",
        gpu_model="RTX4090",
        tags=("production", "high-memory"),
    )
    good = peer(
        "a",
        region="EU-France",
        organization="ml-team",
        machine="gpu-worker-1",
        gpu_model="RTX4090",
        tags=("high-memory", "production"),
    )
    assert best_id([good], s) == "a"
    odd = peer("b", region='EU "France"', engine="vllm")
    result = run([odd], step(region="EU-France"))
    assert result.drain == 'gate[4] match [region(got="EU \\"France\\"",want="EU-France")=1]'


def test_match_values_are_data_not_code() -> None:
    sneaky = 'x" or True or "'
    s = step(region=sneaky, tags=(sneaky,))
    assert best_id([peer("a", region="x")], s) is None
    assert best_id([peer("a", region=sneaky, tags=(sneaky,))], s) == "a"


# --- gates 5 and 6 ---------------------------------------------------------------------


def test_gate5_prev_failures_example_from_the_seeds() -> None:
    pool = [peer("a"), peer("b")]
    result = run(pool, failed=frozenset({"a", "b"}))
    assert result.drain == "gate[5] prev_failures [prev_failed=2]"
    assert result.waitable is False
    assert best_id(pool, failed=frozenset({"a"})) == "b"


def test_gate6_capacity() -> None:
    pool = [peer("a", active=10), peer("b", active=4, capacity=4), peer("c", active=7, capacity=5)]
    result = run(pool)
    assert result.drain == "gate[6] capacity [at_capacity=3]"
    assert result.waitable is True
    pool.append(peer("d", active=9))  # one slot left
    assert best_id(pool) == "d"


def test_failed_agents_are_removed_before_capacity() -> None:
    pool = [peer("a", active=10), peer("b")]
    result = run(pool, failed=frozenset({"b"}))
    assert result.drain == "gate[6] capacity [at_capacity=1]"
    assert result.waitable is True


# --- gate 7: exclude_if ----------------------------------------------------------------


def test_gate7_drain_example_from_the_seeds() -> None:
    s = step(Rule("kv_cache_utilization", "gt", 0.85))
    pool = [peer("a", engine_metrics={"kv_cache_utilization": 0.9})]
    pool.append(peer("b", engine_metrics={"kv_cache_utilization": 0.86}))
    result = run(pool, s)
    assert result.drain == "gate[7] exclude_if [kv_cache_utilization=2]"
    assert result.waitable is False


def test_gate7_counts_each_agent_under_its_first_violated_rule() -> None:
    s = step(Rule("success_rate", "lt", 0.95), Rule("gpu_temperature_c", "gt", 82))
    hot_and_failing = peer(
        "a",
        stats=UniversalStats(successes=1, failures=1),
        hardware_metrics={"gpu_temperature_c": 90},
    )
    hot = peer("b", hardware_metrics={"gpu_temperature_c": 83})
    hot2 = peer("c", hardware_metrics={"gpu_temperature_c": 85})
    result = run([hot_and_failing, hot, hot2], s)
    assert result.drain == "gate[7] exclude_if [success_rate=1,gpu_temperature_c=2]"


def test_gate7_any_violated_rule_excludes() -> None:
    s = step(Rule("kv_cache_utilization", "gt", 0.85), Rule("srtt", "gt", 500))
    slow = peer("a", stats=UniversalStats(successes=5, srtt_ms=600.0))
    fine = peer("b", active=5, engine_metrics={"kv_cache_utilization": 0.5})
    assert best_id([slow, fine], s) == "b"


def _violating(field: str) -> dict[str, Any]:
    """Keyword arguments for peer() that give `field` the value 5."""
    if field == "capacity_utilization":
        return {"active": 5, "capacity": 10}  # 0.5
    if field == "success_rate":
        return {"stats": UniversalStats(successes=1, failures=1)}  # 0.5
    if field == "srtt":
        return {"stats": UniversalStats(srtt_ms=0.5)}
    if field == "consecutive_failures":
        return {"stats": UniversalStats(successes=3, failures=1, consecutive_failures=0)}
    if field in ENGINE_FIELDS:
        return {"engine_metrics": {field: 0.5}}
    return {"hardware_metrics": {field: 0.5}}


@pytest.mark.parametrize("field", GATE_FIELDS)
def test_each_of_the_16_fields(field: str) -> None:
    """Every field: its value 0.5 (or 0 failures) is read, compared and explained."""
    value = 0.0 if field == "consecutive_failures" else 0.5
    agent = peer("a", **_violating(field))
    assert metric_value(agent, field, NOW) == value
    excluded = step(Rule(field, "gte", value))
    result = run([agent], excluded)
    assert result.best is None
    assert result.drain == f"gate[7] exclude_if [{field}=1]"
    assert best_id([agent], step(Rule(field, "gt", value))) == "a"


def test_there_are_16_gate_fields() -> None:
    assert len(GATE_FIELDS) == len(set(GATE_FIELDS)) == 16


@pytest.mark.parametrize(
    ("op", "value", "excluded"),
    [
        ("gt", 0.9, True),
        ("gt", 0.8, False),
        ("gt", 0.7, False),
        ("gte", 0.9, True),
        ("gte", 0.8, True),
        ("gte", 0.7, False),
        ("lt", 0.9, False),
        ("lt", 0.8, False),
        ("lt", 0.7, True),
        ("lte", 0.9, False),
        ("lte", 0.8, True),
        ("lte", 0.7, True),
    ],
)
def test_every_operator(op: str, value: float, excluded: bool) -> None:
    rule = Rule("kv_cache_utilization", op, 0.8)
    assert rule.violated(value) is excluded
    agent = peer("a", engine_metrics={"kv_cache_utilization": value})
    assert (best_id([agent], step(rule)) is None) is excluded


@pytest.mark.parametrize("field", GATE_FIELDS[1:])  # capacity_utilization is always known
def test_missing_metric_passes(field: str) -> None:
    agent = peer("a", active=3)  # no history, no engine or hardware values
    assert metric_value(agent, field, NOW) is None
    assert best_id([agent], step(Rule(field, "gte", -1e9))) == "a"


def test_reported_none_passes() -> None:
    agent = peer("a", engine_metrics={"kv_cache_utilization": None})
    assert best_id([agent], step(Rule("kv_cache_utilization", "gte", 0))) == "a"


def test_new_agent_without_history_passes_universal_gates() -> None:
    s = step(
        Rule("success_rate", "lt", 0.95),
        Rule("consecutive_failures", "gte", 0),
        Rule("srtt", "gt", 0),
    )
    assert best_id([peer("new")], s) == "new"
    veteran = peer("old", stats=UniversalStats(successes=1))
    assert best_id([veteran], s) is None
    assert run([veteran], s).drain == "gate[7] exclude_if [consecutive_failures=1]"


def test_srtt_counts_without_success_history() -> None:
    agent = peer("a", stats=UniversalStats(srtt_ms=900.0))
    assert best_id([agent], step(Rule("srtt", "gt", 500))) is None


def test_consecutive_failures_example() -> None:
    s = step(Rule("consecutive_failures", "gte", 3))
    streak = UniversalStats(successes=10, failures=3, consecutive_failures=3)
    recovered = UniversalStats(successes=11, failures=3, consecutive_failures=0)
    assert best_id([peer("a", stats=streak)], s) is None
    assert best_id([peer("a", stats=recovered)], s) == "a"


def test_capacity_utilization_example() -> None:
    s = step(Rule("capacity_utilization", "gt", 0.8))
    assert best_id([peer("a", active=9)], s) is None
    assert best_id([peer("a", active=8)], s) == "a"


@pytest.mark.parametrize(
    ("snapshot", "field", "interval"),
    [("engine", "kv_cache_utilization", 0.5), ("hardware", "gpu_temperature_c", 2.0)],
)
def test_stale_metric_passes(snapshot: str, field: str, interval: float) -> None:
    s = step(Rule(field, "gt", 0.5))
    fresh_edge = NOW - 3 * interval  # exactly three periods old: still current
    stale = fresh_edge - 0.001
    for at, excluded in ((NOW, True), (fresh_edge, True), (stale, False)):
        agent = peer("a", **{f"{snapshot}_metrics": {field: 0.9}, f"{snapshot}_at": at})
        assert (metric_value(agent, field, NOW) is None) is not excluded
        assert (best_id([agent], s) is None) is excluded


def test_stale_window_follows_the_agents_interval() -> None:
    agent = peer("a", engine_metrics={"kv_cache_utilization": 0.9}, engine_at=NOW - 10)
    assert metric_value(agent, "kv_cache_utilization", NOW) is None
    agent.engine_interval = 5.0
    assert metric_value(agent, "kv_cache_utilization", NOW) == 0.9


def test_metric_value_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="unknown gate field 'nope'"):
        metric_value(peer("a"), "nope", NOW)


def test_first_violation_in_rule_order() -> None:
    rules = (Rule("srtt", "gt", 100), Rule("capacity_utilization", "gte", 0.5))
    agent = peer("a", active=5, stats=UniversalStats(srtt_ms=200.0))
    assert first_violation(agent, rules, NOW) is rules[0]
    assert first_violation(agent, rules[1:], NOW) is rules[1]
    assert first_violation(peer("b"), rules, NOW) is None


def test_hand_built_rules_cannot_reach_the_compiled_pass() -> None:
    with pytest.raises(ValueError, match="invalid rule"):
        run([peer("a")], step(Rule("srtt or True", "gt", 1)))
    with pytest.raises(ValueError, match="invalid rule"):
        run([peer("a")], step(Rule("srtt", "==", 1)))


# --- which gate drained, and waiting -------------------------------------------------


def test_drain_names_the_last_gate_that_removed_anyone() -> None:
    s = step(Rule("kv_cache_utilization", "gt", 0.85), engine="vllm")
    pool = [
        peer("a", healthy=False),
        peer("b", engine="ollama"),
        peer("c", engine_metrics={"kv_cache_utilization": 0.99}),
    ]
    result = run(pool, s)
    assert result.drain == "gate[7] exclude_if [kv_cache_utilization=1]"
    assert result.waitable is False
    assert run(pool[:2], s).drain == 'gate[4] match [engine(got="ollama",want="vllm")=1]'


def test_waitable_when_a_full_agent_would_pass_gate7() -> None:
    s = step(Rule("kv_cache_utilization", "gt", 0.85))
    full_ok = peer("a", active=10, engine_metrics={"kv_cache_utilization": 0.5})
    full_hot = peer("b", active=10, engine_metrics={"kv_cache_utilization": 0.95})
    free_hot = peer("c", engine_metrics={"kv_cache_utilization": 0.95})
    assert run([full_ok, full_hot], s).waitable is True
    assert run([full_hot], s).waitable is False
    assert run([full_hot], s).drain == "gate[6] capacity [at_capacity=1]"
    # Drained at gate 7, but a full agent is otherwise eligible: a slot may free up.
    result = run([full_ok, free_hot], s)
    assert result.drain == "gate[7] exclude_if [kv_cache_utilization=1]"
    assert result.waitable is True
    assert run([full_hot, free_hot], s).waitable is False


def test_waitable_ignores_capacity_utilization_of_full_agents() -> None:
    s = step(Rule("capacity_utilization", "gte", 0.8))
    result = run([peer("a", active=10)], s)
    assert (result.drain, result.waitable) == ("gate[6] capacity [at_capacity=1]", True)


def test_not_waitable_when_nothing_is_full() -> None:
    for pool, s in (
        ([peer("a", healthy=False)], ANY),
        ([peer("a", capability="embedding")], ANY),
        ([peer("a")], step(engine="sglang")),
    ):
        assert run(pool, s).waitable is False


def test_survivor_count_and_best() -> None:
    pool = [peer(f"p{i}", active=i % 4) for i in range(10)]
    result = run(pool)
    # Least-loaded does not count its survivors; a strategy that ranks them all does.
    assert (result.best, result.survivors, result.drain, result.waitable) == (
        pool[0],
        None,
        None,
        False,
    )
    counted = run(pool, counting(ANY))
    assert (counted.survivors, counted.drain) == (10, None)


class _ReadCounter(dict):
    """An engine snapshot that counts gate 7's reads of it."""

    reads = 0

    def get(self, key: str, default: object = None) -> object:
        type(self).reads += 1
        return super().get(key, default)


def test_least_loaded_reads_the_gates_of_lighter_agents_only() -> None:
    # The first agent is the lightest and passes: no other agent's gate 7 is read. An
    # excluded agent lighter than the choice so far is still read, and passed over.
    s = step(Rule("kv_cache_utilization", "gt", 0.85))
    pool = [peer(f"p{i}", active=2 + i % 3) for i in range(50)]
    pool[0].active = 1
    pool[7].active = 0
    pool[7].engine = {"kv_cache_utilization": 0.9}
    for p in pool:
        p.engine = _ReadCounter(p.engine)
    _ReadCounter.reads = 0
    assert run(tuple(pool), s).best is pool[0]
    assert _ReadCounter.reads == 2  # p0, then p7 (lighter, excluded)


def test_least_loaded_of_large_tied_pools_matches_the_reference() -> None:
    # Few distinct loads over many agents (ties everywhere) and agents lighter than the
    # choice that fail a gate: the pass that skips heavier agents' gates still picks
    # the reference's first lowest survivor.
    rng = random.Random(20261206)
    for _ in range(200):
        pool = [_random_peer(rng, i) for i in range(rng.randrange(20, 120))]
        for p in pool:
            p.active = rng.choice((0, 0, 1, 1, 2, 4))
        s = _random_step(rng)
        failed = frozenset(p.peer_id for p in pool if rng.random() < 0.1)
        expected = _reference(pool, s, "llm", failed)
        assert evaluate(tuple(pool), s, "llm", failed, NOW).best is least_loaded(expected)


def test_policy_from_yaml_production_example() -> None:
    policy = load_policy(
        """
routing_policy:
  match:
    region: EU-France
    engine: vllm
    tags: [production]
  exclude_if:
    kv_cache_utilization: {gt: 0.85}
    gpu_temperature_c: {gt: 82}
    success_rate: {lt: 0.95}
    srtt: {gt: 500}
  strategy: least-loaded
  max_tries: 3
fallback_chain:
  - name: any-vllm-region
    match: {engine: vllm}
    exclude_if:
      success_rate: {lt: 0.9}
    strategy: least-loaded
"""
    )
    primary, relaxed = policy.steps
    paris = dict(region="EU-France", tags=("production",))
    pool = [
        peer("a", **paris, hardware_metrics={"gpu_temperature_c": 85}),
        peer("b", **paris, active=3, stats=UniversalStats(successes=93, failures=7)),
        peer("c", region="US-East", active=6),
    ]
    result = run(pool, primary)
    assert result.drain == "gate[7] exclude_if [gpu_temperature_c=1,success_rate=1]"
    assert best_id(pool, relaxed) == "a"
    assert best_id(pool, relaxed, failed=frozenset({"a"})) == "b"


# --- the compiled pass agrees with a plain reference -----------------------------------


def _reference(pool: list[Peer], s: Step, capability: str, failed: frozenset[str]) -> list[Peer]:
    """The seeds' gates written as plainly as possible."""
    out = []
    for p in pool:
        md = p.metadata
        if not (p.healthy and p.backend_healthy and p.connected and not p.draining):
            continue
        if md.capability != capability:
            continue
        fields = ("region", "engine", "organization", "machine", "gpu_model")
        if any(getattr(s.match, f) and getattr(s.match, f) != getattr(md, f) for f in fields):
            continue
        if not set(s.match.tags) <= set(md.tags):
            continue
        if p.peer_id in failed or p.active >= md.capacity:
            continue
        values = {f: metric_value(p, f, NOW) for f in GATE_FIELDS}
        stats, total = p.stats, p.stats.successes + p.stats.failures
        # The history gates judge an agent only while its breaker is open (peers.py).
        judged = total and stats.probe_at > NOW
        values["success_rate"] = stats.successes / total if judged else None
        values["consecutive_failures"] = stats.consecutive_failures if judged else None
        if any(values[r.field] is not None and r.violated(values[r.field]) for r in s.exclude_if):
            continue
        out.append(p)
    return out


def _random_peer(rng: random.Random, i: int) -> Peer:
    def maybe(value: float) -> float | None:
        return None if rng.random() < 0.2 else value

    history = rng.random() < 0.7
    failures = rng.randrange(0, 4) if history else 0
    return peer(
        f"p{i:03d}",
        capability=rng.choice(("llm", "llm", "embedding")),
        engine=rng.choice(("vllm", "sglang", "")),
        region=rng.choice(("EU-France", "EU", "US-East")),
        tags=tuple(t for t in ("production", "high-memory") if rng.random() < 0.6),
        capacity=rng.randrange(1, 5),
        active=rng.randrange(0, 5),
        healthy=rng.random() < 0.9,
        backend_healthy=rng.random() < 0.9,
        draining=rng.random() < 0.05,
        engine_metrics={f: maybe(rng.random()) for f in ENGINE_FIELDS},
        hardware_metrics={f: maybe(rng.uniform(0, 100)) for f in HARDWARE_FIELDS},
        engine_at=NOW - rng.uniform(0, 2),
        hardware_at=NOW - rng.uniform(0, 8),
        stats=UniversalStats(
            successes=rng.randrange(0, 10) if history else 0,
            failures=failures,
            consecutive_failures=rng.randrange(0, failures + 1),
            srtt_ms=maybe(rng.uniform(50, 900)),
            # Open, half-open (cool-down over), closed by a probe, or never tripped.
            probe_at=rng.choice((NOW + 1, NOW, NOW - 1, -math.inf, math.inf)),
        ),
    )


def _random_step(rng: random.Random) -> Step:
    match: dict[str, Any] = {}
    if rng.random() < 0.5:
        match["engine"] = rng.choice(("vllm", "sglang"))
    if rng.random() < 0.3:
        match["region"] = rng.choice(("EU-France", "EU"))
    if rng.random() < 0.4:
        match["tags"] = ("production",) if rng.random() < 0.5 else ("production", "high-memory")
    rules = []
    for field in rng.sample(GATE_FIELDS, rng.randrange(0, 5)):
        high = 900 if field == "srtt" else 100 if field in HARDWARE_FIELDS else 1
        threshold = rng.uniform(0, high) if field != "consecutive_failures" else rng.randrange(4)
        rules.append(Rule(field, rng.choice(("gt", "gte", "lt", "lte")), threshold))
    return step(*rules, **match)


def test_compiled_pass_matches_the_reference() -> None:
    rng = random.Random(20240601)
    drained = 0
    for _ in range(400):
        pool = [_random_peer(rng, i) for i in range(rng.randrange(1, 12))]
        s = _random_step(rng)
        failed = frozenset(p.peer_id for p in pool if rng.random() < 0.15)
        expected = _reference(pool, s, "llm", failed)
        result = evaluate(pool, s, "llm", failed, NOW)
        assert result.survivors == (None if expected else 0)
        assert result.best is least_loaded(expected)
        assert (result.drain is None) == bool(expected)
        # A PeerTable pool (a tuple) keeps its static verdicts; a second decision on it
        # reads the same, and so does a strategy ranked outside the compiled pass.
        frozen = tuple(pool)
        for _ in range(2):
            again = evaluate(frozen, s, "llm", failed, NOW)
            assert (again.best, again.survivors, again.drain) == (
                result.best,
                result.survivors,
                result.drain,
            )
        ranked = evaluate(
            frozen, dataclasses.replace(s, strategy="lowest-queue"), "llm", failed, NOW
        )
        assert ranked.survivors == len(expected)
        assert (ranked.best is None) == (not expected)
        # The drained gate is reported as a number too, and it is the one in the text.
        number = result.gate
        assert (number is None) == bool(expected)
        if result.drain is not None:
            assert result.drain.startswith(f"gate[{number}] {GATE_NAMES[number - 1]} [")
        drained += not expected
    assert 50 < drained < 350  # both outcomes were exercised


def test_the_gate_table_is_the_seeds_order() -> None:
    seeds = ("model_filter", "health", "capability", "match", "prev_failures", "capacity")
    assert (*seeds, "exclude_if") == GATE_NAMES


def test_each_removal_is_the_first_gate_whose_reference_check_fails() -> None:
    rng = random.Random(20261204)
    for _ in range(300):
        pool = [_random_peer(rng, i) for i in range(rng.randrange(1, 10))]
        s = _random_step(rng)
        failed = frozenset(p.peer_id for p in pool if rng.random() < 0.15)
        ctx = gates.context(s, "llm", failed, NOW)
        removed = gates._compiled(s).removals(pool, "llm", failed, NOW)
        survivors = gates._compiled(s).survivors(pool, "llm", failed, NOW)
        assert len(removed) + len(survivors) == len(pool)
        for number, p in removed:
            assert [bool(g.check(p, ctx)) for g in gates.GATES[:number]] == [
                *([False] * (number - 1)),
                True,
            ], (number, p.peer_id)
        for p in survivors:
            assert not any(g.check(p, ctx) for g in gates.GATES)


def test_a_pool_seen_before_rereads_every_live_signal() -> None:
    a, b = peer("A"), peer("B", engine="sglang")
    pool = (a, peer("A2", engine="sglang"), b)
    s = step(Rule("kv_cache_utilization", "gt", 0.8), engine="vllm")
    assert run(pool, s).best is a
    # Only the static gates' verdicts are kept: load, health, history and metrics are
    # read again on every decision of the same pool.
    a.active = a.metadata.capacity
    assert run(pool, s).drain == "gate[6] capacity [at_capacity=1]"
    a.active = 0
    a.engine = {"kv_cache_utilization": 0.9}
    assert run(pool, s).drain == "gate[7] exclude_if [kv_cache_utilization=1]"
    a.engine = {}
    a.healthy = False
    # Removed at gate 2, before the two gate 4 removes: the drain names gate 4.
    assert (run(pool, s).best, run(pool, s).gate) == (None, 4)
    a.healthy = True
    assert run(pool, s, frozenset({"A"})).drain == "gate[5] prev_failures [prev_failed=1]"
    # Another capability on the same pool is judged afresh.
    assert (
        run(pool, s, cap="embedding").drain
        == 'gate[3] capability [capability(got="llm",want="embedding")=3]'
    )
    assert run(pool, s).best is a


def test_peer_table_pools_are_replaced_never_changed_in_place() -> None:
    table = PeerTable()
    b, c = peer("B"), peer("C")
    table.add(c)
    table.add(b)
    before = table.for_model("m")
    assert before == (b, c)  # peer-ID order whatever the join order
    a = peer("A")
    table.add(a)
    # A join makes a new pool: what a decision worked out for the old one stays true
    # of the old one.
    assert before == (b, c)
    assert table.for_model("m") == (a, b, c)
    assert evaluate(table.for_model("m"), ANY, "llm", NO_FAILURES, NOW).best is a
    joined = table.for_model("m")
    table.remove(a)
    assert joined == (a, b, c)
    assert table.for_model("m") == (b, c)
    assert evaluate(table.for_model("m"), ANY, "llm", NO_FAILURES, NOW).best is b
    # A reconnect replaces the record in place of the old one.
    b2 = peer("B")
    assert table.add(b2) is b
    assert table.for_model("m") == (b2, c)
    table.remove(b2)
    table.remove(c)
    assert table.for_model("m") == ()
    assert table.models() == []
