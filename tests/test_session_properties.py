"""Property: random interleavings of requests through the routing session keep its promises.

Hypothesis draws a small fleet (capacities 1-3, two regions), a policy chain of one to
three steps (some shedding low priorities when the queue is long), a queue depth (0
disables it), agents going unhealthy and back, and requests of priorities 0-2 that
arrive, time out or are abandoned by their client while each forward succeeds, fails,
disconnects, is rejected, is slow or hangs. Everything runs in one
trio nursery under a MockClock, so a scenario of minutes of virtual time takes
milliseconds. Whatever the draw:

- no agent ever holds more requests than its declared capacity;
- every slot is released once all requests are over, and the queue is empty;
- every request ends exactly once (served, rejected, exhausted, shed or cancelled),
  never twice and never hanging; a shed request was selected by its step's shed_if;
- within one step, an agent that failed is never tried again; a step never spends more
  tries than its budget; only the first disconnect per agent and request is free;
- a request-level rejection or a success is the last forward of its request;
- no request sleeps in the capacity queue while its current step has a usable agent
  (checked whenever the fleet is quiet after a slot was released or an agent's
  health changed: the queue's wake-ups reach every waiter, whatever the priorities);
- the queue is in priority order, first come first served within a priority;
- the dispatcher's counters agree with the outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.errors import ErrorCode, RouterError
from router.capacity import WaitQueue
from router.dispatch import Dispatcher
from router.metrics import RouterMetrics
from router.peers import AgentMetadata, Peer, PeerTable
from router.policy.gates import evaluate
from router.policy.schema import Step
from router.policy.store import PolicyStore
from router.session import (
    BackendRejected,
    ForwardFailure,
    RouteRequest,
    RoutingSession,
    Served,
    Slot,
)
from tests.test_session import sample_sum

MODEL = "m"
REGIONS = ("EU", "US")
DEFAULT_MAX_TRIES = 2
# Virtual seconds after which a scenario that has not finished counts as hung.
HUNG_AFTER = 100_000.0
HANG = 1_000  # a forward that "hangs" answers after this long, if nobody gave up before

# --- what hypothesis draws ---------------------------------------------------------------

behaviours = st.one_of(
    st.tuples(st.just("ok"), st.integers(0, 8)),  # served; the client reads for n s
    st.tuples(
        st.just("fail"), st.sampled_from([ErrorCode.BACKEND_UNAVAILABLE, ErrorCode.BACKEND_ERROR])
    ),
    st.tuples(st.just("disconnect"), st.none()),
    st.tuples(
        st.just("reject"),
        st.sampled_from([ErrorCode.INVALID_PARAMETER, ErrorCode.CONTEXT_LENGTH_EXCEEDED]),
    ),
    st.tuples(st.just("slow"), st.integers(1, 6)),  # the answer takes n s, then ok
    st.tuples(st.just("hang"), st.none()),
)

requests = st.fixed_dictionaries(
    {
        "start": st.integers(0, 4),
        "deadline": st.none() | st.integers(1, 20),
        "abandon_after": st.none() | st.integers(0, 20),
        "calls": st.lists(behaviours, max_size=8),
        "priority": st.integers(0, 2),
    }
)

steps = st.fixed_dictionaries(
    {
        "region": st.sampled_from(("", *REGIONS)),
        "max_tries": st.integers(0, 3),
        # Shed priority 0 once this many requests wait for the model; None: no shed_if.
        "shed_at": st.none() | st.integers(1, 3),
    }
)

scenarios = st.fixed_dictionaries(
    {
        "agents": st.lists(
            st.tuples(st.integers(1, 3), st.sampled_from(REGIONS)), min_size=1, max_size=4
        ),
        "steps": st.lists(steps, min_size=1, max_size=3),
        "queue_depth": st.integers(0, 3),
        "health": st.lists(
            st.tuples(st.integers(0, 15), st.integers(0, 3), st.booleans()), max_size=4
        ),
        "requests": st.lists(requests, min_size=1, max_size=12),
    }
)


def policy_text(drawn: list[dict]) -> str:
    def body(step: dict, indent: str) -> str:
        match = f"{{region: {step['region']}}}" if step["region"] else "{}"
        text = (
            f"{indent}match: {match}\n{indent}strategy: least-loaded\n"
            f"{indent}max_tries: {step['max_tries']}\n"
        )
        if step["shed_at"] is not None:
            text += (
                f"{indent}shed_if:\n{indent}  priority: {{lt: 1}}\n"
                f"{indent}  model_queue_depth: {{gte: {step['shed_at']}}}\n"
            )
        return text

    primary, *chain = drawn
    text = "routing_policy:\n" + body(primary, "  ")
    if chain:
        text += "fallback_chain:\n"
        for i, step in enumerate(chain):
            text += f"  - name: step{i + 1}\n" + body(step, "    ")
    return text


# --- the world one scenario runs in ------------------------------------------------------


@dataclass
class Call:
    step: int
    peer_id: str
    kind: str


@dataclass
class World:
    scenario: dict
    peers: list[Peer] = field(default_factory=list)
    calls: dict[str, list[Call]] = field(default_factory=dict)
    step_of: dict[str, int] = field(default_factory=dict)
    scripts: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)
    outcomes: dict[str, list[str]] = field(default_factory=dict)
    # Slots held per agent, counted here independently of Peer.active.
    holding: dict[str, int] = field(default_factory=dict)
    in_forward: set[str] = field(default_factory=set)
    quiet_checks: int = 0

    def __post_init__(self) -> None:
        self.metrics = RouterMetrics()
        self.table = PeerTable()
        self.queue = WaitQueue(self.scenario["queue_depth"])
        self.table.on_change(self.queue.notify)
        for i, (capacity, region) in enumerate(self.scenario["agents"]):
            peer = Peer(
                peer_id=f"agent{i}",
                metadata=AgentMetadata(
                    model=MODEL, capability="llm", engine="sim", capacity=capacity, region=region
                ),
                send=_send,
                connected_at=0.0,
                last_seen=0.0,
            )
            self.peers.append(peer)
            self.holding[peer.peer_id] = 0
            self.table.add(peer)
        world = self

        class TracingSession(RoutingSession):
            async def _run_step(self, index: int, step: Step, req: RouteRequest, *rest: Any):
                world.step_of[req.request_id] = index
                return await super()._run_step(index, step, req, *rest)

        self.session = TracingSession(
            self.table,
            self.queue,
            self.metrics,
            self.forward,
            DEFAULT_MAX_TRIES,
            self.released,
        )
        self.store = PolicyStore(self.metrics)
        assert self.store.replace(policy_text(self.scenario["steps"]), "test") == []
        self.dispatcher = Dispatcher(self.table, self.session, self.store, self.metrics)
        self.changed = trio.Event()

    def released(self, peer: Peer) -> None:
        self.queue.notify(peer.metadata.model)
        self.changed.set()

    async def forward(self, peer: Peer, req: RouteRequest, slot: Slot) -> object:
        pid = peer.peer_id
        assert slot.peer is peer and not slot.released
        self.holding[pid] += 1
        # The capacity promise, and the session's count agrees with ours.
        assert self.holding[pid] <= peer.capacity, (pid, self.holding[pid], peer.capacity)
        assert peer.active == self.holding[pid]
        assert peer.routable, "forwarded to an agent the health gate removes"
        script = self.scripts[req.request_id]
        kind, arg = script.pop(0) if script else ("ok", 0)
        self.calls[req.request_id].append(Call(self.step_of[req.request_id], pid, kind))
        success = False
        self.in_forward.add(req.request_id)
        try:
            if kind == "fail":
                return ForwardFailure(arg, "simulated failure")
            if kind == "disconnect":
                return ForwardFailure(
                    ErrorCode.AGENT_DISCONNECTED, "stale session", connection_level=True
                )
            if kind == "reject":
                return ForwardFailure(arg, "bad request", status=400)
            if kind == "slow":
                await trio.sleep(arg)
            elif kind == "hang":
                await trio.sleep(HANG)
            success = True
            return _Held(self, slot, pid, arg if kind == "ok" else 0)
        finally:
            self.in_forward.discard(req.request_id)
            if not success:
                self.holding[pid] -= 1

    def end(self, rid: str, how: str) -> None:
        self.outcomes[rid].append(how)

    async def client(self, index: int, spec: dict, nursery: trio.Nursery) -> None:
        await trio.sleep(spec["start"])
        rid = f"req{index}"
        self.calls[rid] = []
        self.scripts[rid] = list(spec["calls"])
        self.outcomes[rid] = []
        req = RouteRequest(
            rid,
            MODEL,
            "llm",
            "t",
            "POST",
            "/v1/chat/completions",
            {},
            b"{}",
            False,
            priority=spec["priority"],
        )
        with trio.CancelScope() as scope:
            if spec["deadline"] is not None:
                scope.deadline = trio.current_time() + spec["deadline"]
            if spec["abandon_after"] is not None:
                nursery.start_soon(_abandon, scope, spec["abandon_after"])
            try:
                served = await self.dispatcher.dispatch(req)
            except BackendRejected:
                self.end(rid, "rejected")
                return
            except RouterError as err:
                if err.code == ErrorCode.LOAD_SHED:
                    assert spec["priority"] == 0, "shed_if selected a priority it does not name"
                    assert err.retry_after == 1
                    self.end(rid, "shed")
                    return
                self.end(rid, "exhausted")
                return
            assert isinstance(served, Served)
            self.end(rid, "served")
            held = served.response
            assert isinstance(held, _Held)
            # The HTTP layer relays the answer, then closes it, whatever happens.
            try:
                await trio.sleep(held.read_for)
            finally:
                held.close()
        if scope.cancelled_caught and not self.outcomes[rid]:
            self.end(rid, "cancelled")

    async def flip_health(self, at: int, index: int, healthy: bool) -> None:
        await trio.sleep(at)
        peer = self.peers[index % len(self.peers)]
        peer.healthy = healthy
        self.table.changed(MODEL)
        self.changed.set()

    async def watch_waiters(self) -> None:
        """Whenever the fleet goes quiet after a change, no waiter may have a usable agent."""
        steps = self.store.current.steps
        while True:
            await self.changed.wait()
            await trio.testing.wait_all_tasks_blocked()
            self.changed = trio.Event()
            self.quiet_checks += 1
            waiting = self.queue._waiters.get(MODEL, [])
            ranks = [-w.priority for w in waiting]
            assert ranks == sorted(ranks), "the queue is out of priority order"
            for rid, ends in self.outcomes.items():
                if ends or rid in self.in_forward:
                    continue  # over, or not waiting: forwarding
                step = self.step_of.get(rid)
                if step is None:
                    continue
                failed = failed_in_step(self.calls[rid], step)
                pool = self.table.for_model(MODEL)
                ev = evaluate(pool, steps[step], "llm", failed, trio.current_time())
                assert ev.best is None, (
                    f"request {rid} sleeps in step {step} while {ev.best.peer_id} is usable"
                )

    async def run(self) -> None:
        with trio.fail_after(HUNG_AFTER):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.watch_waiters)
                for at, index, healthy in self.scenario["health"]:
                    nursery.start_soon(self.flip_health, at, index, healthy)
                async with trio.open_nursery() as clients:
                    for index, spec in enumerate(self.scenario["requests"]):
                        clients.start_soon(self.client, index, spec, clients)
                nursery.cancel_scope.cancel()  # health flips still pending do not matter


class _Held:
    """A served answer as the HTTP layer sees it: read for a while, then closed."""

    def __init__(self, world: World, slot: Slot, peer_id: str, read_for: float) -> None:
        self.world = world
        self.slot = slot
        self.peer_id = peer_id
        self.read_for = read_for
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.world.holding[self.peer_id] -= 1
        self.slot.release()


async def _abandon(scope: trio.CancelScope, after: int) -> None:
    await trio.sleep(after)
    scope.cancel()


async def _send(message: dict) -> None:
    del message


def failed_in_step(calls: list[Call], step: int) -> set[str]:
    """The agents gate 5 removes in `step`, replayed from the request's forwards."""
    failed: set[str] = set()
    recovered: set[str] = set()
    for call in calls:
        consumed = call.kind == "fail" or (call.kind == "disconnect" and call.peer_id in recovered)
        if call.kind == "disconnect":
            recovered.add(call.peer_id)
        if consumed and call.step == step:
            failed.add(call.peer_id)
    return failed


# --- the checks --------------------------------------------------------------------------


def check(world: World) -> None:
    scenario = world.scenario
    assert len(world.outcomes) == len(scenario["requests"]), "a request never started"
    for rid, outcome in world.outcomes.items():
        assert len(outcome) == 1, f"request {rid} ended {outcome}"
    # Every slot back, nobody left in the queue.
    assert [p.active for p in world.peers] == [0] * len(world.peers)
    assert all(n == 0 for n in world.holding.values())
    assert world.queue.lengths() == {}
    assert world.metrics.registry.get_sample_value(
        "hivenet_router_queue_depth", {"model": MODEL}
    ) in (None, 0.0)

    policy = world.store.current
    budgets = [step.budget(DEFAULT_MAX_TRIES) for step in policy.steps]
    for rid, calls in world.calls.items():
        (outcome,) = world.outcomes[rid]
        failed: dict[int, set[str]] = {}
        tries: dict[int, int] = {}
        recovered: set[str] = set()
        steps_seen = [c.step for c in calls]
        assert steps_seen == sorted(steps_seen), "steps run in chain order"
        for i, call in enumerate(calls):
            in_step = failed.setdefault(call.step, set())
            assert call.peer_id not in in_step, f"{call.peer_id} retried in step {call.step}"
            last = i == len(calls) - 1
            if call.kind == "fail" or (call.kind == "disconnect" and call.peer_id in recovered):
                in_step.add(call.peer_id)
                tries[call.step] = tries.get(call.step, 0) + 1
                assert tries[call.step] <= budgets[call.step]
            elif call.kind == "disconnect":
                recovered.add(call.peer_id)
            elif call.kind == "reject":
                assert last and outcome in ("rejected", "cancelled")
            else:  # ok, slow, hang: answered, or cut short while answering
                assert last and outcome in ("served", "cancelled")
        if outcome == "served":
            assert calls and calls[-1].kind in ("ok", "slow", "hang")
        if outcome == "rejected":
            assert calls and calls[-1].kind == "reject"

    def total(name: str) -> float:
        return sample_sum(world.metrics, name, {"model": MODEL})

    served = sum(1 for (o,) in world.outcomes.values() if o == "served")
    exhausted = sum(1 for (o,) in world.outcomes.values() if o == "exhausted")
    routed = total("hivenet_router_routing_requests_routed_total")
    assert routed == served
    assert (
        total("hivenet_router_policy_primary_routed_total")
        + total("hivenet_router_policy_fallback_routed_total")
        == routed
    )
    assert total("hivenet_router_policy_exhausted_total") == exhausted
    shed = sum(1 for (o,) in world.outcomes.values() if o == "shed")
    assert total("hivenet_router_policy_shed_total") == shed


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario=scenarios)
def test_routing_session_keeps_its_promises_under_any_interleaving(scenario: dict) -> None:
    world = World(scenario)
    trio.run(world.run, clock=trio.testing.MockClock(autojump_threshold=0))
    waits = sample_sum(world.metrics, "hivenet_router_queue_wait_seconds_count", {"model": MODEL})
    event(f"queued: {bool(waits)}")
    event(f"quiet checks: {min(world.quiet_checks, 5)}{'+' if world.quiet_checks > 5 else ''}")
    for outcome in sorted({how for ends in world.outcomes.values() for how in ends}):
        event(f"outcome: {outcome}")
    check(world)
