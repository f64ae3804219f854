"""bench.peers' rounds: medians per cell and the targets taken within each round."""

from __future__ import annotations

from bench.loadgen import Result
from bench.peers import Cell, issue_checks, rows_of


def cell(
    target: str, stream: bool, clients: int, p50: float, rps: float, cpu: float | None = None
) -> Cell:
    result = Result(latencies=[p50 / 1000] * 10, elapsed=10 / rps)
    agent = cpu * 0.9 if target == "hivenet" and cpu else None
    return Cell(target, stream, clients, result, cpu_per_1k=cpu, agent_cpu_per_1k=agent)


def one_round(ours_lone: float, ours_cpu: float) -> list[Cell]:
    cells = []
    for stream in (False, True):
        cells += [
            cell("direct", stream, 1, 1.0, 900),
            cell("hivenet", stream, 1, 1.0 + ours_lone, 300, 1.0),
            cell("vllm-router", stream, 1, 1.5, 600, 0.4),
            cell("direct", stream, 64, 80.0, 800),
            cell("hivenet", stream, 64, 85.0, 700, ours_cpu),
            cell("vllm-router", stream, 64, 79.0, 810, 0.2),
        ]
    return cells


def test_rows_are_medians_over_rounds_in_the_first_rounds_order() -> None:
    rounds = [one_round(1.0, 0.3), one_round(2.0, 0.5), one_round(3.0, 0.35)]
    rows = rows_of(rounds)
    assert [(r.target, r.stream, r.clients) for r in rows[:3]] == [
        ("direct", False, 1),
        ("hivenet", False, 1),
        ("vllm-router", False, 1),
    ]
    lone = rows[1]
    assert lone.p50_ms == 3.0  # 2.0, 3.0 and 4.0
    busy = next(r for r in rows if r.target == "hivenet" and r.clients == 64 and not r.stream)
    assert busy.cpu_per_1k == 0.35
    assert busy.agent_cpu_per_1k is not None and abs(busy.agent_cpu_per_1k - 0.315) < 1e-9


def test_a_failed_cell_in_any_round_shows_its_note() -> None:
    second = one_round(1.0, 0.3)
    second[1] = Cell("hivenet", False, 1, None, note="stalled")
    rows = rows_of([one_round(1.0, 0.3), second])
    assert rows[1].note == "stalled"


def test_targets_are_judged_round_by_round() -> None:
    # vllm-router adds 0.5 ms for a lone client; ours adds 0.9, 1.1 and 1.3 ms.
    rounds = [one_round(0.9, 0.3), one_round(1.1, 0.5), one_round(1.3, 0.35)]
    checks = {c.name: c for c in issue_checks(rounds)}
    lone = checks["lone client's added p50 / vllm-router's, non-streaming"]
    assert [round(v, 2) for v in lone.values] == [1.8, 2.2, 2.6]
    assert "median 2.20" in lone.line() and "NOT met, in 1 of 3 rounds" in lone.line()
    cpu = checks["router CPU / vllm-router's, streaming, 64 clients"]
    assert [round(v, 2) for v in cpu.values] == [1.5, 2.5, 1.75]
    assert cpu.bound == 1.0 and "NOT met, in 0 of 3 rounds" in cpu.line()
    # Issue 51's bounds on the agent: 0.5x the router's on whole answers, 0.7x on streams.
    agent = checks["agent CPU / router's, non-streaming, 64 clients"]
    assert agent.bound == 0.5 and "NOT met, in 0 of 3" in agent.line()
    assert checks["agent CPU / router's, streaming, 64 clients"].bound == 0.7
    routed = checks["routed/direct req/s, streaming, 64 clients"]
    assert routed.bound == 0.6 and not routed.at_most and "met, in 3 of 3" in routed.line()
    assert checks["routed/direct req/s, non-streaming, 64 clients"].bound == 0.8


def test_trio_relays_lone_latency_is_shown_beside_ours() -> None:
    cells = [*one_round(1.0, 0.3), cell("trio-relays", False, 1, 1.6, 500, 0.5)]
    checks = {c.name: c for c in issue_checks([cells])}
    floor = checks[
        "lone client's added p50 / vllm-router's, non-streaming (trio-relays, the floor)"
    ]
    assert [round(v, 2) for v in floor.values] == [1.2]
    assert (
        "lone client's added p50 / vllm-router's, streaming (trio-relays, the floor)" not in checks
    )


def test_no_targets_without_vllm_router() -> None:
    cells = [c for c in one_round(1.0, 0.3) if c.target != "vllm-router"]
    names = {c.name for c in issue_checks([cells])}
    assert not any("vllm-router" in name for name in names)
    assert "agent CPU / router's, streaming, 64 clients" in names


def test_the_floors_agent_is_judged_against_vllm_routers_cpu() -> None:
    # Items 3 and 4 hold together only where an agent can spend at most 0.5x (whole)
    # or 0.7x (streams) of vllm-router's CPU: the floor's agent shows whether one can.
    cells = one_round(1.0, 0.3)
    for stream, agent in ((False, 0.12), (True, 0.13)):
        floor = cell("trio-floor", stream, 64, 70.0, 900, 0.1)
        floor.agent_cpu_per_1k = agent
        cells.append(floor)
    checks = {c.name.split(" (")[0]: c for c in issue_checks([cells])}
    whole = checks["trio-floor agent CPU / vllm-router's, non-streaming, 64 clients"]
    assert whole.bound == 0.5 and [round(v, 2) for v in whole.values] == [0.6]
    assert "NOT met" in whole.line()
    streamed = checks["trio-floor agent CPU / vllm-router's, streaming, 64 clients"]
    assert streamed.bound == 0.7 and [round(v, 2) for v in streamed.values] == [0.65]
    assert "met, in 1 of 1" in streamed.line()
    assert checks["trio-floor router CPU / vllm-router's, streaming, 64 clients"].bound == 1.0
