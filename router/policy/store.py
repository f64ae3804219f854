"""The running policy and its reloads: a bad policy never replaces a good one."""

from __future__ import annotations

import logging
from collections.abc import Callable

from protocol.logs import quote
from router.documents import DocumentError, DocumentStore
from router.metrics import RouterMetrics
from router.policy.models import (
    ModelConflict,
    ModelPolicies,
    load_directory,
    parse_named,
    read_directory,
)
from router.policy.schema import Policy, default_policy, load_policy, load_policy_file

log = logging.getLogger("policy")


class PolicyStore(DocumentStore[Policy]):
    kind = "policy"
    noun = "policy"
    title = "policy file"

    def __init__(
        self, metrics: RouterMetrics, path: str | None = None, model_dir: str | None = None
    ) -> None:
        super().__init__(metrics.reloads, log, path)
        self.current: Policy = default_policy()
        self.listeners: list[Callable[[Policy], None]] = []
        self.model_dir = model_dir
        self.models = ModelPolicies()
        if path is not None:
            # At start-up a bad file is fatal (PolicyError names every problem).
            self.current = load_policy_file(path)
        if model_dir is not None:
            default, self.models = load_directory(model_dir)
            if default is not None:
                if path is not None:
                    log.warning(
                        "policy_file_replaced file=%s by=%s",
                        quote(path),
                        quote(f"{model_dir}/_default.yaml"),
                    )
                self.current = default

    def for_model(self, model: str) -> Policy:
        """The policy a request for `model` follows: its named document, or the global."""
        return self.models.for_model(model) or self.current

    def put_named(self, name: str, text: str, origin: str) -> list[str]:
        """Validate `text` and make it document `name`; the errors (ModelConflict raised)."""
        try:
            policy = parse_named(text)
        except DocumentError as exc:
            return self.reject(exc.errors, origin)
        self.models.put(name, policy, origin)
        self.reloads.labels("success").inc()
        log.info(
            "policy_reloaded origin=%s name=%s models=%s chain=[%s]",
            origin,
            quote(name),
            quote(",".join(policy.models)),
            "→".join(policy.chain_names()),
        )
        return []

    def reload_file(self) -> list[str]:
        if self.model_dir is None:
            return super().reload_file()
        return self.reload_directory(self.model_dir)

    def reload_directory(self, directory: str) -> list[str]:
        """SIGHUP with --policy-model-dir: each changed file on its own, so one bad edit
        keeps that document's running version and spoils nothing else."""
        try:
            default, texts, errors = read_directory(directory)
        except DocumentError as exc:
            return self.reject(exc.errors, "file")
        if default is not None and default != self.current.source:
            errors += [f"_default.yaml: {e}" for e in self.replace(default, "file")]
        for name in [n for n, d in self.models.named.items() if d.origin == "file"]:
            if name not in texts:
                self.models.delete(name)
                log.info("policy_removed origin=file name=%s", quote(name))
        for name, text in texts.items():
            running = self.models.named.get(name)
            if running is not None and running.policy.source == text:
                continue
            try:
                errors += [f"{name}: {e}" for e in self.put_named(name, text, "file")]
            except ModelConflict as exc:
                errors += [f"{name}: {e}" for e in self.reject([str(exc)], "file")]
        return errors

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
