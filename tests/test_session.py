"""The routing session and the dispatcher with plain objects: steps, tries, recovery,
the capacity queue and the exhaustion report, against the seeds.

Time is trio's MockClock (`autojump_clock`): waits that would take seconds take none,
and a test never depends on how fast the machine is.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from protocol.errors import ErrorCode, RouterError
from router import session as session_module
from router.capacity import WaitQueue
from router.continuation_relay import StreamContinuer
from router.dispatch import Dispatcher, ProviderServed
from router.http import admin
from router.metrics import UNREGISTERED_MODEL, RouterMetrics
from router.peers import AgentMetadata, Peer, PeerTable
from router.policy.schema import ProviderFallback, load_policy
from router.policy.store import PolicyStore
from router.session import (
    BackendRejected,
    Exhausted,
    ForwardFailure,
    RouteRequest,
    RoutingSession,
    Served,
    Slot,
    exhaustion_line,
)

MODEL = "m"
HANG = 3600.0

# --- plain objects ---------------------------------------------------------------------


async def _send(message: dict) -> None:
    del message


def make_peer(
    peer_id: str,
    *,
    model: str = MODEL,
    capacity: int = 10,
    active: int = 0,
    engine: str = "sim",
    region: str = "",
    capability: str = "llm",
    kv_cache_utilization: float | None = None,
) -> Peer:
    """An agent record as the link would build it; call inside trio for fresh metrics."""
    now = trio.current_time()
    return Peer(
        peer_id=peer_id,
        metadata=AgentMetadata(
            model=model, capability=capability, engine=engine, capacity=capacity, region=region
        ),
        send=_send,
        connected_at=now,
        last_seen=now,
        active=active,
        engine={"kv_cache_utilization": kv_cache_utilization},
        engine_at=now,
        # Engine snapshots go stale after three periods; a test's metrics should not.
        engine_interval=1e9,
    )


def request(model: str = MODEL, capability: str = "llm", path: str = "/v1/chat/completions"):
    return RouteRequest(
        request_id=str(uuid.uuid4()),
        model=model,
        capability=capability,
        tenant="t",
        method="POST",
        path=path,
        headers={},
        body=b"{}",
        stream=False,
    )


@dataclass
class Answer:
    """What the fake forward returns on success; it owns the slot, like AgentResponse."""

    peer: Peer
    slot: Slot
    request_id: str

    def close(self) -> None:
        self.slot.release()


def fail(code: ErrorCode = ErrorCode.BACKEND_UNAVAILABLE) -> ForwardFailure:
    return ForwardFailure(code, f"simulated {code}")


def disconnect() -> ForwardFailure:
    return ForwardFailure(ErrorCode.AGENT_DISCONNECTED, "stale session", connection_level=True)


OK = "ok"
# A behaviour: OK, a ForwardFailure, or an async callable run in place of the answer
# (which answers OK unless it returns a ForwardFailure).
Behaviour = Any


@dataclass
class Call:
    peer_id: str
    request_id: str
    active: int  # the agent's active count while the forward ran (slot included)
    capacity: int


@dataclass
class Harness:
    """A peer table, a queue, metrics, a session and a dispatcher around a fake forward."""

    policy_yaml: str
    peers: list[Peer]
    queue_depth: int = 30
    max_tries: int = 3
    # Per agent, the outcomes of its successive forwards; OK once the list runs out.
    script: dict[str, list[Behaviour]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.metrics = RouterMetrics()
        self.table = PeerTable()
        self.queue = WaitQueue(self.queue_depth)
        self.table.on_change(self.queue.notify)
        for p in self.peers:
            self.table.add(p)
        self.session = RoutingSession(
            self.table,
            self.queue,
            self.metrics,
            self.forward,
            self.max_tries,
            self.notify,
        )
        self.store = PolicyStore(self.metrics)
        assert self.store.replace(self.policy_yaml, "test") == []

    def notify(self, peer: Peer) -> None:
        self.queue.notify(peer.metadata.model)

    def dispatcher(self, **kwargs: Any) -> Dispatcher:
        return Dispatcher(self.table, self.session, self.store, self.metrics, **kwargs)

    async def forward(self, peer: Peer, req: RouteRequest, slot: Slot) -> object:
        assert slot.peer is peer and not slot.released
        assert 0 < peer.active <= peer.capacity
        self.calls.append(Call(peer.peer_id, req.request_id, peer.active, peer.capacity))
        outcomes = self.script.get(peer.peer_id, [])
        behaviour = outcomes.pop(0) if outcomes else OK
        if callable(behaviour):
            behaviour = await behaviour() or OK
        if isinstance(behaviour, ForwardFailure):
            return behaviour
        return Answer(peer, slot, req.request_id)

    async def route(self, req: RouteRequest | None = None) -> Served | Exhausted:
        # A request stuck by a bug fails the test (in virtual time) instead of hanging it.
        with trio.fail_after(HANG):
            return await self.session.route(self.store.current, req or request())

    def tried(self) -> list[str]:
        return [c.peer_id for c in self.calls]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (model MODEL)."""
        return sample_sum(self.metrics, name, labels or {"model": MODEL})

    def counters(self) -> dict[str, float]:
        return {
            name: self.metric(f"hivenet_router_{name}_total")
            for name in (
                "routing_requests_routed",
                "policy_primary_routed",
                "policy_fallback_routed",
                "policy_provider_fallback",
                "policy_exhausted",
            )
        }


def sample_sum(metrics: RouterMetrics, name: str, labels: dict[str, str]) -> float:
    """Sum over the samples of `name` whose labels include `labels` (any tenant)."""
    return sum(
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def counters(
    routed: int = 0, primary: int = 0, fallback: int = 0, provider: int = 0, exhausted: int = 0
) -> dict[str, float]:
    return {
        "routing_requests_routed": routed,
        "policy_primary_routed": primary,
        "policy_fallback_routed": fallback,
        "policy_provider_fallback": provider,
        "policy_exhausted": exhausted,
    }


def policy(*steps: str) -> str:
    """A policy from step bodies: the first is routing_policy, the rest the chain."""
    primary, *chain = steps
    text = "routing_policy:\n" + _indent(primary, 2)
    if chain:
        text += "fallback_chain:\n"
        for body in chain:
            lines = _indent(body, 4).splitlines()
            text += "  - " + lines[0].lstrip() + "\n" + "".join(f"{line}\n" for line in lines[1:])
    return text


def _indent(body: str, n: int) -> str:
    lines = [line for line in body.strip("\n").splitlines() if line.strip()]
    base = min(len(line) - len(line.lstrip()) for line in lines)
    return "".join(" " * n + line[base:] + "\n" for line in lines)


ANY = "strategy: least-loaded"


def exhausted_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "policy_exhausted" in r.getMessage()]


@pytest.fixture(autouse=True)
def _policy_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="policy")


# --- the policy helper itself ------------------------------------------------------------


def test_policy_helper_builds_named_chains() -> None:
    text = policy("match: {engine: vllm}\nstrategy: least-loaded", "name: a\n" + ANY)
    loaded = load_policy(text)
    assert loaded.chain_names() == ["routing_policy", "a"]
    assert loaded.routing_policy.match.engine == "vllm"


# --- selection ---------------------------------------------------------------------------


async def test_least_loaded_picks_the_seeds_agent_a(autojump_clock: Any) -> None:
    # The seeds' table: A 4/20 = 0.20, B 8/20 = 0.40, C 5/10 = 0.50.
    peers = [
        make_peer("C", capacity=10, active=5),
        make_peer("B", capacity=20, active=8),
        make_peer("A", capacity=20, active=4),
    ]
    h = Harness(policy(ANY), peers)
    served = await h.route()
    assert isinstance(served, Served)
    assert served.peer.peer_id == "A"
    assert served.step_index == 0 and served.step_name == "routing_policy"
    assert peers[2].active == 5  # the slot is held by the answer until it is closed
    served.response.close()
    assert peers[2].active == 4


async def test_the_selection_is_logged_with_the_survivors_a_strategy_counted(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    peers = [make_peer("A", capacity=20, active=4), make_peer("B", capacity=20, active=8)]
    for strategy, counted in (("least-loaded", ""), ("round-robin", " survivors=2")):
        caplog.clear()
        served = await Harness(policy(f"strategy: {strategy}"), peers).route()
        assert isinstance(served, Served)
        served.response.close()
        lines = [r.getMessage() for r in caplog.records if "step_selected" in r.getMessage()]
        assert len(lines) == 1
        assert f"step=routing_policy peer=A active=5 capacity=20{counted} tenant=" in lines[0]


async def test_equal_load_goes_to_the_lowest_peer_id_every_time(autojump_clock: Any) -> None:
    h = Harness(policy(ANY), [make_peer("p2", capacity=4), make_peer("p1", capacity=2)])
    for _ in range(3):
        served = await h.route()
        assert isinstance(served, Served)
        assert served.peer.peer_id == "p1"
        served.response.close()


async def test_load_moves_traffic_while_slots_are_held(autojump_clock: Any) -> None:
    h = Harness(policy(ANY), [make_peer("a", capacity=2), make_peer("b", capacity=2)])
    held = []
    for _ in range(4):
        served = await h.route()
        assert isinstance(served, Served)
        held.append(served)
    assert [s.peer.peer_id for s in held] == ["a", "b", "a", "b"]
    for s in held:
        s.response.close()
    assert all(p.active == 0 for p in h.peers)


# --- forward budgets and the failed-agent set --------------------------------------------


async def test_max_tries_two_with_three_agents_advances_without_trying_c(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The seeds: try A, record a failure, exclude A; try B, fail; advance. C is never
    # tried in that step; A may be chosen again in the next one.
    h = Harness(
        policy("max_tries: 2\n" + ANY, "name: again\nmax_tries: 1\n" + ANY),
        [make_peer("A"), make_peer("B"), make_peer("C")],
        script={"A": [fail(), fail()], "B": [fail()]},
    )
    outcome = await h.route()
    assert isinstance(outcome, Exhausted)
    assert h.tried() == ["A", "B", "A"]
    assert outcome.reason == "routing_policy: max_tries exhausted | again: max_tries exhausted"
    assert outcome.error.code == ErrorCode.BACKEND_UNAVAILABLE
    assert (
        h.metric("hivenet_router_forward_failures_total", model=MODEL, code="backend_unavailable")
        == 3
    )
    assert all(p.active == 0 for p in h.peers)
    forward_errors = [r.getMessage() for r in caplog.records if "forward_error" in r.getMessage()]
    assert len(forward_errors) == 3
    assert "step=routing_policy peer=A code=backend_unavailable" in forward_errors[0]


async def test_a_failed_agent_is_excluded_in_its_step_and_another_serves(
    autojump_clock: Any,
) -> None:
    h = Harness(
        policy(ANY),
        [make_peer("A"), make_peer("B"), make_peer("C")],
        script={"A": [fail(ErrorCode.BACKEND_ERROR)], "B": [fail()]},
    )
    served = await h.dispatcher().dispatch(request())
    assert isinstance(served, Served)
    assert h.tried() == ["A", "B", "C"]
    assert served.peer.peer_id == "C" and served.step_index == 0
    assert h.counters() == counters(routed=1, primary=1)
    served.response.close()


async def test_an_agent_lacking_the_path_is_remembered_and_not_charged(
    autojump_clock: Any,
) -> None:
    """Issue 47 item 3: `endpoint_not_supported` costs the agent nothing, and the next
    requests for that path skip it (for LACKS_PATH_SECONDS), even in a later step; when
    it is the only agent the client hears `endpoint_not_supported`, not a 503."""
    lacking = fail(ErrorCode.ENDPOINT_NOT_SUPPORTED)
    h = Harness(
        policy(ANY, "name: second\n" + ANY),
        [make_peer("A"), make_peer("B")],
        script={"A": [lacking]},
    )
    responses = "/v1/responses"
    served = await h.dispatcher().dispatch(request(path=responses))
    assert isinstance(served, Served) and served.peer.peer_id == "B"
    served.response.close()
    assert h.tried() == ["A", "B"]
    a = h.table.get("A")
    assert a is not None and a.stats.consecutive_failures == 0
    for _ in range(3):
        served = await h.dispatcher().dispatch(request(path=responses))
        assert isinstance(served, Served) and served.peer.peer_id == "B"
        served.response.close()
    assert h.tried() == ["A", "B", "B", "B", "B"]
    # Other paths still go to A.
    served = await h.dispatcher().dispatch(request())
    assert isinstance(served, Served) and served.peer.peer_id == "A"
    served.response.close()
    # A alone: the remembered refusal, in every step, without asking A.
    h.table.remove(h.table.get("B"))  # type: ignore[arg-type]
    calls = len(h.calls)
    with pytest.raises(RouterError) as refused:
        await h.dispatcher().dispatch(request(path=responses))
    assert refused.value.code is ErrorCode.ENDPOINT_NOT_SUPPORTED
    assert refused.value.http_status == 404 and responses in refused.value.message
    assert len(h.calls) == calls
    # Asked again once the memory runs out (an engine upgraded in place).
    await trio.sleep(session_module.LACKS_PATH_SECONDS + 1)
    served = await h.dispatcher().dispatch(request(path=responses))
    assert isinstance(served, Served) and served.peer.peer_id == "A"
    served.response.close()


async def test_a_failed_agent_is_eligible_again_in_the_next_step(autojump_clock: Any) -> None:
    h = Harness(
        policy("max_tries: 1\n" + ANY, "name: second\n" + ANY),
        [make_peer("A")],
        script={"A": [fail()]},
    )
    served = await h.dispatcher().dispatch(request())
    assert isinstance(served, Served)
    assert h.tried() == ["A", "A"]
    assert served.step_name == "second"
    assert h.counters() == counters(routed=1, fallback=1)
    served.response.close()


async def test_max_tries_omitted_uses_max_tries_per_step(autojump_clock: Any) -> None:
    peers = [make_peer(f"p{i}") for i in range(6)]
    h = Harness(policy(ANY), peers, max_tries=4, script={p.peer_id: [fail()] for p in peers})
    outcome = await h.route()
    assert isinstance(outcome, Exhausted)
    assert h.tried() == ["p0", "p1", "p2", "p3"]
    assert outcome.reason == "routing_policy: max_tries exhausted"


async def test_two_agents_with_max_tries_five_are_drained_by_gate_5(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness(
        policy("max_tries: 5\n" + ANY),
        [make_peer("A"), make_peer("B")],
        script={"A": [fail()], "B": [fail()]},
    )
    req = request()
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(req)
    assert h.tried() == ["A", "B"]
    assert caught.value.code == ErrorCode.BACKEND_UNAVAILABLE
    (line,) = exhausted_lines(caplog)
    assert line.endswith('tried=1/1 reason="routing_policy: gate[5] prev_failures [prev_failed=2]"')
    assert line.startswith(f"req={req.request_id} ")


@pytest.mark.parametrize(
    "code",
    [
        ErrorCode.REQUEST_INVALID,
        ErrorCode.INVALID_PARAMETER,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED,
        ErrorCode.TOKEN_LIMIT_EXCEEDED,
    ],
)
async def test_request_level_errors_go_to_the_client_at_once(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture, code: ErrorCode
) -> None:
    rejection = ForwardFailure(code, "the backend said no", status=400, body=b'{"error":{}}')
    h = Harness(
        policy("max_tries: 3\n" + ANY, "name: fallback\n" + ANY),
        [make_peer("A"), make_peer("B")],
        script={"A": [rejection]},
    )
    with pytest.raises(BackendRejected) as caught:
        await h.dispatcher().dispatch(request())
    assert caught.value.failure is rejection
    assert h.tried() == ["A"]  # no other agent, no later step
    assert h.counters() == counters()
    assert exhausted_lines(caplog) == []
    assert h.metric("hivenet_router_forward_failures_total", model=MODEL, code=str(code)) == 1
    assert all(p.active == 0 for p in h.peers)


# --- connection-level recovery ----------------------------------------------------------


async def test_first_disconnect_per_agent_is_free_and_counted_as_a_reset(
    autojump_clock: Any,
) -> None:
    # With max_tries 1, a try spent on the disconnect would leave none for the retry.
    h = Harness(policy("max_tries: 1\n" + ANY), [make_peer("A")], script={"A": [disconnect()]})
    served = await h.route()
    assert isinstance(served, Served)
    assert h.tried() == ["A", "A"]
    assert h.metric("hivenet_router_agent_connection_resets_total") == 1
    assert (
        h.metric("hivenet_router_forward_failures_total", model=MODEL, code="agent_disconnected")
        == 1
    )
    served.response.close()


async def test_second_disconnect_of_an_agent_consumes_a_try(autojump_clock: Any) -> None:
    h = Harness(
        policy("max_tries: 1\n" + ANY),
        [make_peer("A"), make_peer("B")],
        script={"A": [disconnect(), disconnect()]},
    )
    outcome = await h.route()
    assert isinstance(outcome, Exhausted)
    assert h.tried() == ["A", "A"]  # B untried: the second disconnect spent the only try
    assert outcome.reason == "routing_policy: max_tries exhausted"
    assert outcome.error.code == ErrorCode.AGENT_DISCONNECTED
    assert h.metric("hivenet_router_agent_connection_resets_total") == 1


async def test_an_agent_gone_after_its_free_recovery_is_agent_disconnected(
    autojump_clock: Any,
) -> None:
    """The only agent's session died with the request on it: the client hears that, not
    that no agent was ever there."""
    agent = make_peer("A")

    async def session_lost() -> ForwardFailure:
        agent.connected = False
        return disconnect()

    h = Harness(policy("max_tries: 3\n" + ANY), [agent], script={"A": [session_lost]})
    outcome = await h.route()
    assert isinstance(outcome, Exhausted)
    assert h.tried() == ["A"]
    assert outcome.reason == "routing_policy: gate[2] health [disconnected=1]"
    assert outcome.error.code == ErrorCode.AGENT_DISCONNECTED
    assert h.metric("hivenet_router_agent_connection_resets_total") == 1


async def test_an_agent_without_a_slot_for_it_counts_a_rejection_not_a_try(
    autojump_clock: Any,
) -> None:
    """Upstream's `rejected_requests_total`: the agent refused for lack of capacity (other
    routers hold it). An engine's 4xx is the client's error, not a rejection."""
    full = ForwardFailure(ErrorCode.AGENT_FULL, "no free slot")
    agent = make_peer("A")
    h = Harness(policy("max_tries: 1\n" + ANY), [agent], script={"A": [full]})
    served = await h.route()
    assert isinstance(served, Served)  # the one try was not used by the refusal
    assert (agent.stats.rejections, agent.stats.failures) == (1, 0)
    served.response.close()
    invalid = ForwardFailure(ErrorCode.INVALID_PARAMETER, "bad", status=400, body=b"{}")
    h.script["A"] = [invalid]
    with pytest.raises(BackendRejected):
        await h.dispatcher().dispatch(request())
    assert agent.stats.rejections == 1


async def test_recovery_is_once_per_agent_and_per_request(autojump_clock: Any) -> None:
    h = Harness(
        policy("max_tries: 2\n" + ANY, "name: again\nmax_tries: 1\n" + ANY),
        [make_peer("A"), make_peer("B")],
        script={"A": [disconnect()] * 3, "B": [disconnect()] * 2},
    )
    outcome = await h.route()
    assert isinstance(outcome, Exhausted)
    # A free, A try 1, B free, B try 2; in the next step A's recovery is already used.
    assert h.tried() == ["A", "A", "B", "B", "A"]
    assert h.metric("hivenet_router_agent_connection_resets_total") == 2
    # A new request gets its own free recovery.
    h.calls.clear()
    h.script = {"A": [disconnect()]}
    served = await h.route()
    assert isinstance(served, Served)
    assert h.tried() == ["A", "A"]
    assert h.metric("hivenet_router_agent_connection_resets_total") == 3
    served.response.close()


# --- atomic slot acquisition ------------------------------------------------------------


async def test_losing_the_race_for_the_last_slot_reselects_without_a_try(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = make_peer("A", capacity=1), make_peer("B", capacity=1)
    real_evaluate = session_module.evaluate
    evaluations = []

    def racing_evaluate(*args: Any) -> Any:
        ev = real_evaluate(*args)
        evaluations.append(ev.best.peer_id if ev.best else None)
        if len(evaluations) == 1:
            # Another request takes A's last slot between the choice and the acquisition.
            ev.best.active = ev.best.capacity
        return ev

    monkeypatch.setattr(session_module, "evaluate", racing_evaluate)
    h = Harness(policy("max_tries: 1\n" + ANY), [a, b], script={"B": [fail()]})
    outcome = await h.route()
    # The race cost no try: B still got the step's only one.
    assert evaluations[:2] == ["A", "B"]
    assert h.tried() == ["B"]
    assert isinstance(outcome, Exhausted)
    assert outcome.reason == "routing_policy: max_tries exhausted"
    assert (a.active, b.active) == (1, 0)


async def test_a_cancelled_forward_releases_its_slot(autojump_clock: Any) -> None:
    a = make_peer("A", capacity=1)
    h = Harness(policy(ANY), [a], script={"A": [trio.sleep_forever]})
    with trio.move_on_after(5) as scope:
        await h.route()
    assert scope.cancelled_caught
    assert a.active == 0


# --- the capacity queue ------------------------------------------------------------------


async def hold(h: Harness, served: list[Served], req: RouteRequest | None = None) -> None:
    outcome = await h.route(req)
    assert isinstance(outcome, Served), outcome
    served.append(outcome)


async def test_queue_serves_waiters_in_arrival_order(autojump_clock: Any) -> None:
    a = make_peer("A", capacity=1)
    h = Harness(policy(ANY), [a])
    served: list[Served] = []
    async with trio.open_nursery() as nursery:
        await hold(h, served)
        reqs = [request() for _ in range(4)]
        for req in reqs:
            nursery.start_soon(hold, h, served, req)
            await trio.testing.wait_all_tasks_blocked()
        assert h.queue.length(MODEL) == 4
        assert (
            h.metrics.registry.get_sample_value("hivenet_router_queue_depth", {"model": MODEL}) == 4
        )
        for n in range(4):
            await trio.sleep(1)
            served[n].response.close()  # one slot frees; the head of the queue takes it
            await trio.testing.wait_all_tasks_blocked()
            assert len(served) == n + 2
            assert a.active == 1
    assert [s.response.request_id for s in served[1:]] == [r.request_id for r in reqs]
    assert h.queue.length(MODEL) == 0
    served[-1].response.close()
    assert a.active == 0
    waited = sample_sum(h.metrics, "hivenet_router_queue_wait_seconds_sum", {"model": MODEL})
    assert waited == pytest.approx(1 + 2 + 3 + 4)
    # The router-overhead histogram leaves queue time out: each request knows its wait.
    assert [r.waited for r in reqs] == pytest.approx([1, 2, 3, 4])


async def test_a_waiter_reserves_no_agent_and_takes_whichever_frees(
    autojump_clock: Any,
) -> None:
    a, b = make_peer("A", capacity=1), make_peer("B", capacity=1)
    h = Harness(policy(ANY), [a, b])
    served: list[Served] = []
    async with trio.open_nursery() as nursery:
        await hold(h, served)
        await hold(h, served)
        nursery.start_soon(hold, h, served)
        await trio.testing.wait_all_tasks_blocked()
        assert (a.active, b.active) == (1, 1)  # waiting holds nothing
        assert h.calls and len(h.calls) == 2
        served[1].response.close()  # B frees first
    assert served[2].peer is b


async def test_a_release_re_evaluates_the_step_and_an_unusable_wait_advances(
    autojump_clock: Any,
) -> None:
    a = make_peer("A", capacity=1, region="EU")
    b = make_peer("B", capacity=1, region="US")
    h = Harness(policy("match: {region: EU}\n" + ANY, "name: anywhere\n" + ANY), [a, b])
    held: list[Served] = []
    await hold(h, held)  # A, primary
    assert session_module.try_acquire(b)  # B is busy with a request of its own
    held.append(Served(Answer(b, Slot(b, h.notify), "other"), b, 1, "anywhere"))
    outcomes: list[Served | Exhausted] = []

    async def waiter() -> None:
        outcomes.append(await h.route())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert h.queue.length(MODEL) == 1
        held[1].response.close()  # B frees, but B does not match the primary step
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == [] and h.queue.length(MODEL) == 1
        # A stops being usable: the wait can no longer end well, so the step gives up.
        a.healthy = False
        h.table.changed(MODEL)
    (outcome,) = outcomes
    assert isinstance(outcome, Served)
    assert outcome.peer is b and outcome.step_name == "anywhere"
    assert h.queue.length(MODEL) == 0


async def test_a_full_queue_advances_to_the_next_step(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a = make_peer("A", capacity=1, region="EU")
    b = make_peer("B", capacity=1, region="US")
    h = Harness(policy("match: {region: EU}\n" + ANY, "name: us\n" + ANY), [a, b], queue_depth=1)
    held: list[Served] = []
    await hold(h, held)
    assert held[0].peer is a
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, h, held)  # waits for A: the queue is now full
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
        overflow = await h.route()
        assert trio.current_time() == started  # did not wait
        assert isinstance(overflow, Served)
        assert overflow.peer is b and overflow.step_name == "us"
        assert any("queue_full step=routing_policy" in r.getMessage() for r in caplog.records)
        held[0].response.close()
    assert held[1].peer is a and held[1].step_index == 0


async def test_queue_depth_zero_disables_waiting(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = make_peer("A", capacity=1), make_peer("B", capacity=2, active=2)
    h = Harness(policy(ANY), [a, b], queue_depth=0)
    held: list[Served] = []
    await hold(h, held)
    req = request()
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(req)
    assert trio.current_time() == 0
    assert caught.value.code == ErrorCode.NO_CAPACITY
    assert caught.value.http_status == 503
    (line,) = exhausted_lines(caplog)
    assert line.endswith('tried=1/1 reason="routing_policy: gate[6] capacity [at_capacity=2]"')
    assert h.queue.length(MODEL) == 0


async def test_the_request_deadline_ends_the_wait_and_frees_the_place(
    autojump_clock: Any,
) -> None:
    a = make_peer("A", capacity=1)
    h = Harness(policy(ANY), [a], queue_depth=2)
    held: list[Served] = []
    await hold(h, held)
    gave_up: list[float] = []

    async def impatient() -> None:
        with trio.move_on_after(5):
            await h.route()
        gave_up.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(impatient)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, h, held)
        await trio.testing.wait_all_tasks_blocked()
        assert h.queue.length(MODEL) == 2
        await trio.sleep(10)
        assert gave_up == [5]
        assert h.queue.length(MODEL) == 1
        assert a.active == 1
        held[0].response.close()  # the patient one behind it is served
    assert len(held) == 2 and held[1].peer is a
    assert h.queue.length(MODEL) == 0
    held[1].response.close()
    assert a.active == 0


async def test_each_model_has_its_own_queue(autojump_clock: Any) -> None:
    m1 = make_peer("A", model="m", capacity=1)
    n1 = make_peer("B", model="n", capacity=1)
    h = Harness(policy(ANY), [m1, n1], queue_depth=1)
    held: list[Served] = []
    await hold(h, held, request("m"))
    await hold(h, held, request("n"))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, h, held, request("m"))
        await trio.testing.wait_all_tasks_blocked()
        # m's full queue takes nothing from n's depth.
        nursery.start_soon(hold, h, held, request("n"))
        await trio.testing.wait_all_tasks_blocked()
        assert (h.queue.length("m"), h.queue.length("n")) == (1, 1)
        held[0].response.close()  # m frees: only m's waiter moves
        await trio.testing.wait_all_tasks_blocked()
        assert len(held) == 3 and held[2].peer is m1
        assert h.queue.length("n") == 1
        held[1].response.close()
    assert held[3].peer is n1


async def test_waiting_and_fruitless_wake_ups_use_no_try(autojump_clock: Any) -> None:
    a = make_peer("A", capacity=1)
    h = Harness(policy("max_tries: 1\n" + ANY), [a])
    held: list[Served] = []
    await hold(h, held)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, h, held)
        for _ in range(5):
            await trio.sleep(1)
            h.table.changed(MODEL)  # a wake-up that frees nothing
            await trio.testing.wait_all_tasks_blocked()
            assert h.queue.length(MODEL) == 1
        held[0].response.close()
    assert len(held) == 2 and held[1].peer is a
    assert h.tried() == ["A", "A"]
    held[1].response.close()


# --- exhaustion --------------------------------------------------------------------------


async def test_exhaustion_line_has_the_seeds_shape(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    peers = [
        make_peer("A", kv_cache_utilization=0.95),
        make_peer("B", kv_cache_utilization=0.95),
    ]
    h = Harness(
        policy(
            "match: {engine: vllm}\n" + ANY,
            "name: a\nmax_tries: 1\n" + ANY,
            "name: b\nexclude_if:\n  kv_cache_utilization: {gt: 0.85}\n" + ANY,
        ),
        peers,
        script={"A": [fail()]},
    )
    req = request()
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(req)
    (line,) = exhausted_lines(caplog)
    assert line == (
        f'req={req.request_id} model="m" capability="llm" tenant=t policy_exhausted '
        "chain=[routing_policy→a→b] tried=3/3 "
        'reason="routing_policy: gate[4] match [engine(got=\\"sim\\",want=\\"vllm\\")=2]'
        ' | a: max_tries exhausted | b: gate[7] exclude_if [kv_cache_utilization=2]"'
    )
    (record,) = [r for r in caplog.records if "policy_exhausted" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.name == "policy"
    # A backend failure was the last thing that went wrong: the client hears of it.
    assert caught.value.code == ErrorCode.BACKEND_UNAVAILABLE
    assert h.counters() == counters(exhausted=1)


async def test_no_exhaustion_line_when_a_later_step_serves(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness(
        policy("match: {engine: vllm}\n" + ANY, "name: a\nmax_tries: 1\n" + ANY, "name: b\n" + ANY),
        [make_peer("A"), make_peer("B")],
        script={"A": [fail()]},
    )
    d = h.dispatcher()
    served = await d.dispatch(request())
    assert isinstance(served, Served) and served.step_name == "b"
    served.response.close()
    served = await d.dispatch(request())  # A's failure belonged to the other request
    assert isinstance(served, Served) and served.step_name == "a"
    served.response.close()
    assert exhausted_lines(caplog) == []
    assert h.counters() == counters(routed=2, fallback=2)


async def test_counters_primary_fallback_routed_exhausted(autojump_clock: Any) -> None:
    eu = make_peer("A", capacity=1, region="EU")
    h = Harness(policy("match: {region: EU}\n" + ANY, "name: any\n" + ANY), [eu], queue_depth=0)
    d = h.dispatcher()
    first = await d.dispatch(request())
    assert isinstance(first, Served) and first.step_index == 0
    eu.healthy = False
    with pytest.raises(RouterError):
        await d.dispatch(request())
    eu.healthy = True
    us = make_peer("B", region="US")
    h.table.add(us)
    second = await d.dispatch(request())  # A is full; B serves from the fallback
    assert isinstance(second, Served) and second.peer is us
    assert h.counters() == counters(routed=2, primary=1, fallback=1, exhausted=1)
    # Counters are per model.
    assert h.metric("hivenet_router_routing_requests_routed_total", model="other") == 0


async def test_the_client_error_after_exhaustion(autojump_clock: Any) -> None:
    # Nothing matched: no agents available.
    h = Harness(policy("match: {engine: vllm}\n" + ANY), [make_peer("A")], queue_depth=0)
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(request())
    assert caught.value.code == ErrorCode.NO_AGENTS_AVAILABLE
    assert "gate[4] match" in caught.value.message
    # Agents that would match but are full: no capacity.
    h = Harness(policy(ANY), [make_peer("A", capacity=1, active=1)], queue_depth=0)
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(request())
    assert caught.value.code == ErrorCode.NO_CAPACITY
    # Forwards failed: the last backend failure.
    h = Harness(
        policy(ANY),
        [make_peer("A"), make_peer("B")],
        script={"A": [fail()], "B": [fail(ErrorCode.BACKEND_ERROR)]},
    )
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(request())
    assert caught.value.code == ErrorCode.BACKEND_ERROR
    assert caught.value.http_status == 502


async def test_an_unknown_model_drains_every_step_at_gate_1(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness(policy(ANY, "name: a\n" + ANY, "name: b\n" + ANY), [make_peer("A")])
    req = request(model="nobody-serves-this")
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(req)
    assert caught.value.code == ErrorCode.MODEL_NOT_FOUND
    (line,) = exhausted_lines(caplog)
    # The seeds: the router advances to the next step when no agent is registered for
    # the model; each step says so, in upstream's words.
    drained = "gate[1] model_filter [model_not_registered]"
    assert line.endswith(
        f'chain=[routing_policy→a→b] tried=3/3 reason="routing_policy: {drained} | a: {drained}'
        f' | b: {drained}"'
    )
    # The log names the client's model; the metric does not make it a series of its own.
    assert 'model="nobody-serves-this"' in line
    assert h.metric("hivenet_router_policy_exhausted_total", model=req.model) == 0
    assert h.metric("hivenet_router_policy_exhausted_total", model=UNREGISTERED_MODEL) == 1


async def test_a_model_whose_agents_all_left_keeps_its_name_in_the_metrics(
    autojump_clock: Any,
) -> None:
    agent = make_peer("A")
    h = Harness(policy(ANY), [agent])
    h.table.remove(agent)
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(request())
    assert caught.value.code == ErrorCode.MODEL_NOT_FOUND
    assert h.metric("hivenet_router_policy_exhausted_total", model=MODEL) == 1
    assert h.metric("hivenet_router_policy_exhausted_total", model=UNREGISTERED_MODEL) == 0


async def test_a_pool_the_request_itself_emptied_is_no_agents_not_unregistered(
    autojump_clock: Any,
) -> None:
    """The model has an agent, but the request leaves it out (a continuation's tried
    agents, the engines an endpoint needs): gate 1 says `no_agents`."""
    h = Harness(policy(ANY), [make_peer("A")])
    req = request()
    req.exclude = frozenset({"A"})
    outcome = await h.route(req)
    assert isinstance(outcome, Exhausted)
    assert outcome.reason == "routing_policy: gate[1] model_filter [no_agents]"


async def test_the_wrong_capability_drains_every_step(autojump_clock: Any) -> None:
    h = Harness(policy(ANY, "name: a\n" + ANY), [make_peer("A")])
    outcome = await h.route(request(capability="embedding", path="/v1/embeddings"))
    assert isinstance(outcome, Exhausted)
    assert outcome.steps_tried == 2
    assert outcome.reason == (
        'routing_policy: gate[3] capability [capability(got="llm",want="embedding")=1]'
        ' | a: gate[3] capability [capability(got="llm",want="embedding")=1]'
    )
    assert outcome.error.code == ErrorCode.NO_AGENTS_AVAILABLE


def test_the_exhaustion_line_cannot_be_split_by_a_model_name() -> None:
    req = request(model='evil"\nreq=forged policy_exhausted')
    ex = Exhausted(RouterError(ErrorCode.NO_AGENTS_AVAILABLE, "x"), "s: r", ["s"], 1)
    line = exhaustion_line(req, ex)
    assert "\n" not in line
    assert 'model="evil\\"\\nreq=forged policy_exhausted"' in line


# --- the provider hook -------------------------------------------------------------------

PROVIDER = "\nfallback_provider:\n  engine: openai\n  model: gpt-4o-mini\n"


async def test_provider_serves_after_the_chain_and_exhaustion_is_not_counted(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = Harness(policy("match: {engine: vllm}\n" + ANY) + PROVIDER, [make_peer("A")])
    seen: list[tuple[ProviderFallback, RouteRequest]] = []

    async def provider_call(provider: ProviderFallback, req: RouteRequest) -> ProviderServed:
        seen.append((provider, req))
        return ProviderServed(200, "application/json", b"{}", provider.engine)

    d = h.dispatcher(provider_call=provider_call, provider_available=lambda engine: True)
    served = await d.dispatch(request())
    assert isinstance(served, ProviderServed)
    assert seen[0][0].model == "gpt-4o-mini"
    assert len(exhausted_lines(caplog)) == 1  # the local chain was still exhausted
    assert h.counters() == counters(provider=1)
    # Not for embeddings.
    with pytest.raises(RouterError):
        await d.dispatch(request(capability="embedding", path="/v1/embeddings"))
    assert len(seen) == 1
    assert h.counters() == counters(provider=1, exhausted=1)


async def test_a_failed_or_timed_out_provider_counts_as_exhausted(autojump_clock: Any) -> None:
    h = Harness(policy("match: {engine: vllm}\n" + ANY) + PROVIDER, [make_peer("A")])

    async def refusing(provider: ProviderFallback, req: RouteRequest) -> ProviderServed:
        raise RouterError(ErrorCode.BACKEND_ERROR, "provider said 500", "backend")

    d = h.dispatcher(provider_call=refusing, provider_available=lambda engine: True)
    with pytest.raises(RouterError):
        await d.dispatch(request())
    assert h.counters() == counters(exhausted=1)

    async def slow(provider: ProviderFallback, req: RouteRequest) -> ProviderServed:
        await trio.sleep(100)
        raise AssertionError("unreachable")

    d = h.dispatcher(provider_call=slow, provider_available=lambda engine: True)
    with trio.move_on_after(5):
        await d.dispatch(request())
    assert h.counters() == counters(exhausted=2)


async def test_a_reload_while_routing_leaves_the_requests_provider_as_it_started(
    autojump_clock: Any,
) -> None:
    # Upstream: in-flight requests keep the policy snapshot they started with.
    h = Harness(policy(ANY) + PROVIDER, [make_peer("A")])
    newer = policy(ANY) + PROVIDER.replace("gpt-4o-mini", "gpt-newer")

    async def reload_then_fail() -> ForwardFailure:
        assert h.store.replace(newer, "test") == []
        return fail()

    h.script["A"] = [reload_then_fail, fail()]
    seen: list[str] = []

    async def provider_call(provider: ProviderFallback, req: RouteRequest) -> ProviderServed:
        seen.append(provider.model)
        return ProviderServed(200, "application/json", b"{}", provider.engine)

    d = h.dispatcher(provider_call=provider_call, provider_available=lambda engine: True)
    await d.dispatch(request())
    await d.dispatch(request())
    assert seen == ["gpt-4o-mini", "gpt-newer"]


async def test_a_broken_streams_continuation_follows_the_policy_its_request_started_with(
    autojump_clock: Any,
) -> None:
    h = Harness(policy(ANY), [make_peer("A"), make_peer("B")])
    d = h.dispatcher()
    continuer = StreamContinuer(d, h.table, h.metrics)
    req = request()
    served = await d.dispatch(req)
    assert isinstance(served, Served)
    served.response.close()
    # Reloaded while the stream ran: no agent for the model, and no continuation.
    newer = policy("match: {engine: vllm}\n" + ANY) + "stream_continuation: false\n"
    assert h.store.replace(newer, "test") == []
    assert continuer.enabled(req) and not continuer.enabled(request())
    again = dataclasses.replace(req, exclude=frozenset({served.peer.peer_id}))
    continued = await d.continuation(again)
    assert continued is not None and continued.peer.peer_id != served.peer.peer_id
    continued.response.close()
    assert await d.continuation(request()) is None


async def test_a_provider_without_its_key_is_skipped(autojump_clock: Any) -> None:
    h = Harness(policy("match: {engine: vllm}\n" + ANY) + PROVIDER, [make_peer("A")])

    async def never(provider: ProviderFallback, req: RouteRequest) -> ProviderServed:
        raise AssertionError("called without a key")

    d = h.dispatcher(provider_call=never, provider_available=lambda engine: False)
    with pytest.raises(RouterError) as caught:
        await d.dispatch(request())
    assert caught.value.code == ErrorCode.NO_AGENTS_AVAILABLE


# --- what counts against an agent, and the breaker over its history gates ----------------

# The seeds' "protect response quality" step (configs/policies/protect-response-quality.yaml).
PROTECT = """
match: {}
exclude_if:
  success_rate: {lt: 0.95}
  consecutive_failures: {gte: 3}
strategy: least-loaded
max_tries: 1
"""
COOLDOWN = session_module.DEFAULT_FAILURE_COOLDOWN


def history(peer: Peer) -> tuple[int, int, int]:
    s = peer.stats
    return s.successes, s.failures, s.consecutive_failures


@pytest.mark.parametrize(
    "code",
    [ErrorCode.INVALID_PARAMETER, ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.REQUEST_INVALID],
)
async def test_client_errors_never_count_against_the_agent(
    autojump_clock: Any, code: ErrorCode
) -> None:
    a = make_peer("A")
    rejection = ForwardFailure(code, "the engine refused the request", status=400)
    h = Harness(policy(PROTECT), [a], script={"A": [rejection] * 5})
    for _ in range(5):
        with pytest.raises(BackendRejected):
            await h.route()
    assert history(a) == (0, 0, 0)
    assert isinstance(await h.route(), Served)
    assert history(a) == (1, 0, 0)


async def test_agent_failures_are_counted_once_and_a_broken_link_not_at_all(
    autojump_clock: Any,
) -> None:
    a = make_peer("A")
    h = Harness(
        policy("max_tries: 3\n" + ANY),
        [a],
        script={"A": [fail(ErrorCode.BACKEND_ERROR), disconnect(), disconnect()]},
    )
    assert isinstance(await h.route(), Exhausted)  # backend_error: the one agent is spent
    assert history(a) == (0, 1, 1)
    # A free recovery, then a second disconnect: a try, but not the agent's failure.
    assert isinstance(await h.route(), Exhausted)
    assert history(a) == (0, 1, 1)
    assert isinstance(await h.route(), Served)
    assert history(a) == (1, 1, 0)


async def trip(h: Harness, peer: Peer) -> None:
    """Three charged failures in a row after 97 successes: success_rate 0.97 passes, and
    consecutive_failures 3 excludes the agent (the seeds' sudden-instability case)."""
    peer.stats.successes = 97
    h.script[peer.peer_id] = [fail(ErrorCode.BACKEND_ERROR)] * 3
    for _ in range(3):
        assert isinstance(await h.route(), Exhausted)
    assert history(peer) == (97, 3, 3)


async def test_an_agent_locked_out_by_failures_is_probed_after_the_cool_down(
    autojump_clock: Any,
) -> None:
    a = make_peer("A")
    h = Harness(policy(PROTECT), [a])
    await trip(h, a)
    await trio.sleep(COOLDOWN - 1)
    locked = await h.route()
    assert isinstance(locked, Exhausted)
    assert "gate[7] exclude_if [consecutive_failures=1]" in locked.reason
    assert len(h.calls) == 3  # excluded: not asked
    await trio.sleep(1)
    # Half-open: one request may go despite three failures in a row; it closes the breaker.
    assert isinstance(await h.route(), Served)
    assert history(a) == (98, 3, 0)
    for _ in range(3):
        assert isinstance(await h.route(), Served)
    assert len(h.calls) == 7


async def test_a_low_success_rate_is_probed_too_and_closed_until_the_next_failure(
    autojump_clock: Any,
) -> None:
    a = make_peer("A")
    h = Harness(policy(PROTECT), [a], script={"A": [fail(ErrorCode.BACKEND_ERROR)]})
    assert isinstance(await h.route(), Exhausted)
    locked = await h.route()  # success_rate 0 < 0.95
    assert isinstance(locked, Exhausted)
    assert "gate[7] exclude_if [success_rate=1]" in locked.reason
    await trio.sleep(COOLDOWN)
    assert isinstance(await h.route(), Served)  # the probe
    # Closed: the lifetime rate is 0.5, but the history gates wait for the next failure.
    for _ in range(3):
        assert isinstance(await h.route(), Served)
    assert history(a) == (4, 1, 0)
    h.script["A"] = [fail(ErrorCode.BACKEND_ERROR)]
    assert isinstance(await h.route(), Exhausted)
    # success_rate 4/6 < 0.95 again: open for a new cool-down, then probed.
    assert isinstance(await h.route(), Exhausted)
    await trio.sleep(COOLDOWN - 1)
    assert isinstance(await h.route(), Exhausted)
    await trio.sleep(1)
    assert isinstance(await h.route(), Served)
    assert len(h.calls) == 7


async def test_a_failed_probe_reopens_the_breaker_for_another_cool_down(
    autojump_clock: Any,
) -> None:
    a = make_peer("A")
    h = Harness(policy(PROTECT), [a])
    await trip(h, a)
    await trio.sleep(COOLDOWN)
    h.script["A"] = [fail(ErrorCode.BACKEND_UNAVAILABLE)]
    assert isinstance(await h.route(), Exhausted)  # the probe, failed
    assert history(a) == (97, 4, 4)
    await trio.sleep(COOLDOWN - 1)
    assert isinstance(await h.route(), Exhausted)
    assert len(h.calls) == 4
    await trio.sleep(1)
    assert isinstance(await h.route(), Served)
    assert history(a) == (98, 4, 0)


async def test_one_probe_at_a_time_and_the_others_go_elsewhere(autojump_clock: Any) -> None:
    a, b = make_peer("A"), make_peer("B")
    h = Harness(policy(PROTECT), [a])
    await trip(h, a)
    h.table.add(b)
    await trio.sleep(COOLDOWN)
    probe_started = trio.Event()
    release = trio.Event()

    async def slow_answer() -> None:
        probe_started.set()
        await release.wait()

    h.script["A"] = [slow_answer]
    served: list[Served] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, h, served)
        await probe_started.wait()
        # A is least loaded and first by peer ID, but only its probe may run.
        for _ in range(3):
            await hold(h, served)
        assert [s.peer.peer_id for s in served] == ["B", "B", "B"]
        release.set()
    assert [s.peer.peer_id for s in served] == ["B", "B", "B", "A"]
    assert history(a) == (98, 3, 0)


@pytest.mark.parametrize("ending", ["client_error", "cancelled", "disconnect"])
async def test_a_probe_that_says_nothing_of_the_agent_leaves_it_half_open(
    autojump_clock: Any, ending: str
) -> None:
    a = make_peer("A")
    h = Harness(policy(PROTECT), [a])
    await trip(h, a)
    await trio.sleep(COOLDOWN)
    if ending == "client_error":
        h.script["A"] = [ForwardFailure(ErrorCode.INVALID_PARAMETER, "bad", status=400)]
        with pytest.raises(BackendRejected):
            await h.route()
    elif ending == "cancelled":
        h.script["A"] = [trio.sleep_forever]
        with trio.move_on_after(5):
            await h.route()
    else:
        # The free recovery re-selects A as the probe again, then the try fails uncharged.
        h.script["A"] = [disconnect(), disconnect()]
        assert isinstance(await h.route(), Exhausted)
    assert history(a) == (97, 3, 3)
    assert isinstance(await h.route(), Served)  # probed again at once: no new cool-down
    assert history(a) == (98, 3, 0)


async def test_admin_health_is_healthy_while_any_agent_is() -> None:
    """Upstream's `/admin/health` rule: `healthy` when at least one agent is healthy,
    `degraded` when none is (no agents at all included)."""
    table, queue = PeerTable(), WaitQueue(30)
    assert admin.health(table, queue)["status"] == "degraded"
    sick, well = make_peer("A"), make_peer("B")
    sick.backend_healthy = False
    table.add(sick)
    assert admin.health(table, queue)["status"] == "degraded"
    table.add(well)
    view = admin.health(table, queue)
    assert (view["status"], view["total_agents"], view["healthy_agents"]) == ("healthy", 2, 1)
