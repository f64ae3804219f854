"""One request's routing session: steps, slots, queue, tries, recovery, exhaustion.

The session knows nothing of libp2p or HTTP. It is handed a `forward` function that
sends the request to one agent and reports how that went, and a clock; so the whole
of the seeds' routing behaviour is testable with plain objects. It is also where each
forward's outcome is charged to its agent (`charged`: the history the `success_rate`
and `consecutive_failures` gates read, and the circuit breaker over them), because only
here is it known whether the client or the agent was at fault.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio

from protocol.errors import REQUEST_LEVEL, ErrorCode, RouterError
from protocol.logs import quote
from protocol.tracing import NULL_SPAN, Span
from router.capacity import Waiter, WaitQueue, try_acquire
from router.metrics import RouterMetrics
from router.peers import DEFAULT_FAILURE_COOLDOWN, Peer, PeerTable
from router.policy.admission import ShedHit, shed
from router.policy.gates import MODEL_FILTER, Evaluation, evaluate, is_probe
from router.policy.rank import Ranking, RankRequest
from router.policy.schema import Policy, Step

log = logging.getLogger("policy")

# Gate 1 when the model has agents but the request's own filters (the engines its
# endpoint needs, the agents a continuation leaves out) left none of them.
_NONE_LEFT = Evaluation(
    None, 0, f"gate[1] {MODEL_FILTER.name} [no_agents]", False, MODEL_FILTER.number
)

_BACKEND_FAILURES = frozenset({ErrorCode.BACKEND_UNAVAILABLE, ErrorCode.BACKEND_ERROR})
# How long an agent whose engine lacks a path is left out for it without being asked:
# the agent's own memory (agent/engines/endpoints.py MISSING_ROUTE_SECONDS), so an
# engine upgraded in place is asked again within five minutes.
LACKS_PATH_SECONDS = 300.0


@dataclass
class RouteRequest:
    request_id: str
    model: str
    capability: str
    tenant: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    stream: bool
    # The parsed JSON body, for the provider fallback.
    payload: dict = field(default_factory=dict)
    received_at: float = 0.0
    # Time spent outside the router's own work: in the capacity queue, in failed forwards.
    waited: float = 0.0
    # When the successful forward was written to the agent (router overhead ends).
    sent_at: float = 0.0
    # Ask the agent for the engine's token usage (tenant quotas, audit log).
    report_usage: bool = False
    # The stream may be continued if it breaks: the agent asks the engine to count its
    # tokens in every event (router/continuation.py reads them).
    stream_tokens: bool = False
    # Higher is served first from the capacity queue; `shed_if` may select by it.
    priority: int = 0
    # A hard constraint like the model: only agents running one of these engines
    # (empty: any engine). Token counting needs an engine with a tokenizer endpoint.
    engines: frozenset[str] = frozenset()
    # Agents never tried for this request: a stream's continuation excludes the agents
    # whose stream broke (router/continuation_relay.py).
    exclude: frozenset[str] = frozenset()
    # The request's innermost open span, under which the next one goes (NULL_SPAN with
    # tracing off), and the W3C traceparent the agent and its engine get with tracing
    # off: the client's.
    span: Span = NULL_SPAN
    traceparent: str | None = None
    # Called when routing leaves the local pool for the external provider (admission
    # gives back the request's occupancy: the provider holds no local KV cache).
    on_provider: Callable[[], Awaitable[None]] | None = None
    # The policy the request is admitted and routed under, its continuations included:
    # taken once when it arrives, so a reload changes the next request's and never
    # mixes two in one. None: the model's running policy when routing starts.
    policy: Policy | None = None
    # For the console's recent requests (router/recent.py): forwards tried so far, and
    # the agent of the latest (the one that answered, when one did).
    tries: int = 0
    agent: str = ""


class Slot:
    """One capacity slot on one agent; released exactly once, on every path."""

    __slots__ = ("_on_release", "peer", "released")

    def __init__(self, peer: Peer, on_release: Callable[[Peer], None]) -> None:
        self.peer = peer
        self._on_release = on_release
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.peer.active -= 1
            self._on_release(self.peer)


@dataclass
class ForwardFailure:
    """A forward that did not produce a usable answer."""

    code: ErrorCode
    message: str
    # Connection-level: the agent's session broke, not its backend.
    connection_level: bool = False
    # What the backend answered, passed to the client for request-level errors.
    status: int | None = None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def charged(failure: ForwardFailure) -> bool:
    """Whether `failure` counts against the agent (`success_rate`, `consecutive_failures`).

    Not when the client caused it (a request-level code: the engine judged the request,
    and another agent would answer the same), nor when the link broke (the agent's
    session, not its backend; that has its own recovery), nor when the agent was full
    with other routers' requests (`agent_full`: refused before any work), nor when its
    engine lacks the endpoint (`endpoint_not_supported`: the engine was not asked).
    """
    return (
        not failure.connection_level
        and failure.code not in REQUEST_LEVEL
        and failure.code is not ErrorCode.AGENT_FULL
        and failure.code is not ErrorCode.ENDPOINT_NOT_SUPPORTED
    )


# A successful forward hands back whatever the link returned as the response.
Forward = Callable[[Peer, RouteRequest, Slot], Awaitable["object | ForwardFailure"]]


@dataclass
class Served:
    response: object
    peer: Peer
    step_index: int
    step_name: str


@dataclass
class Exhausted:
    """The local chain could not serve; the error the client gets without a provider."""

    error: RouterError
    reason: str
    chain: list[str]
    steps_tried: int


@dataclass
class LoadShed:
    """A step's `shed_if` refused the request; the chain ends there."""

    step_name: str
    hit: ShedHit
    retry_after: int
    reason: str  # every step's reason up to and including the shedding one
    chain: list[str]
    steps_tried: int
    # The policy's top-level `shed_if` (upstream's front door), before any step.
    front_door: bool = False


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """A step that did not serve: its part of the reason, and how the chain goes on."""

    reason: str  # e.g. 'gate[5] prev_failures [prev_failed=2]' or 'max_tries exhausted'
    failure: ForwardFailure | None  # the step's last failed forward, if one failed
    # Drained at gate 6 with no place in the queue (disabled, full, or pushed out).
    capacity_full: bool
    drained_gate: int | None  # the gate that emptied the pool; None: max_tries ran out


@dataclass(eq=False, slots=True)
class _SendTo:
    """Forward to `slot.peer`: the slot is taken, and the breaker held for a probe."""

    slot: Slot
    probe: bool
    held: float  # the breaker before the probe, restored if the probe says nothing

    def abandon(self) -> None:
        """The forward raised (cancelled): no verdict on the agent."""
        self.slot.release()
        if self.probe:
            self.slot.peer.stats.end_probe(self.held)


@dataclass(frozen=True, slots=True)
class _Queued:
    """Wait in the model's queue; `drained` is what the step reports if the wait fails."""

    drained: Evaluation


@dataclass(eq=False, slots=True)
class _StepRun:
    """One step's running state within one request."""

    index: int
    step: Step
    budget: int
    recovered: set[str]  # agents whose free connection recovery is used (whole request)
    wait: _QueuePlace
    rank_request: RankRequest  # the whole request's: its prompt is read once
    failed: set[str] = field(default_factory=set)  # gate 5's input
    tries: int = 0
    last_failure: ForwardFailure | None = None

    def drained(self, ev: Evaluation, capacity_full: bool) -> StepOutcome:
        reason = ev.drain or "no eligible agents"
        return StepOutcome(reason, self.last_failure, capacity_full, ev.gate)


class BackendRejected(Exception):
    """A request-level error from a backend, passed to the client as it answered."""

    def __init__(self, failure: ForwardFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RoutingSession:
    def __init__(
        self,
        table: PeerTable,
        queue: WaitQueue,
        metrics: RouterMetrics,
        forward: Forward,
        default_max_tries: int,
        on_release: Callable[[Peer], None],
        failure_cooldown: float = DEFAULT_FAILURE_COOLDOWN,
        ranking: Ranking | None = None,
    ) -> None:
        self.table = table
        self.queue = queue
        self.metrics = metrics
        self.forward = forward
        self.default_max_tries = default_max_tries
        self.on_release = on_release
        self.failure_cooldown = failure_cooldown
        # The router's strategies and what they remember (round-robin, prefix-aware).
        self.ranking = ranking or Ranking()
        # Whether any agent was found lacking a path: until then no request looks.
        self.lacking = False

    async def route(
        self, policy: Policy, req: RouteRequest, admit: bool = True
    ) -> Served | Exhausted | LoadShed:
        """Serve `req` through the policy's local steps, or report why none could.

        `admit` False: no `shed_if` is checked, for a request admitted already (a
        broken stream's continuation: shedding it would throw away what it sent, at
        the moment its agent's loss raised the load the rules read).
        Raises BackendRejected for request-level errors; trio.Cancelled on deadline.
        """
        reasons: list[str] = []
        steps = policy.steps
        recovered: set[str] = set()
        last_failure: ForwardFailure | None = None
        capacity_drained = False
        if admit and policy.shed_if is not None:
            pool = self.table.for_model(req.model)
            hit = shed(policy.shed_if, req.tenant, req.priority, req.model, pool, self.queue)
            if hit is not None:
                chain = [s.name for s in steps]
                reason = f"shed_if: shed_if [{hit.detail()}]"
                retry = policy.shed_if.retry_after
                return LoadShed("shed_if", hit, retry, reason, chain, 0, front_door=True)
        rank_request = RankRequest(req.model, req.payload)
        for index, step in enumerate(steps):
            hit = self._shed(step, req) if admit else None
            if hit is not None:
                # Admission comes before the gates: a refused request neither queues nor
                # tries the later steps, which read the same router-wide load.
                with req.span.child("shed", {"hivenet.step": step.name}) as refused:
                    refused.fail(hit.detail())
                reasons.append(f"{step.name}: shed_if [{hit.detail()}]")
                chain = [s.name for s in steps]
                retry_after = step.shed_if.retry_after if step.shed_if else 0
                return LoadShed(
                    step.name, hit, retry_after, " | ".join(reasons), chain, len(reasons)
                )
            parent = req.span
            if parent is NULL_SPAN:  # untraced: no span, nor its attributes, per step
                outcome = await self._run_step(index, step, req, recovered, rank_request)
            else:
                with parent.child("step", {"hivenet.step": step.name}) as span:
                    # The step's queue wait and tries go under its span.
                    req.span = span
                    try:
                        outcome = await self._run_step(index, step, req, recovered, rank_request)
                    finally:
                        req.span = parent
                    if not isinstance(outcome, Served):
                        span.fail(outcome.reason)
            if isinstance(outcome, Served):
                return outcome
            reasons.append(f"{step.name}: {outcome.reason}")
            last_failure = outcome.failure or last_failure
            capacity_drained = capacity_drained or outcome.capacity_full
        return self._exhausted(req, steps, reasons, last_failure, capacity_drained)

    def _leave_out_lacking(self, run: _StepRun, req: RouteRequest) -> None:
        """Agents whose engine said lately it lacks the request's path start the step
        as failed (gate 5), so the model's other agents are tried without a round trip
        to them; when no other agent is left, the client hears `endpoint_not_supported`
        as when the agent said so."""
        now = trio.current_time()
        for peer in self.table.for_model(req.model):
            if peer.lacks and peer.lacks_path(req.path, now):
                run.failed.add(peer.peer_id)
                run.last_failure = ForwardFailure(
                    ErrorCode.ENDPOINT_NOT_SUPPORTED,
                    f"the engine of agent {peer.peer_id} does not serve {req.path}",
                    status=404,
                )

    def _pool(self, req: RouteRequest) -> Sequence[Peer]:
        pool = self.table.for_model(req.model)
        if req.engines:
            pool = [p for p in pool if p.metadata.engine in req.engines]
        if req.exclude:
            pool = [p for p in pool if p.peer_id not in req.exclude]
        return pool

    def _shed(self, step: Step, req: RouteRequest) -> ShedHit | None:
        if step.shed_if is None:
            return None
        pool = self.table.for_model(req.model)
        return shed(step.shed_if, req.tenant, req.priority, req.model, pool, self.queue)

    async def _run_step(
        self,
        index: int,
        step: Step,
        req: RouteRequest,
        recovered: set[str],
        rank_request: RankRequest,
    ) -> Served | StepOutcome:
        """One policy step: decide (`_next`, `_settle`), then do what was decided.

        Only the two awaits below, the queue wait and the forward, are checkpoints, so
        a decision and the state it changes (a slot, a queue place, a probe) cannot be
        interleaved with another request's.
        """
        wait = _QueuePlace(self.queue, self.metrics, req)
        budget = step.budget(self.default_max_tries)
        run = _StepRun(index, step, budget, recovered, wait, rank_request)
        if self.lacking:
            self._leave_out_lacking(run, req)
        try:
            while True:
                action = self._next(run, req)
                if isinstance(action, StepOutcome):
                    return action
                if isinstance(action, _Queued):
                    # The request's own deadline bounds the wait (cancellation).
                    with req.span.child("queue_wait") as queued:
                        await wait.wait()
                        evicted = wait.evicted()
                        if evicted:
                            queued.fail("evicted by a request of higher priority")
                    if evicted:
                        log.debug(
                            "req=%s queue_evicted step=%s priority=%d tenant=%s",
                            req.request_id,
                            step.name,
                            req.priority,
                            quote(req.tenant),
                        )
                        return run.drained(action.drained, capacity_full=True)
                    continue
                started = trio.current_time()
                parent, peer = req.span, action.slot.peer
                req.tries += 1
                req.agent = peer.peer_id
                attempt = (
                    parent
                    if parent is NULL_SPAN
                    else parent.child("try", {"hivenet.peer_id": peer.peer_id})
                )
                with attempt:
                    # The link's forward span goes under this try's.
                    req.span = attempt
                    try:
                        result = await self.forward(peer, req, action.slot)
                    except BaseException:
                        action.abandon()
                        raise
                    finally:
                        req.span = parent
                    if isinstance(result, ForwardFailure):
                        attempt.fail(str(result.code))
                settled = self._settle(run, req, action, result, started)
                if settled is not None:
                    return settled
        finally:
            wait.leave()

    def _next(self, run: _StepRun, req: RouteRequest) -> _SendTo | _Queued | StepOutcome:
        """What the step does next, decided without awaiting: forward to an agent (its
        slot taken), wait in the queue (the place taken), or end the step."""
        step, wait = run.step, run.wait
        while True:
            now = trio.current_time()
            pool = self._pool(req)
            ev = evaluate(
                pool, step, req.capability, run.failed, now, self.ranking, run.rank_request
            )
            peer = ev.best
            if peer is None:
                if not pool and (req.engines or req.exclude) and self.table.for_model(req.model):
                    ev = _NONE_LEFT
                log.debug(
                    "req=%s step_drained step=%s drain=%s waitable=%s tenant=%s",
                    req.request_id,
                    step.name,
                    quote(ev.drain or ""),
                    ev.waitable,
                    quote(req.tenant),
                )
                if not ev.waitable:
                    return run.drained(ev, capacity_full=False)
                if not wait.enter():
                    # Disabled (--queue-depth 0) or full: advance at once. The step's
                    # reason keeps the seeds' shape, `gate[6] capacity [at_capacity=N]`.
                    log.debug(
                        "req=%s queue_full step=%s model=%s depth=%d tenant=%s",
                        req.request_id,
                        step.name,
                        quote(req.model),
                        self.queue.depth,
                        quote(req.tenant),
                    )
                    return run.drained(ev, capacity_full=True)
                log.debug(
                    "req=%s queued step=%s priority=%d tenant=%s",
                    req.request_id,
                    step.name,
                    req.priority,
                    quote(req.tenant),
                )
                return _Queued(ev)
            wait.leave()
            if not try_acquire(peer):
                # Lost the race for the last slot: select again, no try used. Upstream's
                # `rejected_requests_total` counts these.
                peer.stats.rejections += 1
                continue
            self.ranking.chosen(step.strategy, step.strategy_params, peer, run.rank_request)
            if log.isEnabledFor(logging.DEBUG):  # every request passes here: no quoting when off
                # Least-loaded does not count its survivors (gates.Evaluation).
                counted = "" if ev.survivors is None else f" survivors={ev.survivors}"
                log.debug(
                    "req=%s step_selected step=%s peer=%s active=%d capacity=%d%s tenant=%s",
                    req.request_id,
                    step.name,
                    peer.peer_id,
                    peer.active,
                    peer.metadata.capacity,
                    counted,
                    quote(req.tenant),
                )
            probe = is_probe(peer, step, now)  # nothing awaited since `now` was read
            held = peer.stats.start_probe() if probe else 0.0
            return _SendTo(Slot(peer, self.on_release), probe, held)

    def _settle(
        self,
        run: _StepRun,
        req: RouteRequest,
        sent: _SendTo,
        result: object | ForwardFailure,
        started: float,
    ) -> Served | StepOutcome | None:
        """Charge a forward's outcome to its agent and decide the step's course: served,
        ended, or None to select again. Raises BackendRejected for the client's error."""
        peer, stats = sent.slot.peer, sent.slot.peer.stats
        if not isinstance(result, ForwardFailure):
            stats.record_success(sent.probe)
            return Served(result, peer, run.index, run.step.name)
        sent.slot.release()
        now = trio.current_time()
        if charged(result):
            stats.record_failure(now, self.failure_cooldown)
        elif sent.probe:
            stats.end_probe(sent.held)
        req.waited += now - started
        if result.code is ErrorCode.AGENT_FULL:
            stats.rejections += 1  # no slot for it on the agent: upstream's rejection
            # Other routers hold the agent's capacity. The refusal made the agent full
            # in this router's count too, so selecting again goes to another agent or
            # queues for its next report; no try is used.
            log.debug(
                "req=%s agent_full step=%s peer=%s tenant=%s",
                req.request_id,
                run.step.name,
                peer.peer_id,
                quote(req.tenant),
            )
            return None
        self.metrics.forward_failures.labels(req.model, str(result.code), req.tenant).inc()
        log.info(
            "req=%s forward_error step=%s peer=%s code=%s message=%s tenant=%s",
            req.request_id,
            run.step.name,
            peer.peer_id,
            result.code,
            quote(result.message),
            quote(req.tenant),
        )
        if result.code in REQUEST_LEVEL:
            raise BackendRejected(result)
        if result.code is ErrorCode.ENDPOINT_NOT_SUPPORTED:
            # Another agent's engine may serve it; this one is left out, no try used,
            # and for the next requests too, for a while (`_run_step`).
            peer.lacks[req.path] = now + LACKS_PATH_SECONDS
            self.lacking = True
            run.last_failure = result
            run.failed.add(peer.peer_id)
            return None
        # Kept even when the try is free: if the agent is then gone from the pool, the
        # client hears `agent_disconnected`, not that no agent was ever there.
        run.last_failure = result
        if result.connection_level and peer.peer_id not in run.recovered:
            # The first connection failure per agent and request is free.
            run.recovered.add(peer.peer_id)
            self.metrics.resets.labels(req.model, req.tenant).inc()
            return None
        run.failed.add(peer.peer_id)
        run.tries += 1
        if run.tries >= run.budget:
            return StepOutcome("max_tries exhausted", result, False, None)
        return None

    def _exhausted(
        self,
        req: RouteRequest,
        steps: tuple[Step, ...],
        reasons: list[str],
        last_failure: ForwardFailure | None,
        capacity_drained: bool,
    ) -> Exhausted:
        chain = [s.name for s in steps]
        reason = " | ".join(reasons)
        if last_failure is not None and last_failure.code is ErrorCode.ENDPOINT_NOT_SUPPORTED:
            error = RouterError(last_failure.code, f"{last_failure.message}; {reason}", "router")
        elif last_failure is not None:
            # What an engine answered (or failed to) is the backend's, as upstream
            # reports it; a lost agent is the router's.
            source = "backend" if last_failure.code in _BACKEND_FAILURES else "router"
            error = RouterError(
                last_failure.code, f"all local routing steps failed: {reason}", source
            )
        elif capacity_drained:
            error = RouterError(ErrorCode.NO_CAPACITY, f"no capacity: {reason}")
        else:
            error = RouterError(ErrorCode.NO_AGENTS_AVAILABLE, f"no agents available: {reason}")
        return Exhausted(error, reason, chain, len(reasons))


class _QueuePlace:
    """A request's place in its model's wait queue, kept across wake-ups."""

    def __init__(self, queue: WaitQueue, metrics: RouterMetrics, req: RouteRequest) -> None:
        self.queue = queue
        self.metrics = metrics
        self.req = req
        self.model = req.model
        self.waiter: Waiter | None = None
        self.since = 0.0

    def enter(self) -> bool:
        """Join the queue, or keep the place after a fruitless wake-up; False when full."""
        if self.waiter is not None:
            self.queue.woke(self.model, self.waiter)
            return True
        self.waiter = self.queue.join(self.model, self.req.priority)
        if self.waiter is None:
            return False
        self.since = trio.current_time()
        self.metrics.queue_depth.labels(self.model).set(self.queue.length(self.model))
        return True

    async def wait(self) -> None:
        waiter = self.waiter
        assert waiter is not None
        await waiter.event.wait()
        while self.queue.woken_ahead(self.model, waiter):
            self.queue.rearm(self.model, waiter)
            await waiter.event.wait()

    def evicted(self) -> bool:
        return self.waiter is not None and self.waiter.evicted

    def leave(self) -> None:
        if self.waiter is None:
            return
        self.queue.leave(self.model, self.waiter)
        self.waiter = None
        waited = trio.current_time() - self.since
        self.req.waited += waited
        # Labelled here, not per request: most requests never queue, and a labels()
        # lookup costs microseconds.
        self.metrics.queue_wait.labels(self.model, self.req.tenant).observe(waited)
        self.metrics.queue_depth.labels(self.model).set(self.queue.length(self.model))


def exhaustion_line(req: RouteRequest, ex: Exhausted) -> str:
    """The seeds' `policy_exhausted` warning, key for key."""
    return (
        f"{_whose(req)} policy_exhausted "
        f"{_chain(ex.chain, ex.steps_tried)} reason={quote_always(ex.reason)}"
    )


def shed_line(req: RouteRequest, shed: LoadShed) -> str:
    """The info line of a request refused by `shed_if`, shaped like `policy_exhausted`."""
    return (
        f"{_whose(req)} priority={req.priority} load_shed step={quote(shed.step_name)} "
        f"rule={quote_always(shed.hit.detail())} retry_after={shed.retry_after} "
        f"{_chain(shed.chain, shed.steps_tried)} reason={quote_always(shed.reason)}"
    )


def _whose(req: RouteRequest) -> str:
    return (
        f"req={req.request_id} model={quote_always(req.model)} "
        f"capability={quote_always(req.capability)} tenant={quote(req.tenant)}"
    )


def _chain(chain: list[str], steps_tried: int) -> str:
    return f"chain=[{'→'.join(chain)}] tried={steps_tried}/{len(chain)}"


def quote_always(value: str) -> str:
    """`quote`'s escaping, always in quotes (the seeds quote model and capability)."""
    quoted = quote(value)
    return quoted if quoted != value else f'"{value}"'
