"""The running policy and its reloads: a bad policy never replaces a good one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from protocol.logs import quote
from router.metrics import RouterMetrics
from router.policy.schema import Policy, PolicyError, default_policy, load_policy

log = logging.getLogger("policy")


class PolicyStore:
    def __init__(self, metrics: RouterMetrics, path: str | None = None) -> None:
        self.metrics = metrics
        self.path = path
        self.current: Policy = default_policy()
        self.listeners: list[Callable[[Policy], None]] = []
        if path is not None:
            self.current = load_policy(Path(path).read_text())

    def replace(self, text: str, origin: str) -> list[str]:
        """Validate and install `text`; the errors, empty on success."""
        try:
            policy = load_policy(text)
        except PolicyError as exc:
            self.metrics.reloads.labels("failure").inc()
            log.warning(
                "policy_reload_failed origin=%s errors=%s", origin, quote("; ".join(exc.errors))
            )
            return exc.errors
        self.current = policy
        self.metrics.reloads.labels("success").inc()
        log.info("policy_reloaded origin=%s chain=[%s]", origin, "→".join(policy.chain_names()))
        for listener in self.listeners:
            listener(policy)
        return []

    def reload_file(self) -> list[str]:
        if self.path is None:
            return ["no --policy-file to reload"]
        try:
            text = Path(self.path).read_text()
        except OSError as exc:
            self.metrics.reloads.labels("failure").inc()
            log.warning("policy_reload_failed origin=file error=%s", quote(str(exc)))
            return [str(exc)]
        return self.replace(text, "file")
