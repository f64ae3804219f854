"""The console put together from a running router's own parts (router/app.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import trio

from router.explain import Explainer
from router.http.console import Console
from router.policy.schema import Policy, ProviderFallback
from router.recent import RecentRequests, StoryHandler
from router.session import RouteRequest

if TYPE_CHECKING:
    from router.app import RouterDaemon


def console_for(daemon: RouterDaemon, ui: bool) -> Console:
    dispatcher = daemon.dispatcher

    def provider_for(policy: Policy, capability: str, path: str) -> ProviderFallback | None:
        # Only the capability and the path decide (Dispatcher.provider_for).
        probe = RouteRequest("explain", "", capability, "-", "POST", path, {}, b"", False)
        return dispatcher.provider_for(policy, probe)

    explainer = Explainer(
        daemon.table,
        daemon.queue,
        daemon.ranking,
        daemon.store.for_model,
        provider_for,
        trio.current_time,
    )
    return Console(
        explainer,
        RecentRequests(),
        daemon.store,
        daemon.tenants.client_keys,
        daemon.tenants,
        ui=ui,
    )


@contextmanager
def story_capture(console: Console | None) -> Iterator[None]:
    """The stories' log handler on the root logger, for as long as the router runs."""
    if console is None or console.recent is None:
        yield
        return
    handler = StoryHandler(console.recent)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
