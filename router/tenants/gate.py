"""Tenants at the door: who is calling, may they, and what their request cost.

The HTTP layer asks `TenantGate.identify` for the tenant of the keys a caller presented
and opens a `Ticket` per inference request; the client API admits the ticket once the
model is known, the ticket records where the request went, the engine's token usage
and the error code the client got, and closing it gives back the concurrent slot and
charges the tokens. `TenantGate.audit` writes the ticket's audit line.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from protocol.errors import ErrorCode, RouterError
from protocol.logs import quote
from protocol.usage import COMPLETION, PROMPT
from router.documents import DocumentStore
from router.metrics import RouterMetrics
from router.tenants.audit import AdminRecord, AuditLog, AuditRecord, audit_admin
from router.tenants.config import (
    ApiKey,
    AuthConfig,
    AuthError,
    Tenant,
    hash_key,
    key_id_of,
    load_auth,
    load_auth_file,
)
from router.tenants.counters import Verdict, until_midnight
from router.tenants.keys import DEFAULT_TENANT, ClientKeys
from router.tenants.registry import KeyRegistry
from router.tenants.shared import TenantState

log = logging.getLogger("tenant")


@dataclass(frozen=True)
class TenantRefused(RouterError):
    """A tenant limit; 429s say when to come back (`retry_after`)."""


class AuthStore(DocumentStore[AuthConfig]):
    """The running auth file and its reloads."""

    kind = "auth"
    noun = "auth file"
    title = "auth file"

    def __init__(self, metrics: RouterMetrics, path: str | None, burst_seconds: int = 0) -> None:
        super().__init__(metrics.auth_reloads, log, path)
        self.burst_seconds = burst_seconds
        # The policies' side of the serverless cross-check (router/admission/crosscheck.py):
        # the errors a set of keys would give; the daemon points it at its policies.
        self.cross_check: Callable[[AuthConfig], list[str]] = lambda config: []
        # At start-up a bad file is fatal (AuthError names every problem).
        self.current: AuthConfig | None = load_auth_file(path, burst_seconds) if path else None
        if self.current is not None:
            self._warn(self.current)

    def parse(self, text: str) -> AuthConfig:
        config = load_auth(text, self.burst_seconds)
        errors = self.cross_check(config)
        if errors:
            raise AuthError(errors)
        return config

    def _warn(self, config: AuthConfig) -> None:
        for warning in config.warnings:
            log.warning("auth_warning %s", quote(warning))

    def source(self) -> str:
        return self.current.source if self.current is not None else ""

    def install(self, value: AuthConfig) -> str:
        self.current = value
        self._warn(value)
        return f"tenants={len(value.tenants)}"


@dataclass
class GateSettings:
    auth_file: str | None = None
    state_url: str | None = None
    audit_log: str | None = None
    audit_log_max_bytes: int = 100 * 1024 * 1024
    audit_log_backups: int = 5
    # How long a router's in-flight entry may outlive a crash of that router.
    lease: float = 120.0
    # HIVENET_ROUTER_RPM_BURST_SECONDS (0: a bucket holds a full minute).
    rpm_burst_seconds: int = 0


class TenantGate:
    def __init__(
        self, settings: GateSettings, client_keys: ClientKeys, metrics: RouterMetrics
    ) -> None:
        self.client_keys = client_keys
        self.metrics = metrics
        self.store = AuthStore(metrics, settings.auth_file, settings.rpm_burst_seconds)
        # Healthy agents of a model: upstream's per-model RPM is per replica. The daemon
        # points it at its table; alone, a gate counts one replica.
        self.replicas: Callable[[str], int] = lambda model: 1
        self.state = TenantState(settings.state_url, metrics, settings.lease)
        # Dynamic mode: the /admin/api-keys registry holds the client keys.
        self.registry: KeyRegistry | None = None
        # HIVENET_ROUTER_API_KEYS keys seen so far → their records (at most one per key).
        self._static: dict[str, ApiKey] = {}
        self.audit_log = (
            AuditLog(settings.audit_log, settings.audit_log_max_bytes, settings.audit_log_backups)
            if settings.audit_log
            else None
        )
        # Tenant → its (prompt, completion) token counters: `labels()` costs about
        # 2.5 µs a call, twice a request that reports usage.
        self._token_counters: dict[str, tuple[Any, Any]] = {}
        # In-flight entry ids: unique across routers by this process's prefix, and
        # cheaper than 6 random bytes a request (about 1 µs).
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(6)

    def entry_id(self, request_id: str) -> str:
        return f"{request_id}:{self._id_prefix}{next(self._ids):x}"

    def count_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        counters = self._token_counters.get(tenant)
        if counters is None:
            if len(self._token_counters) > 10_000:  # tenants come and go with reloads
                self._token_counters.clear()
            tokens_total = self.metrics.tenant_tokens
            counters = self._token_counters[tenant] = (
                tokens_total.labels(tenant, "prompt"),
                tokens_total.labels(tenant, "completion"),
            )
        counters[0].inc(prompt)
        counters[1].inc(completion)

    @property
    def config(self) -> AuthConfig | None:
        """The keys in force: the registry's in dynamic mode, else the auth file's."""
        return self.registry.current.config if self.registry is not None else self.store.current

    def identify(self, keys: list[str]) -> str | None:
        """The tenant of the presented `keys`, or None when a key is required and none
        matches."""
        return self.identify_key(keys)[0]

    def identify_key(self, keys: list[str]) -> tuple[str | None, ApiKey | None]:
        """The tenant and the record of the key that matched; no record when no key is
        needed. A key of HIVENET_ROUTER_API_KEYS gets a record of its own too (its id
        from its hash), so no two keys ever share admission state or an audit identity."""
        config = self.config
        if config is None:
            tenant = self.client_keys.tenant(keys)
            if tenant is None or not self.client_keys.required:
                return tenant, None
            for key in keys:
                if self.client_keys.tenant([key]) is not None:
                    return tenant, self._static_key(key, tenant)
            return tenant, None
        if config.api_open:
            return DEFAULT_TENANT, None
        for key in keys:
            record = config.key_for(key)
            if record is not None:
                return record.tenant, record
        return None, None

    def _static_key(self, key: str, tenant: str) -> ApiKey:
        record = self._static.get(key)
        if record is None or record.tenant != tenant:
            digest = hash_key(key)
            record = self._static[key] = ApiKey(key_id_of(digest), digest, tenant)
        return record

    def expired(self, keys: list[str]) -> bool:
        """Whether a presented key is one of the file's, past its `expires_at`."""
        config = self.config
        return config is not None and any(config.expired(key) for key in keys)

    def tenant(self, name: str, key: ApiKey | None = None) -> Tenant | None:
        """The record that applies to a caller: its key's (the owner's limits with the
        key's own `models`), else the tenant's."""
        config = self.config
        if config is None:
            return None
        if key is not None:
            record = config.by_hash.get(key.key_hash)
            if record is not None:
                return record
        return config.tenants.get(name)

    def open(self, request_id: str, tenant: str, key: ApiKey | None = None) -> Ticket | None:
        """A ticket for an inference request; None when nothing counts."""
        if self.config is None and self.audit_log is None:
            return None
        record = self.tenant(tenant, key)
        return Ticket(self, request_id, tenant, record, trio.current_time())

    def audit(
        self,
        ticket: Ticket | None,
        endpoint: str,
        request_id: str,
        tenant: str,
        status: int,
        duration: float,
        trace_id: str | None = None,
        key_id: str | None = None,
        source_ip: str | None = None,
    ) -> None:
        """A `/v1/*` call's audit line; `key_id` and `source_ip` are for a call without
        a ticket (model discovery), a ticket holds its own."""
        if self.audit_log is None:
            return
        usage = ticket.usage if ticket is not None else None
        self.audit_log.write(
            AuditRecord(
                request_id=request_id,
                tenant=tenant,
                endpoint=endpoint,
                model=ticket.model if ticket else None,
                step=ticket.step if ticket else None,
                agent=ticket.agent if ticket else None,
                status=status,
                prompt_tokens=usage[PROMPT] if usage else None,
                completion_tokens=usage[COMPLETION] if usage else None,
                duration_s=duration,
                code=ticket.code if ticket else None,
                trace_id=trace_id,
                key_id=ticket.key_id if ticket else key_id,
                source_ip=ticket.source_ip if ticket else source_ip,
                gate=ticket.refused_by if ticket else None,
            )
        )

    def audit_admin(self, record: AdminRecord) -> None:
        """An admin call's audit line (the /admin/api-keys writes, key rotations)."""
        audit_admin(self.audit_log, record)

    def health(self) -> dict[str, Any]:
        """`/health` fields: where the tenant counts live, when Redis is configured."""
        if self.state.client is None:
            return {}
        return {"state_store": self.state.mode}

    def admin_view(self) -> dict[str, Any]:
        config = self.store.current
        return {
            "auth_file": self.store.path,
            "state_store": self.state.mode,
            "version": self.store.version(),
            "tenants": [] if config is None else [t.public() for t in config.tenants.values()],
        }

    async def run(self) -> None:
        await self.state.watch()

    def close(self) -> None:
        self.state.close()
        if self.audit_log is not None:
            self.audit_log.close()


class Ticket:
    __slots__ = (
        "agent",
        "charged",
        "closed",
        "code",
        "day",
        "discarded",
        "gate",
        "id",
        "key_id",
        "model",
        "record",
        "refused_by",
        "remaining",
        "request_id",
        "served",
        "shared",
        "slot_taken",
        "source_ip",
        "started",
        "step",
        "tenant",
        "usage",
    )

    def __init__(
        self, gate: TenantGate, request_id: str, tenant: str, record: Tenant | None, started: float
    ) -> None:
        self.gate = gate
        self.request_id = request_id
        self.tenant = tenant
        self.record = record
        self.started = started
        # X-Request-ID comes from clients and may repeat: the in-flight entry's own id.
        self.id = gate.entry_id(request_id)
        self.model: str | None = None
        self.step: str | None = None
        self.agent: str | None = None
        self.usage: dict[str, int] | None = None
        self.code: str | None = None
        # (requests, tokens) an admitted request leaves: X-RateLimit-Remaining-*.
        self.remaining: tuple[int | None, int | None] = (None, None)
        self.slot_taken = False
        self.shared = False
        self.closed = False
        # Tokens of the day taken at admission (the input estimate), trued up at close.
        self.charged = 0
        self.day = ""  # the UTC day `charged` went to (Verdict.day)
        self.served = False
        self.key_id: str | None = None
        self.source_ip: str | None = None
        # The admission gate that refused the request (b1, b2, b4_*), for the audit line.
        self.refused_by: str | None = None
        # A whole answer over the day's budget, discarded (`refuse_whole_answer`).
        self.discarded = False

    @property
    def counts_tokens(self) -> bool:
        """Whether a daily token budget applies (it needs the input estimate)."""
        record = self.record
        return record is not None and bool(
            record.tokens_per_day or any(tokens for _, _, tokens in record.per_model)
        )

    @property
    def wants_usage(self) -> bool:
        return self.gate.audit_log is not None or bool(
            self.record is not None and self.record.tokens_per_day
        )

    async def admit(
        self, model: str, body_bytes: int, need: int = 0, charge: int = 0, output: int = 0
    ) -> TenantRefused | None:
        """The tenant's checks; `need` (the input estimate and declared output, `output`
        of it) must fit in the day's tokens, and `charge` (the input estimate) is taken
        now."""
        self.model = model
        tenant = self.record
        if tenant is None:
            return None
        refusal: TenantRefused | None = None
        if not tenant.allows_model(model):
            # Upstream's codes and words: the allowlist is 403; a model the allowlist
            # lets through that `quota.per_model` does not declare is 429.
            if tenant.per_model and tenant.lists_model(model):
                refusal = TenantRefused(
                    ErrorCode.RATE_LIMITED,
                    f"no quota declared for model {model} on this API key",
                )
            else:
                refusal = TenantRefused(
                    ErrorCode.MODEL_NOT_ALLOWED,
                    f"your API key does not have access to model: {model}",
                )
        elif tenant.max_input_bytes and body_bytes > tenant.max_input_bytes:
            refusal = TenantRefused(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"request body of {body_bytes} bytes exceeds tenant {tenant.name!r}'s"
                f" max_input_bytes ({tenant.max_input_bytes})",
            )
        elif (
            # The healthy replicas count (a pass over the model's agents) only for the
            # per-model rates that scale by it.
            tenant := tenant.for_model(model, self.gate.replicas(model))
            if tenant.per_model
            else tenant
        ).limited:
            self.record = tenant
            verdict, self.shared = await self.gate.state.admit(tenant, self.id, need, charge)
            # Sent on the answer, a refusal's included (upstream's headers on a 429).
            self.remaining = (verdict.requests_left, verdict.tokens_left)
            if verdict.code is not None:
                refusal = TenantRefused(
                    verdict.code,
                    _refusal_message(tenant, verdict, need, output),
                    retry_after=verdict.retry_after,
                )
            else:
                self.slot_taken = bool(tenant.max_concurrent)
                self.charged = charge if tenant.tokens_per_day else 0
                self.day = verdict.day
        if refusal is not None:
            self.code = str(refusal.code)
            self.gate.metrics.tenant_rejections.labels(tenant.name, self.code).inc()
            log.info(
                "req=%s tenant=%s tenant_limit code=%s model=%s retry_after_s=%s",
                self.request_id,
                quote(tenant.name),
                self.code,
                quote(model),
                "-" if refusal.retry_after is None else f"{refusal.retry_after:.3f}",
            )
        return refusal

    async def refuse_whole_answer(self, usage: dict[str, int] | None) -> TenantRefused | None:
        """A whole (non-stream) answer's refusal when its usage no longer fits in the
        day's token budget, as upstream: the answer is then discarded (429
        `token_limit_exceeded`), the admission's input estimate stays charged and the
        exact usage goes only to the audit line. None when it fits, or nothing counts
        (a stream cannot be taken back: it is charged when it ends)."""
        tenant = self.record
        if tenant is None or not tenant.tokens_per_day or not usage or not self.day:
            return None
        exact = usage[PROMPT] + usage[COMPLETION]
        # `used` holds this request's estimate already, and what others spent since.
        used = await self.gate.state.used(tenant.name, self.day, self.shared)
        if used - self.charged + exact <= tenant.tokens_per_day:
            return None
        self.discarded = True
        self.usage = usage
        before = max(0, tenant.tokens_per_day - (used - self.charged))
        self.remaining = (self.remaining[0], 0)  # upstream's header on this refusal
        self.code = str(ErrorCode.QUOTA_EXCEEDED)
        self.gate.metrics.tenant_rejections.labels(tenant.name, self.code).inc()
        log.info(
            "req=%s tenant=%s tenant_limit code=%s model=%s answer_discarded tokens=%d",
            self.request_id,
            quote(tenant.name),
            self.code,
            quote(self.model or "-"),
            exact,
        )
        return TenantRefused(
            ErrorCode.QUOTA_EXCEEDED,
            f"daily token budget exceeded: the answer took {exact} tokens, tenant"
            f" {tenant.name!r} had {before} of {tenant.tokens_per_day} left"
            " today (UTC); the answer was discarded",
            retry_after=until_midnight(time.time()),
        )

    def answered_with(self, code: ErrorCode) -> None:
        """The error code the client got (a refusal, or the error that cut its stream)."""
        self.code = str(code)

    def served_by(self, step: str, agent: str) -> None:
        self.step, self.agent = step, agent
        self.served = True

    def provider_answer(self, engine: str, usage: dict[str, int] | None) -> None:
        self.step, self.agent = "fallback_provider", f"provider:{engine}"
        self.usage = usage
        self.served = True

    async def close(self) -> None:
        """Give back the concurrent slot and charge the tokens; exactly once."""
        if self.closed:
            return
        self.closed = True
        usage = self.usage
        # Without the engine's count, a served request keeps its estimate's charge and
        # one that never reached an engine gives it back.
        exact = usage[PROMPT] + usage[COMPLETION] if usage else None
        spent = exact if exact is not None else (self.charged if self.served else 0)
        if self.discarded:
            spent = self.charged  # upstream: the input estimate stays, nothing more
        tokens = spent - self.charged
        if usage:
            self.gate.count_tokens(self.tenant, usage[PROMPT], usage[COMPLETION])
        tenant = self.record
        if tenant is None or not (self.slot_taken or (tokens and tenant.tokens_per_day)):
            return
        state = self.gate.state
        if state.release_now(tenant.name, self.id, tokens, self.shared, self.day):
            return  # no call: no shielded scope either (about 4 µs a request)
        with trio.CancelScope(shield=True):
            await state.release(tenant.name, self.id, tokens, self.shared, self.day)


def _refusal_message(t: Tenant, verdict: Verdict, need: int, output: int = 0) -> str:
    if verdict.code is ErrorCode.RATE_LIMITED:
        return (
            f"tenant {t.name!r} is over its rate limit of {t.requests_per_minute} requests"
            f" per minute (burst {t.burst})"
        )
    if verdict.code is ErrorCode.QUOTA_EXCEEDED:
        left = verdict.tokens_left
        if left and output:
            # Upstream's words: the request's own estimate and max_tokens are over what
            # the day has left, which the header says.
            return (
                f"insufficient daily token budget for requested max_tokens: this request"
                f" may take {need} tokens, tenant {t.name!r} has {left} of"
                f" {t.tokens_per_day} left today (UTC)"
            )
        if left:
            # No max_tokens was sent: the input alone does not fit.
            return (
                f"daily token budget exceeded: this request's input may take {need} tokens,"
                f" tenant {t.name!r} has {left} of {t.tokens_per_day} left today (UTC)"
            )
        return (
            f"daily token budget exceeded: tenant {t.name!r} has used its"
            f" {t.tokens_per_day} tokens for today (UTC)"
        )
    return f"tenant {t.name!r} already has {t.max_concurrent} requests in flight"
