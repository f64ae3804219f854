"""From a parsed client request to an answer: local chain, then provider, with the
exhaustion report and the policy counters in one place."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

from protocol.errors import ErrorCode, RouterError
from protocol.paths import GENERATIVE
from protocol.tracing import NULL_SPAN, Span
from router.forward_limit import ForwardLimit
from router.metrics import UNREGISTERED_MODEL, RouterMetrics
from router.peers import PeerTable
from router.policy.schema import Policy, ProviderFallback
from router.policy.store import PolicyStore
from router.session import (
    Exhausted,
    LoadShed,
    RouteRequest,
    RoutingSession,
    Served,
    exhaustion_line,
    shed_line,
)

log = logging.getLogger("policy")

# The client endpoints a provider fallback can serve (router/providers/client.py).
PROVIDER_PATHS = GENERATIVE


class ProviderStream(Protocol):
    """The rest of a streamed provider answer: `next` is None at its end; `aclose` is
    called on every path."""

    @property
    def usage(self) -> dict[str, int] | None: ...

    async def next(self) -> bytes | None: ...

    async def aclose(self) -> None: ...


@dataclass
class ProviderServed:
    status: int
    content_type: str
    # The whole answer, or a stream's first event (the rest comes from `stream`).
    body: bytes
    engine: str
    headers: dict[str, str] = field(default_factory=dict)
    stream: ProviderStream | None = None


# Calls the external provider; raises RouterError when it fails.
ProviderCall = Callable[[ProviderFallback, RouteRequest], Awaitable[ProviderServed]]


class Dispatcher:
    def __init__(
        self,
        table: PeerTable,
        session: RoutingSession,
        store: PolicyStore,
        metrics: RouterMetrics,
        provider_call: ProviderCall | None = None,
        provider_available: Callable[[str], bool] = lambda engine: False,
        limit: ForwardLimit | None = None,
    ) -> None:
        self.table = table
        self.session = session
        self.store = store
        self.metrics = metrics
        self.provider_call = provider_call
        self.provider_available = provider_available
        self.limit = limit or ForwardLimit(0, 0)

    def model_label(self, model: str) -> str:
        """`model` as metrics label it: its name once an agent registered it or a
        per-model policy names it, else UNREGISTERED_MODEL."""
        if self.table.registered(model) or self.store.models.for_model(model) is not None:
            return model
        return UNREGISTERED_MODEL

    def policy_of(self, req: RouteRequest) -> Policy:
        """The policy `req` is routed under (RouteRequest.policy), from now on the running
        one for a request that came without."""
        if req.policy is None:
            req.policy = self.store.for_model(req.model)
        return req.policy

    def provider_for(self, policy: Policy, req: RouteRequest) -> ProviderFallback | None:
        provider = policy.fallback_provider
        if (
            provider is None
            or self.provider_call is None
            or req.capability != "llm"
            or req.path not in PROVIDER_PATHS
            or not self.provider_available(provider.engine)
        ):
            return None
        return provider

    async def dispatch(self, req: RouteRequest) -> Served | ProviderServed:
        """Serve `req`, or raise RouterError (BackendRejected for request-level errors)."""
        policy = self.policy_of(req)
        root = req.span
        if root is NULL_SPAN and self.limit.limiter is None:
            # Untraced and unbounded, as most routers run: no span to open and no slot
            # to hold, each a context manager per request.
            outcome = await self.session.route(policy, req)
        else:
            outcome = await self._route_traced(policy, req, root)
        if isinstance(outcome, Served):
            metrics = self.metrics
            metrics.routed.labels(req.model, req.tenant).inc()
            if outcome.step_index == 0:
                metrics.primary.labels(req.model, req.tenant).inc()
            else:
                metrics.fallback.labels(req.model, req.tenant).inc()
            return outcome
        if isinstance(outcome, LoadShed):
            self._shed(req, outcome)
        return await self._after_chain(policy, req, outcome)

    async def _route_traced(
        self, policy: Policy, req: RouteRequest, root: Span
    ) -> Served | Exhausted | LoadShed:
        with root.child("route", {"hivenet.model": req.model}) as span:
            # The spans of the routing (its forwards) go under this one.
            req.span = span
            try:
                async with self.limit.slot():
                    outcome = await self.session.route(policy, req)
            finally:
                req.span = root
            if isinstance(outcome, Served):
                span.set("hivenet.step", outcome.step_name)
                span.set("hivenet.peer_id", outcome.peer.peer_id)
            else:
                span.fail("load shed" if isinstance(outcome, LoadShed) else "chain exhausted")
        return outcome

    async def continuation(self, req: RouteRequest) -> Served | None:
        """Route a broken stream's continuation (router/continuation_relay.py) through
        the local chain only: a provider cannot go on from another engine's text. The
        request was counted as routed once; its continuation is counted on its own, and
        not shed: `shed_if` admitted the request when it came. The chain is the one the
        request started with: a reload since changes the next request's."""
        policy = self.policy_of(req)
        async with self.limit.slot():
            outcome = await self.session.route(policy, req, admit=False)
        return outcome if isinstance(outcome, Served) else None

    def _shed(self, req: RouteRequest, shed: LoadShed) -> NoReturn:
        """Refused under load: no provider (shedding is meant to cut work), no exhaustion."""
        log.info("%s", shed_line(req, shed))
        self.metrics.shed.labels(self.model_label(req.model), req.tenant, shed.step_name).inc()
        if shed.front_door:
            # Upstream's answer for its top-level shed_if, so its clients back off alike.
            raise RouterError(
                ErrorCode.TOO_MANY_CONCURRENT,
                f"model {req.model!r} is saturated: {shed.hit.detail()} over its healthy"
                " agents (policy shed_if); retry later",
                retry_after=shed.retry_after,
            )
        raise RouterError(
            ErrorCode.LOAD_SHED,
            f"load shed at policy step {shed.step_name!r}: {shed.hit.detail()}"
            f" for tenant {req.tenant!r} priority {req.priority}; retry later",
            retry_after=shed.retry_after,
        )

    async def _after_chain(
        self, policy: Policy, req: RouteRequest, ex: Exhausted
    ) -> ProviderServed:
        log.warning("%s", exhaustion_line(req, ex))
        # The policy the request started with: a reload while it was routing changes the
        # next request's provider, not this one's.
        provider = self.provider_for(policy, req)
        model = self.model_label(req.model)
        if provider is not None and self.provider_call is not None:
            if req.on_provider is not None:
                await req.on_provider()
            req.agent = f"provider:{provider.engine}"
            try:
                attributes = {"hivenet.provider": provider.engine}
                with req.span.child("provider_fallback", attributes):
                    served = await self.provider_call(provider, req)
            except BaseException:
                # Failed, or cut short by the deadline or the client: no result followed.
                self.metrics.exhausted.labels(model, req.tenant).inc()
                raise
            self.metrics.provider.labels(model, req.tenant).inc()
            return served
        self.metrics.exhausted.labels(model, req.tenant).inc()
        if not self.table.for_model(req.model):
            raise RouterError(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {req.model!r} is not served by any registered agent",
            )
        raise ex.error
