"""Admission control and priorities in the routing core, with plain objects.

`shed_if` (schema, load values, where the session checks it, what the client and the
logs get) and the capacity queue's priority order, FIFO within a priority, and the
eviction of the lowest priority from a full queue.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from protocol.errors import ErrorCode, RouterError
from router.capacity import WaitQueue
from router.http.client import TICKET, ClientApi, ClientSettings
from router.metrics import RouterMetrics
from router.policy.admission import load_value, shed
from router.policy.describe import describe, policy_warnings
from router.policy.schema import PolicyError, Rule, Shed, load_policy
from router.session import Exhausted, LoadShed, Served, _QueuePlace
from tests.test_session import MODEL, Harness, fail, hold, make_peer, policy, request

# --- schema ------------------------------------------------------------------------------


def test_shed_if_loads_with_its_selectors_in_policy_order() -> None:
    loaded = load_policy(
        "routing_policy:\n  strategy: least-loaded\n  shed_if:\n"
        "    total_queue_depth: {gt: 40}\n    tenants: [batch, evals]\n"
        "    model_queue_depth: {gte: 2}\n    priority: {lt: 5}\n    retry_after: 7\n"
    )
    assert loaded.routing_policy.shed_if == Shed(
        rules=(Rule("total_queue_depth", "gt", 40.0), Rule("model_queue_depth", "gte", 2.0)),
        tenants=("batch", "evals"),
        priority=Rule("priority", "lt", 5.0),
        retry_after=7,
    )


def test_a_step_without_shed_if_is_unchanged() -> None:
    step = load_policy("routing_policy:\n  strategy: least-loaded\n").routing_policy
    assert step.shed_if is None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("shed_if: []", "routing_policy.shed_if: must be a mapping of load fields"),
        ("shed_if: {}", "routing_policy.shed_if: needs at least one load condition"),
        (
            "shed_if: {model_queue_depth: {gte: 1}, tenant: batch}",
            "routing_policy.shed_if.tenant: unknown shed_if key",
        ),
        (
            "shed_if: {model_queue_depth: {gte: 1}, tenants: [batch, '']}",
            "routing_policy.shed_if.tenants[1]: must be a non-empty string",
        ),
        (
            "shed_if: {model_queue_depth: {gte: 1}, retry_after: true}",
            "routing_policy.shed_if.retry_after: must be whole seconds",
        ),
        (
            "shed_if: {model_queue_depth: {gte: 1}, retry_after: 3601}",
            "routing_policy.shed_if.retry_after: must be whole seconds from 0 to 3600",
        ),
        (
            "shed_if: {model_queue_depth: {above: 1}}",
            "routing_policy.shed_if.model_queue_depth.above: unknown operator",
        ),
        (
            "shed_if: {model_capacity_utilization: {gte: .inf}}",
            "routing_policy.shed_if.model_capacity_utilization.gte: threshold must be a finite",
        ),
        (
            "shed_if: {model_queue_depth: {gte: 1}, priority: {lt: high}}",
            "routing_policy.shed_if.priority.lt: threshold must be a number",
        ),
    ],
)
def test_invalid_shed_if_is_refused_with_its_path(body: str, expected: str) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(f"routing_policy:\n  strategy: least-loaded\n  {body}\n")
    assert any(expected in error for error in caught.value.errors), caught.value.errors


def test_check_policy_prints_shed_if_and_warns_about_percentages() -> None:
    loaded = load_policy(
        "routing_policy:\n  strategy: least-loaded\n  shed_if:\n"
        "    model_capacity_utilization: {gte: 80}\n    priority: {lte: 0}\n"
    )
    text = describe(loaded, 3)
    assert "  shed_if:    model_capacity_utilization >= 80\n" in text
    assert "              applies to priority <= 0\n" in text
    assert "              503 load_shed, Retry-After: 1\n" in text
    warning = "routing_policy.shed_if.model_capacity_utilization.gte: 80 is outside 0.0 to 1.0"
    assert any(w.startswith(warning) for w in policy_warnings(loaded))


# --- selection and load values -----------------------------------------------------------


@pytest.mark.parametrize(
    ("tenants", "priority", "tenant", "request_priority", "selected"),
    [
        ((), None, "anyone", 99, True),
        (("batch",), None, "batch", 0, True),
        (("batch",), None, "web", 0, False),
        ((), Rule("priority", "lt", 5), "web", 4, True),
        ((), Rule("priority", "lt", 5), "web", 5, False),
        (("batch",), Rule("priority", "lt", 5), "batch", 9, False),  # both must hold
        (("batch",), Rule("priority", "lt", 5), "batch", 1, True),
    ],
)
def test_shed_if_selects_by_tenant_and_priority(
    tenants: tuple[str, ...],
    priority: Rule | None,
    tenant: str,
    request_priority: int,
    selected: bool,
) -> None:
    rules = Shed((Rule("model_queue_depth", "gte", 0),), tenants, priority)
    assert rules.selects(tenant, request_priority) is selected
    hit = shed(rules, tenant, request_priority, MODEL, [], WaitQueue(5))
    assert (hit is not None) is selected


async def test_load_values_are_router_wide(autojump_clock: Any) -> None:
    queue = WaitQueue(10)
    for _ in range(3):
        queue.join(MODEL)
    queue.join("other")
    busy = make_peer("A", capacity=4, active=3)
    idle = make_peer("B", capacity=4, active=0)
    down = make_peer("C", capacity=8, active=8)
    down.healthy = False
    pool = [busy, idle, down]
    assert load_value("model_queue_depth", MODEL, pool, queue) == 3
    assert load_value("total_queue_depth", MODEL, pool, queue) == 4
    # Healthy agents only: an unhealthy agent's slots are not capacity anyone can use.
    assert load_value("model_capacity_utilization", MODEL, pool, queue) == 3 / 8
    assert load_value("model_capacity_utilization", MODEL, [down], queue) is None


async def test_missing_load_passes_and_the_first_violated_rule_is_reported(
    autojump_clock: Any,
) -> None:
    rules = Shed(
        (Rule("model_capacity_utilization", "gte", 0.5), Rule("model_queue_depth", "gte", 1))
    )
    queue = WaitQueue(10)
    assert shed(rules, "t", 0, MODEL, [], queue) is None  # no agents: utilization unknown
    queue.join(MODEL)
    hit = shed(rules, "t", 0, MODEL, [], queue)
    assert hit is not None and hit.detail() == "model_queue_depth(got=1,gte=1)"
    busy = make_peer("A", capacity=4, active=3)
    hit = shed(rules, "t", 0, MODEL, [busy], queue)
    assert hit is not None and hit.detail() == "model_capacity_utilization(got=0.75,gte=0.5)"


# --- the queue's order -------------------------------------------------------------------


def test_the_queue_orders_by_priority_then_arrival() -> None:
    queue = WaitQueue(10)
    joined = [(p, queue.join(MODEL, p)) for p in (0, 5, 0, 9, 5, 0)]
    order = [w.priority for w in queue._waiters[MODEL]]
    assert order == [9, 5, 5, 0, 0, 0]
    # FIFO within a priority: the two fives and the three zeros keep their arrival order.
    fives = [w for p, w in joined if p == 5]
    zeros = [w for p, w in joined if p == 0]
    assert queue._waiters[MODEL][1:3] == fives
    assert queue._waiters[MODEL][3:] == zeros
    assert queue.total() == 6


def test_notify_wakes_the_highest_priority_and_wake_ups_pass_down_the_order() -> None:
    async def main() -> None:
        queue = WaitQueue(10)
        low = queue.join(MODEL, 0)
        high = queue.join(MODEL, 3)
        assert low is not None and high is not None
        queue.notify(MODEL)
        assert high.event.is_set() and not low.event.is_set()
        queue.woke(MODEL, high)  # no slot for it: the wake-up goes on to the next
        assert low.event.is_set()

    trio.run(main)


def test_a_full_queue_evicts_its_lowest_newest_waiter_for_a_higher_priority() -> None:
    async def main() -> None:
        queue = WaitQueue(2)
        first = queue.join(MODEL, 0)
        second = queue.join(MODEL, 0)
        assert first is not None and second is not None
        assert queue.join(MODEL, 0) is None  # same priority: no place, as before
        high = queue.join(MODEL, 1)
        assert high is not None
        assert second.evicted and second.event.is_set()
        assert not first.evicted
        assert queue._waiters[MODEL] == [high, first]
        assert queue.total() == 2
        queue.leave(MODEL, second)  # an evicted waiter leaving changes nothing
        assert queue._waiters[MODEL] == [high, first]

    trio.run(main)


def test_a_disabled_queue_takes_no_one() -> None:
    assert WaitQueue(0).join(MODEL, 100) is None


# --- the session -------------------------------------------------------------------------

SHED_BATCH = """
strategy: least-loaded
shed_if:
  tenants: [batch]
  model_queue_depth: {gte: 1}
  retry_after: 4
"""
ANY = "strategy: least-loaded"
STEP1 = "name: step1\nstrategy: least-loaded"


async def test_a_shed_request_ends_before_the_gates_and_never_queues(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="policy")
    a = make_peer("A", capacity=1)
    h = Harness(policy(SHED_BATCH, STEP1), [a])
    served: list[Served] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, h, served)  # takes A's only slot
        await trio.testing.wait_all_tasks_blocked()
        web = request()
        nursery.start_soon(hold, h, served, web)  # waits: nothing is shed yet
        await trio.testing.wait_all_tasks_blocked()
        assert h.queue.length(MODEL) == 1

        batch = request()
        batch.tenant = "batch"
        outcome = await h.route(batch)
        assert isinstance(outcome, LoadShed)
        assert outcome.step_name == "routing_policy"
        assert outcome.retry_after == 4
        assert outcome.reason == "routing_policy: shed_if [model_queue_depth(got=1,gte=1)]"
        assert outcome.chain == ["routing_policy", "step1"]
        assert outcome.steps_tried == 1
        assert h.queue.length(MODEL) == 1  # the batch request never joined

        with pytest.raises(RouterError) as caught:
            await h.dispatcher().dispatch(batch)
        err = caught.value
        assert err.code == ErrorCode.LOAD_SHED and err.http_status == 503
        assert err.retry_after == 4
        assert "model_queue_depth(got=1,gte=1)" in err.message

        # Another tenant under the same load queues as before.
        other = request()
        other.tenant = "web"
        nursery.start_soon(hold, h, served, other)
        await trio.testing.wait_all_tasks_blocked()
        assert h.queue.length(MODEL) == 2
        served[0].response.close()
        await trio.testing.wait_all_tasks_blocked()
        assert [s.response.request_id for s in served[1:]] == [web.request_id]
        served[1].response.close()
        await trio.testing.wait_all_tasks_blocked()
        served[2].response.close()
    assert [s.response.request_id for s in served] == [
        served[0].response.request_id,
        web.request_id,
        other.request_id,
    ]
    assert h.metric("hivenet_router_policy_shed_total", tenant="batch") == 1
    assert h.metric("hivenet_router_policy_shed_total", step="routing_policy") == 1
    assert h.metric("hivenet_router_policy_exhausted_total") == 0
    lines = [r.getMessage() for r in caplog.records if " load_shed " in r.getMessage()]
    assert lines == [
        f'req={batch.request_id} model="m" capability="llm" tenant=batch priority=0 load_shed'
        ' step=routing_policy rule="model_queue_depth(got=1,gte=1)" retry_after=4'
        " chain=[routing_policy→step1] tried=1/2"
        ' reason="routing_policy: shed_if [model_queue_depth(got=1,gte=1)]"'
    ]


async def test_shedding_in_a_fallback_step_reports_the_earlier_drains(
    autojump_clock: Any,
) -> None:
    eu = make_peer("A", capacity=1, active=1, region="EU")
    h = Harness(
        policy(
            f"match: {{region: US}}\n{ANY}",
            f"{STEP1}\nshed_if:\n  priority: {{lt: 1}}\n  model_capacity_utilization: {{gte: 1.0}}",
        ),
        [eu],
    )
    low = await h.route(request())
    assert isinstance(low, LoadShed)
    assert low.step_name == "step1"
    assert low.reason == (
        'routing_policy: gate[4] match [region(got="EU",want="US")=1]'
        " | step1: shed_if [model_capacity_utilization(got=1,gte=1)]"
    )
    assert low.steps_tried == 2
    high = request()
    high.priority = 1
    with trio.move_on_after(5):
        await h.route(high)  # not shed: it waits for A's slot
        pytest.fail("a priority-1 request cannot be served while A is full")
    assert h.metric("hivenet_router_policy_shed_total") == 0  # route() alone counts nothing


async def test_policies_without_shed_if_never_shed(autojump_clock: Any) -> None:
    a = make_peer("A", capacity=1, active=1)
    h = Harness(policy(ANY), [a], queue_depth=0)
    outcome = await h.route()
    assert isinstance(outcome, Exhausted)
    assert outcome.error.code == ErrorCode.NO_CAPACITY


async def test_the_queue_serves_higher_priorities_first_fifo_within_one(
    autojump_clock: Any,
) -> None:
    a = make_peer("A", capacity=1)
    h = Harness(policy(ANY), [a])
    served: list[Served] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, h, served)
        await trio.testing.wait_all_tasks_blocked()
        reqs = []
        for priority in (0, 2, 0, 1, 2):
            req = request()
            req.priority = priority
            reqs.append(req)
            nursery.start_soon(hold, h, served, req)
            await trio.testing.wait_all_tasks_blocked()
        for n in range(len(reqs)):
            served[n].response.close()
            await trio.testing.wait_all_tasks_blocked()
        served[-1].response.close()
    order = [s.response.request_id for s in served[1:]]
    by_id = {r.request_id: (r.priority, i) for i, r in enumerate(reqs)}
    assert [by_id[rid] for rid in order] == [(2, 1), (2, 4), (1, 3), (0, 0), (0, 2)]


async def test_an_evicted_waiter_moves_on_to_its_next_step(autojump_clock: Any) -> None:
    a = make_peer("A", capacity=1, region="EU")
    b = make_peer("B", capacity=1, active=1, region="US")
    h = Harness(
        policy(f"match: {{region: EU}}\n{ANY}", f"{STEP1}\nmatch: {{region: US}}"), [a, b], 1
    )
    served: list[Served] = []
    outcomes: list[Any] = []

    async def route(req: Any) -> None:
        outcomes.append(await h.route(req))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, h, served)  # A busy
        await trio.testing.wait_all_tasks_blocked()
        low = request()
        nursery.start_soon(route, low)
        await trio.testing.wait_all_tasks_blocked()
        assert h.queue.length(MODEL) == 1
        high = request()
        high.priority = 5
        nursery.start_soon(hold, h, served, high)
        await trio.testing.wait_all_tasks_blocked()
        # The low request lost its place and went on to step1, where B is full too; its
        # place there is taken by the high one (same model queue): it is exhausted.
        assert len(outcomes) == 1
        (low_outcome,) = outcomes
        assert isinstance(low_outcome, Exhausted)
        assert low_outcome.error.code == ErrorCode.NO_CAPACITY
        assert low_outcome.reason == (
            "routing_policy: gate[6] capacity [at_capacity=1] | step1: gate[6] capacity"
            " [at_capacity=1]"
        )
        served[0].response.close()
        await trio.testing.wait_all_tasks_blocked()
        assert served[1].response.request_id == high.request_id
        served[1].response.close()


def test_a_waiter_woken_behind_a_woken_one_lets_it_look_first() -> None:
    """The head takes a slot and passes its wake-up on; before that wake-up has gone
    down the queue, the slot comes free again and the new head is woken. The waiter
    the old wake-up reached last must not take the new room ahead of the new head
    (seen end to end: the low tenant served before the two mid ones)."""

    async def main() -> None:
        queue = WaitQueue(10)
        high, mid, low = (queue.join(MODEL, p) for p in (2, 1, 0))
        assert high is not None and mid is not None and low is not None
        queue.notify(MODEL)
        queue.leave(MODEL, high)  # took the slot; the wake-up goes on to mid
        queue.woke(MODEL, mid)  # no room for mid (high holds it): on to low
        queue.notify(MODEL)  # high's answer is done: mid, the head, is woken again
        assert low.event.is_set() and mid.event.is_set()
        assert queue._woken[MODEL] == 2  # the count that lets a lone wake-up skip the scan
        assert queue.woken_ahead(MODEL, low)
        assert not queue.woken_ahead(MODEL, mid)
        queue.rearm(MODEL, low)  # low waits; mid looks first and passes it on
        assert not low.event.is_set()
        queue.leave(MODEL, mid)
        assert low.event.is_set() and not queue.woken_ahead(MODEL, low)
        assert queue._woken[MODEL] == 1
        queue.leave(MODEL, low)
        assert MODEL not in queue._woken

    trio.run(main)


async def test_a_queue_place_woken_behind_a_woken_one_waits_for_it_to_look() -> None:
    """The session's wait: trio may run the lower waiter's task first; it waits until
    the one ahead has looked (and passed the wake-up on), whatever the run order."""
    queue = WaitQueue(10)
    places = []
    for priority in (2, 1, 0):
        req = request()
        req.priority = priority
        place = _QueuePlace(queue, RouterMetrics(), req)
        assert place.enter()
        places.append(place)
    high, mid, low = places
    assert mid.waiter is not None and low.waiter is not None
    queue.notify(MODEL)  # a change: high is woken
    high.leave()  # high took the slot; the wake-up goes on to mid
    queue.woke(MODEL, mid.waiter)  # no room for mid: on to low
    queue.notify(MODEL)  # high's answer is done: mid, the head now, is woken again
    assert low.waiter.event.is_set() and mid.waiter.event.is_set()
    returned = False

    async def wait_low() -> None:
        nonlocal returned
        await low.wait()
        returned = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_low)
        await trio.testing.wait_all_tasks_blocked()
        assert not returned  # mid looks first
        mid.leave()  # mid took the room: its wake-up passes on to low
        await trio.testing.wait_all_tasks_blocked()
        assert returned


def test_an_evicted_waiter_waits_for_no_one() -> None:
    async def main() -> None:
        queue = WaitQueue(1)
        low = queue.join(MODEL, 0)
        high = queue.join(MODEL, 1)  # evicts low, which is woken to leave
        assert low is not None and high is not None and low.evicted
        queue.notify(MODEL)
        assert high.event.is_set() and not queue.woken_ahead(MODEL, low)

    trio.run(main)


async def test_a_broken_streams_continuation_is_not_shed(autojump_clock: Any) -> None:
    """`shed_if` admits requests; a continuation was admitted when it came, and its
    agent's loss is what raised the load the rules read."""
    busy = "shed_if:\n  model_capacity_utilization: {gte: 0.5}\n"
    a, b = make_peer("A", capacity=2, active=1), make_peer("B", capacity=2, active=1)
    h = Harness(busy + policy(f"{ANY}\n{busy}"), [a, b])
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(request())
    assert caught.value.code == ErrorCode.TOO_MANY_CONCURRENT  # the front door's
    again = request()
    again.exclude = frozenset({"A"})
    served = await h.dispatcher().continuation(again)
    assert served is not None and served.peer is b
    served.response.close()
    step_only = Harness(policy(f"{ANY}\n{busy}"), [make_peer("A", capacity=2, active=1)])
    assert isinstance(await step_only.route(), LoadShed)
    continued = await step_only.dispatcher().continuation(request())
    assert continued is not None
    continued.response.close()


class _SlowTicket:
    """A tenant's admission (router/tenants/gate.py `Ticket`) during which the policy
    is reloaded: what a wait for the tenant's room, or a SIGHUP, can do."""

    counts_tokens = False
    wants_usage = False

    def __init__(self, during: Callable[[], None]) -> None:
        self.during = during
        self.answers: list[ErrorCode] = []

    async def admit(
        self, model: str, size: int, need: int = 0, charge: int = 0, output: int = 0
    ) -> None:
        self.during()

    def answered_with(self, code: ErrorCode) -> None:
        self.answers.append(code)


async def test_a_request_is_routed_under_the_policy_it_was_admitted_under(
    autojump_clock: Any,
) -> None:
    h = Harness(policy(ANY), [make_peer("A")])
    h.script["A"] = [fail()]
    # The reloaded policy has no agent for the model: routed under it, A is never tried.
    newer = policy("match: {engine: vllm}\n" + ANY)
    reloads: list[list[str]] = []
    ticket = _SlowTicket(lambda: reloads.append(h.store.replace(newer, "test")))
    client = ClientApi(h.dispatcher(), h.table, h.metrics, ClientSettings(4096, 60.0))
    scope = {"path": "/v1/chat/completions", "headers": [], TICKET: ticket}
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    incoming = [{"type": "http.request", "body": body.encode(), "more_body": False}]

    async def receive() -> dict:
        if incoming:
            return incoming.pop()
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict) -> None:
        pass

    status = await client.inference(scope, receive, send, str(uuid.uuid4()), "t")
    assert (status, ticket.answers) == (503, [ErrorCode.BACKEND_UNAVAILABLE])
    assert reloads == [[]] and h.tried() == ["A"]
