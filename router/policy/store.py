"""The running policy and its reloads: a bad policy never replaces a good one."""

from __future__ import annotations

import logging
from collections.abc import Callable

from protocol.logs import quote
from router.documents import DocumentStore
from router.metrics import RouterMetrics
from router.policy.schema import Policy, default_policy, load_policy, load_policy_file

log = logging.getLogger("policy")


class PolicyStore(DocumentStore[Policy]):
    kind = "policy"
    noun = "policy"
    title = "policy file"

    def __init__(self, metrics: RouterMetrics, path: str | None = None) -> None:
        super().__init__(metrics.reloads, log, path)
        self.current: Policy = default_policy()
        self.listeners: list[Callable[[Policy], None]] = []
        if path is not None:
            # At start-up a bad file is fatal (PolicyError names every problem).
            self.current = load_policy_file(path)

    def parse(self, text: str) -> Policy:
        return load_policy(text)

    def source(self) -> str:
        return self.current.source

    def install(self, value: Policy) -> str:
        self.current = value
        for listener in self.listeners:
            listener(value)
        chain = "→".join(value.chain_names())
        return f"chain=[{chain}]"

    def without_file(self) -> list[str]:
        log.warning("policy_reload_skipped origin=file reason=%s", quote("no --policy-file"))
        return ["no --policy-file to reload"]
