"""The running policy and its reloads: a bad policy never replaces a good one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from protocol.logs import quote
from router.metrics import RouterMetrics
from router.policy.schema import (
    Policy,
    PolicyError,
    default_policy,
    load_policy,
    load_policy_file,
)

log = logging.getLogger("policy")


class PolicyStore:
    def __init__(self, metrics: RouterMetrics, path: str | None = None) -> None:
        self.metrics = metrics
        self.path = path
        self.current: Policy = default_policy()
        self.listeners: list[Callable[[Policy], None]] = []
        if path is not None:
            # At start-up a bad file is fatal (PolicyError names every problem).
            self.current = load_policy_file(path)

    def replace(self, text: str, origin: str) -> list[str]:
        """Validate and install `text`; the errors, empty on success."""
        try:
            policy = load_policy(text)
        except PolicyError as exc:
            return self.reject(exc.errors, origin)
        self.current = policy
        self.metrics.reloads.labels("success").inc()
        log.info("policy_reloaded origin=%s chain=[%s]", origin, "→".join(policy.chain_names()))
        for listener in self.listeners:
            listener(policy)
        return []

    def reject(self, errors: list[str], origin: str) -> list[str]:
        """Count and log a reload that failed before or during validation; `errors`."""
        self.metrics.reloads.labels("failure").inc()
        log.warning("policy_reload_failed origin=%s errors=%s", origin, quote("; ".join(errors)))
        return errors

    def reload_file(self) -> list[str]:
        """Re-read --policy-file (SIGHUP); the errors, empty on success."""
        if self.path is None:
            log.warning("policy_reload_skipped origin=file reason=%s", quote("no --policy-file"))
            return ["no --policy-file to reload"]
        try:
            # Not UTF-8 must be a rejected reload, not an exception in the signal task.
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return self.reject([f"{self.path}: cannot read policy file ({exc})"], "file")
        return self.replace(text, "file")
