"""Every ranking unit behind the one signature: pure choices over plain peers, their
tie-breaks, what round-robin and prefix-aware remember, and the session's rule that a
unit hears of a choice only once the slot is held."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio

import router.session as session_module
from router.capacity import WaitQueue
from router.metrics import RouterMetrics
from router.peers import AgentMetadata, Peer, PeerTable, UniversalStats
from router.policy.gates import evaluate
from router.policy.prefix_tree import PrefixTree, blocks
from router.policy.rank import STRATEGIES, Ranking, RankRequest
from router.policy.rank_prefix import PrefixAware, PrefixParams
from router.policy.schema import load_policy
from router.session import RouteRequest, RoutingSession, Served, Slot

NOW = 1_000.0
MODEL = "m"


async def _send(message: dict) -> None:
    del message


def block_keys(turns: list[tuple[str, str]], block_chars: int) -> list[int]:
    return blocks(turns, block_chars)[0]


def agent(
    peer_id: str,
    active: int = 0,
    capacity: int = 10,
    model: str = MODEL,
    engine: dict[str, float | None] | None = None,
    srtt: float | None = None,
    engine_at: float = NOW,
) -> Peer:
    return Peer(
        peer_id=peer_id,
        metadata=AgentMetadata(model, "llm", "vllm", capacity),
        send=_send,
        connected_at=0.0,
        last_seen=NOW,
        active=active,
        engine=dict(engine or {}),
        engine_at=engine_at,
        stats=UniversalStats(srtt_ms=srtt),
    )


def pick(ranking: Ranking, name: str, peers: list[Peer], request: RankRequest | None = None):
    params = PrefixParams() if name == "prefix-aware" else None
    chosen = ranking.pick(name, params, peers, request or RankRequest(MODEL, {}), NOW)
    return chosen.peer_id if chosen else None


def conversation(system: str, *turns: str) -> RankRequest:
    messages = [{"role": "system", "content": system}]
    for i, turn in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": turn})
    return RankRequest(MODEL, {"messages": messages})


def test_every_unit_answers_none_for_no_candidates() -> None:
    ranking = Ranking()
    for name in STRATEGIES:
        assert pick(ranking, name, []) is None


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_unit_breaks_a_full_tie_by_the_lowest_peer_id(name: str) -> None:
    peers = [agent("A"), agent("B"), agent("C")]
    assert pick(Ranking(), name, peers) == "A"


def test_least_loaded_ranks_by_active_over_capacity() -> None:
    peers = [agent("A", 4, 10), agent("B", 1, 10), agent("C", 2, 40)]
    assert pick(Ranking(), "least-loaded", peers) == "C"


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("lowest-kv-cache", "kv_cache_utilization"),
        ("lowest-queue", "waiting_requests"),
        ("best-ttft", "avg_ttft_seconds"),
        ("best-itl", "avg_itl_seconds"),
    ],
)
def test_engine_metric_units_prefer_the_lowest_value_and_rank_unknown_last(
    name: str, field: str
) -> None:
    ranking = Ranking()
    low = agent("C", engine={field: 0.1})
    high = agent("B", engine={field: 0.7})
    unknown = agent("A", engine={field: None})
    assert pick(ranking, name, [unknown, high, low]) == "C"
    assert pick(ranking, name, [unknown, high]) == "B"
    # A snapshot three sampling periods old is unknown, as it is to gate 7.
    stale = agent("0", engine={field: 0.0}, engine_at=NOW - 10)
    assert pick(ranking, name, [stale, high]) == "B"
    # Equal values: the lighter agent, then the lowest peer ID.
    assert (
        pick(
            ranking, name, [agent("A", 3, engine={field: 0.5}), agent("B", 1, engine={field: 0.5})]
        )
        == "B"
    )
    assert (
        pick(ranking, name, [agent("A", engine={field: 0.5}), agent("B", engine={field: 0.5})])
        == "A"
    )
    # Nobody reports it: the unit is least-loaded.
    assert pick(ranking, name, [agent("A", 5), agent("B", 2)]) == "B"


def test_lowest_srtt_measures_a_newcomer_first() -> None:
    ranking = Ranking()
    fast, slow = agent("B", srtt=20.0), agent("C", srtt=300.0)
    assert pick(ranking, "lowest-srtt", [slow, fast]) == "B"
    # No SRTT yet: only a request to it can measure it.
    assert pick(ranking, "lowest-srtt", [agent("D"), fast, slow]) == "D"
    assert pick(ranking, "lowest-srtt", [agent("A", 2, srtt=20.0), agent("B", 1, srtt=20.0)]) == "B"


def test_round_robin_takes_each_agent_in_peer_id_order() -> None:
    ranking = Ranking()
    peers = [agent("A"), agent("B"), agent("C")]
    seen = []
    for _ in range(5):
        chosen = ranking.pick("round-robin", None, peers, RankRequest(MODEL, {}), NOW)
        assert chosen is not None
        ranking.chosen("round-robin", None, chosen, RankRequest(MODEL, {}))
        seen.append(chosen.peer_id)
    assert seen == ["A", "B", "C", "A", "B"]


def test_round_robin_turns_survive_joins_gates_and_unused_picks() -> None:
    ranking = Ranking()
    a, b, c = agent("A"), agent("C"), agent("E")
    ranking.chosen("round-robin", None, a, RankRequest(MODEL, {}))
    # A pick that did not get its slot is not a turn: the next pick is the same agent.
    assert pick(ranking, "round-robin", [a, b, c]) == "C"
    assert pick(ranking, "round-robin", [a, b, c]) == "C"
    # An agent that joins between A and C takes its turn by ID; a gated-out one is skipped.
    assert pick(ranking, "round-robin", [a, agent("B"), b, c]) == "B"
    assert pick(ranking, "round-robin", [a, c]) == "E"
    # Models keep their own turns.
    other = RankRequest("other", {})
    assert ranking.pick("round-robin", None, [agent("A", model="other")], other, NOW) is not None
    assert pick(ranking, "round-robin", [a, b, c]) == "C"


def test_prefix_aware_without_memory_is_least_loaded() -> None:
    peers = [agent("A", 2), agent("B", 1), agent("C", 1)]
    assert pick(Ranking(), "prefix-aware", peers, conversation("sys", "hi")) == "B"


def test_prefix_aware_sends_the_next_turn_where_the_conversation_went() -> None:
    ranking = Ranking()
    params = PrefixParams()
    a, b, c = agent("A"), agent("B"), agent("C")
    turn1 = conversation("You are terse. " * 40, "first question " * 30)
    ranking.chosen("prefix-aware", params, c, turn1)
    turn2 = conversation("You are terse. " * 40, "first question " * 30, "answer", "next")
    # C is now busier than A and B, but within the balance threshold (0.25 of 10).
    c.active = 1
    assert pick(ranking, "prefix-aware", [a, b, c], turn2) == "C"
    # Another conversation shares nothing: the lightest agent.
    assert pick(ranking, "prefix-aware", [a, b, c], conversation("other", "hi")) == "A"


def test_prefix_aware_falls_back_to_load_past_the_balance_threshold() -> None:
    ranking = Ranking()
    params = PrefixParams(balance_threshold=0.25)
    a, b = agent("A", 1), agent("B", 0)
    turn = conversation("system " * 100, "question " * 50)
    ranking.chosen("prefix-aware", params, a, turn)
    # 0.1 above the lightest: cached wins; 0.3 above: the lightest wins.
    assert ranking.pick("prefix-aware", params, [a, b], turn, NOW) is a
    a.active = 3
    assert ranking.pick("prefix-aware", params, [a, b], turn, NOW) is b
    # Exactly at the threshold still counts as balanced.
    a.active = 2
    b.active = 0
    a.metadata = AgentMetadata(MODEL, "llm", "vllm", 8)
    assert ranking.pick("prefix-aware", params, [a, b], turn, NOW) is a
    # A threshold of 0 never trades load for cache.
    strict = PrefixParams(balance_threshold=0.0)
    ranking.chosen("prefix-aware", strict, a, turn)
    assert ranking.pick("prefix-aware", strict, [a, b], turn, NOW) is b


def test_prefix_aware_prefers_the_longest_prefix_among_balanced_agents() -> None:
    ranking = Ranking()
    params = PrefixParams(block_chars=16)
    a, b, c = agent("A"), agent("B"), agent("C")
    system = "shared system prompt " * 10
    ranking.chosen("prefix-aware", params, a, conversation(system, "alpha " * 20))
    ranking.chosen("prefix-aware", params, b, conversation(system, "beta " * 20))
    ranking.chosen("prefix-aware", params, c, conversation(system, "beta " * 20, "x", "y"))
    turn = conversation(system, "beta " * 20, "x", "y", "z")
    assert ranking.pick("prefix-aware", params, [a, b, c], turn, NOW) is c
    # C too busy: B holds the next longest prefix.
    c.active = 9
    assert ranking.pick("prefix-aware", params, [a, b, c], turn, NOW) is b
    # Equal prefixes (only the system prompt): the lighter, then the lowest peer ID.
    new = conversation(system, "gamma")
    assert ranking.pick("prefix-aware", params, [a, b, c], new, NOW) is a
    a.active = 1
    assert ranking.pick("prefix-aware", params, [a, b, c], new, NOW) is b


def test_prefix_aware_forgets_an_agent_that_leaves() -> None:
    ranking = Ranking()
    a, b = agent("A", 1), agent("B", 0)
    turn = conversation("system " * 100, "question")
    ranking.chosen("prefix-aware", PrefixParams(), a, turn)
    assert pick(ranking, "prefix-aware", [a, b], turn) == "A"
    ranking.forget("A")
    unit = ranking.unit("prefix-aware")
    assert isinstance(unit, PrefixAware)
    assert unit.tree(MODEL, PrefixParams().block_chars) is None
    # A's new session starts with nothing remembered.
    assert pick(ranking, "prefix-aware", [agent("A", 1), b], turn) == "B"


def test_the_peer_table_tells_the_ranking_who_left() -> None:
    table = PeerTable()
    ranking = Ranking()
    table.on_remove(ranking.forget)
    a = agent("A")
    table.add(a)
    turn = conversation("s " * 300, "q")
    ranking.chosen("prefix-aware", PrefixParams(), a, turn)
    unit = ranking.unit("prefix-aware")
    assert isinstance(unit, PrefixAware)
    assert unit.tree(MODEL, PrefixParams().block_chars) is not None
    table.remove(a)
    assert unit.tree(MODEL, PrefixParams().block_chars) is None


def test_prefix_trees_are_per_model() -> None:
    ranking = Ranking()
    params = PrefixParams()
    turn = conversation("system " * 100, "question")
    ranking.chosen("prefix-aware", params, agent("B"), turn)
    other = RankRequest("other", turn.payload)
    peers = [agent("A", model="other"), agent("B", 1, model="other")]
    assert ranking.pick("prefix-aware", params, peers, other, NOW) is peers[0]


def test_the_prompt_is_cut_once_per_request() -> None:
    turn = conversation("system " * 100, "question")
    first = turn.blocks(PrefixParams().block_chars)
    assert turn.blocks(PrefixParams().block_chars) is first
    assert turn.blocks(16) is not first


def test_evaluate_ranks_the_survivors_with_the_steps_strategy() -> None:
    policy = load_policy("routing_policy:\n  match: {}\n  strategy: round-robin\n")
    step = policy.routing_policy
    ranking = Ranking()
    pool = [agent("A"), agent("B", active=10), agent("C")]
    request = RankRequest(MODEL, {})
    first = evaluate(pool, step, "llm", frozenset(), NOW, ranking, request)
    assert first.best is pool[0]
    ranking.chosen(step.strategy, step.strategy_params, pool[0], request)
    # B is full (gate 6): round-robin never sees it.
    assert evaluate(pool, step, "llm", frozenset(), NOW, ranking, request).best is pool[2]


class _Answer:
    def __init__(self, slot: Slot) -> None:
        self.slot = slot


async def test_a_unit_hears_of_a_choice_only_once_its_slot_is_held(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race re-select: the agent that lost its last slot is not remembered."""
    policy = load_policy("routing_policy:\n  match: {}\n  strategy: prefix-aware\n")
    table = PeerTable()
    a, b = agent("A", capacity=1), agent("B", capacity=1)
    table.add(a)
    table.add(b)
    ranking = Ranking()
    served: list[str] = []

    async def forward(peer: Peer, req: RouteRequest, slot: Slot) -> object:
        served.append(peer.peer_id)
        slot.release()
        return _Answer(slot)

    real_evaluate = session_module.evaluate
    calls = 0

    def racing_evaluate(*args: Any) -> Any:
        nonlocal calls
        ev = real_evaluate(*args)
        calls += 1
        if calls == 1:
            ev.best.active = ev.best.capacity  # another request took A's last slot
        return ev

    monkeypatch.setattr(session_module, "evaluate", racing_evaluate)
    session = RoutingSession(
        table, WaitQueue(10), RouterMetrics(), forward, 3, lambda peer: None, ranking=ranking
    )
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "x " * 400}]}
    req = RouteRequest("r1", MODEL, "llm", "", "POST", "/v1/chat/completions", {}, b"", False)
    req.payload = payload
    with trio.fail_after(10):
        outcome = await session.route(policy, req)
    assert isinstance(outcome, Served)
    assert served == ["B"]
    unit = ranking.unit("prefix-aware")
    assert isinstance(unit, PrefixAware)
    tree = unit.tree(MODEL, PrefixParams().block_chars)
    assert tree is not None
    assert set(tree.match(RankRequest(MODEL, payload).blocks(PrefixParams().block_chars)[0])) == {
        "B"
    }


def test_unknown_values_are_infinite_not_missing() -> None:
    # A value of +inf reported by an engine ties with unknown: load decides.
    ranking = Ranking()
    peers = [agent("A", 3, engine={"waiting_requests": math.inf}), agent("B", 1)]
    assert pick(ranking, "lowest-queue", peers) == "B"


def test_prefix_aware_moves_only_past_both_balance_thresholds() -> None:
    ranking = Ranking()
    params = PrefixParams(balance_threshold=0.25, balance_rel_threshold=1.5)
    home, other = agent("A", capacity=16), agent("B", capacity=16)
    turn = conversation("system " * 100, "question " * 20)
    ranking.chosen("prefix-aware", params, home, turn)

    def where(home_active: int, other_active: int, p: PrefixParams = params) -> str:
        home.active, other.active = home_active, other_active
        chosen = ranking.pick("prefix-aware", p, [home, other], turn, NOW)
        assert chosen is not None
        return chosen.peer_id

    # 4 of 16 above the lightest is exactly the absolute threshold: it stays.
    assert where(4, 0) == "A"
    # 5 above, and more than 1.5 times: it moves.
    assert where(5, 0) == "B"
    # 5 above but not over 1.5 times as busy (15 against 10): it stays.
    assert where(15, 10) == "A"
    assert where(15, 10, PrefixParams(balance_threshold=0.25, balance_rel_threshold=1.0)) == "B"


def test_prefix_aware_places_a_prompt_that_matches_too_little_by_cache_fill() -> None:
    ranking = Ranking()
    params = PrefixParams(block_chars=64, cache_threshold=0.7)
    a, b, c = agent("A"), agent("B"), agent("C")
    system = "s" * 640  # ten blocks
    # A holds two long conversations, B one short, C nothing.
    ranking.chosen("prefix-aware", params, a, conversation(system, "a" * 640))
    ranking.chosen("prefix-aware", params, a, conversation(system, "b" * 640))
    ranking.chosen("prefix-aware", params, b, conversation("t" * 64, "c" * 64))
    # The system prompt is 10/15 of this first turn, under 0.7: not A for its cache,
    # but the agent whose remembered blocks are fewest, though it is not the lightest.
    first = conversation(system, "d" * 320)
    c.active = 1
    assert ranking.pick("prefix-aware", params, [a, b, c], first, NOW) is c
    # The same prompt at a threshold it meets follows its system prompt to A.
    loose = PrefixParams(block_chars=64, cache_threshold=0.6)
    assert ranking.pick("prefix-aware", loose, [a, b, c], first, NOW) is a
    # Among agents whose fill is within balance_rel_threshold of the fewest, the one
    # holding the longer match: C and D hold ten blocks each, only D's the system prompt.
    d = agent("D")
    ranking.chosen("prefix-aware", params, c, conversation("u" * 640))
    ranking.chosen("prefix-aware", params, d, conversation(system))
    assert ranking.pick("prefix-aware", params, [a, c, d], first, NOW) is d
    # An overloaded agent is passed over.
    d.active = 9
    assert ranking.pick("prefix-aware", params, [a, c, d], first, NOW) is c


def test_prefix_tree_counts_the_blocks_each_agent_holds() -> None:
    tree = PrefixTree()
    keys = block_keys([("system", "s" * 64), ("user", "u" * 64)], 32)
    tree.insert(keys, "A", 100)
    tree.insert(keys, "A", 100)  # the same prompt again adds nothing
    tree.insert(keys[:2], "B", 100)
    assert tree.held == {"A": 4, "B": 2}
    # Eviction takes the least recently used nodes and their holders' counts.
    tree.insert(block_keys([("user", "v" * 64)], 32), "C", 4)
    assert tree.held == {"A": 2, "B": 2, "C": 2}
    tree.forget("B")
    assert tree.held == {"A": 2, "C": 2}
