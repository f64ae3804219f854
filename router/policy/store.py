"""The running policy and its reloads: a bad policy never replaces a good one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from protocol.logs import quote
from router.admission.crosscheck import PolicyLimits
from router.documents import (
    DocumentError,
    DocumentStore,
    PreconditionFailed,
    matches,
    version_of,
)
from router.metrics import RouterMetrics
from router.policy.models import (
    ModelConflict,
    ModelPolicies,
    load_directory,
    parse_named,
    read_directory,
)
from router.policy.schema import (
    Policy,
    PolicyError,
    default_policy,
    load_policy,
    load_policy_file,
)

log = logging.getLogger("policy")


class NamedWriter(Protocol):
    """What runs per-model policy writes against the copy several routers share
    (router/fleet/config_sync.py)."""

    async def write_named(
        self, name: str, text: str | None, origin: str, if_match: str | None
    ) -> list[str]: ...


class PolicyStore(DocumentStore[Policy]):
    kind = "policy"
    noun = "policy"
    title = "policy file"

    def __init__(
        self, metrics: RouterMetrics, path: str | None = None, model_dir: str | None = None
    ) -> None:
        super().__init__(metrics.reloads, log, path)
        self.current: Policy = default_policy()
        # Told of each policy installed: the global one (name None) or a named one.
        self.listeners: list[Callable[[Policy, str | None], None]] = []
        self.model_dir = model_dir
        self.models = ModelPolicies()
        # The keys' side of the serverless cross-check (router/admission/crosscheck.py):
        # the errors a set of policy caps would give; the daemon points it at the keys.
        self.cross_check: Callable[[list[PolicyLimits]], list[str]] = lambda caps: []
        # With --state-url: per-model writes go through the fleet's copy (ConfigSync).
        self.named_fleet: NamedWriter | None = None
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

    def caps(
        self, default: Policy | None = None, named: tuple[str, Policy | None] | None = None
    ) -> list[PolicyLimits]:
        """Each policy's serverless input cap, the running ones or with `default` as the
        global policy or `named` as that document (None: deleted), for the cross-check."""
        limits = (default or self.current).admission
        caps: list[PolicyLimits] = [(None, limits.mode, limits.max_input_tokens)]
        documents = {name: doc.policy for name, doc in self.models.named.items()}
        if named is not None:
            name, policy = named
            documents.pop(name, None)
            if policy is not None:
                documents[name] = policy
        for policy in documents.values():
            own = policy.admission
            caps += [(m, own.mode, own.max_input_tokens) for m in policy.models]
        return caps

    def put_named(self, name: str, text: str, origin: str) -> list[str]:
        """Validate `text` and make it document `name`; the errors (ModelConflict raised)."""
        try:
            policy = self.check_named(name, text)
        except DocumentError as exc:
            return self.reject(exc.errors, origin)
        self.install_named(name, policy, origin)
        return []

    def check_named(self, name: str, text: str) -> Policy:
        """Document `name` as `text` would be, installed nowhere: DocumentError with
        the reasons, ModelConflict when another document has one of its models."""
        policy = parse_named(text)
        errors = self.cross_check(self.caps(named=(name, policy)))
        if errors:
            raise DocumentError(errors)
        self.models.check(name, policy)
        return policy

    def check_removal(self, name: str) -> list[str]:
        """Why document `name` cannot be removed now (a key over the global cap)."""
        return self.cross_check(self.caps(named=(name, None)))

    def named_version(self, name: str) -> str | None:
        """Document `name`'s version (its ETag), None when there is none."""
        doc = self.models.named.get(name)
        return None if doc is None else version_of(doc.policy.source)

    async def change_named(
        self, name: str, text: str | None, origin: str, if_match: str | None
    ) -> list[str]:
        """A write of document `name` through the admin API (`text` None: remove it).
        `If-Match` must name the running document, or the fleet's with --state-url
        (PreconditionFailed; a document that does not exist matches no tag). The
        errors, empty on success; ModelConflict raised."""
        if self.named_fleet is not None:
            return await self.named_fleet.write_named(name, text, origin, if_match)
        current = self.named_version(name)
        if if_match is not None and (current is None or not matches(if_match, current)):
            raise PreconditionFailed(current or version_of(""))
        if text is None:
            return self.delete_named(name, origin)
        return self.put_named(name, text, origin)

    def install_named(self, name: str, policy: Policy, origin: str) -> None:
        """Run a checked document `policy` as `name`, and say so."""
        self.models.put(name, policy, origin)
        for listener in self.listeners:
            listener(policy, name)
        self.reloads.labels("success").inc()
        log.info(
            "policy_reloaded origin=%s name=%s models=%s chain=[%s]",
            origin,
            quote(name),
            quote(",".join(policy.models)),
            "→".join(policy.chain_names()),
        )
        return []

    def delete_named(self, name: str, origin: str) -> list[str]:
        """Remove document `name` (its models follow the global policy again); the
        errors when a key could not pass the global policy's cap there."""
        errors = self.check_removal(name)
        if errors:
            return self.reject(errors, origin)
        if self.models.delete(name):
            log.info("policy_removed origin=%s name=%s", origin, quote(name))
        return []

    def reload_file(self) -> list[str]:
        if self.model_dir is None:
            return super().reload_file()
        return self.reload_directory(self.model_dir)

    def reload_directory(self, directory: str) -> list[str]:
        """SIGHUP with --policy-model-dir: each changed file on its own, so one bad edit
        keeps that document's running version and spoils nothing else; one line says
        what the reload did, even when it found nothing to change."""
        try:
            found = read_directory(directory)
        except DocumentError as exc:
            return self.reject(exc.errors, "file")
        errors = [self.reject([e], "file")[0] for e in found.errors]
        changed: list[str] = []
        if found.default is not None and found.default != self.current.source:
            failed = self.replace(found.default, "file")
            errors += [f"_default.yaml: {e}" for e in failed]
            changed += [] if failed else ["_default"]
        removed = [
            name
            for name, doc in self.models.named.items()
            if doc.origin == "file" and name not in found.named and name not in found.unreadable
        ]
        for name in removed:
            errors += [f"{name}: {e}" for e in self.delete_named(name, "file")]
        pending = {
            name: text
            for name, text in found.named.items()
            if name not in self.models.named or self.models.named[name].policy.source != text
        }
        # A model moving from one file to another: the file giving it up may come after
        # the one taking it, so a conflict is tried again once the others are in.
        conflicts: dict[str, ModelConflict] = {}
        while pending:
            conflicts = {}
            for name, text in pending.items():
                try:
                    failed = self.put_named(name, text, "file")
                except ModelConflict as exc:
                    conflicts[name] = exc
                    continue
                errors += [f"{name}: {e}" for e in failed]
                changed += [] if failed else [name]
            if len(conflicts) == len(pending):
                break
            pending = {name: pending[name] for name in conflicts}
        for name, exc in conflicts.items():
            errors += [f"{name}: {e}" for e in self.reject([str(exc)], "file")]
        log.info(
            "policy_directory_reloaded directory=%s changed=%s removed=%s rejected=%d documents=%d",
            quote(directory),
            quote(",".join(changed)),
            quote(",".join(n for n in removed if n not in self.models.named)),
            len(errors),
            len(self.models.named),
        )
        return errors

    def parse(self, text: str) -> Policy:
        policy = load_policy(text)
        errors = self.cross_check(self.caps(default=policy))
        if errors:
            raise PolicyError(errors)
        return policy

    def source(self) -> str:
        return self.current.source

    def install(self, value: Policy) -> str:
        self.current = value
        for listener in self.listeners:
            listener(value, None)
        chain = "→".join(value.chain_names())
        return f"chain=[{chain}]"

    def without_file(self) -> list[str]:
        log.warning("policy_reload_skipped origin=file reason=%s", quote("no --policy-file"))
        return ["no --policy-file to reload"]
