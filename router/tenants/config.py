"""Auth files: YAML in, tenant records out, or every reason the file is invalid.

Validated as strictly as policies (unknown keys with a hint, duplicate keys, wrong
types, every problem at once). Keys are stored as `sha256:<hex>` hashes only: the
router never needs a client key in clear, so a leaked auth file leaks no key.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.documents import (
    DocumentError,
    Validator,
    is_number,
    kind,
    parse_document,
    read_document,
)

# A key's own admission limits (`KeyLimits`), the same names in every document that
# describes a key: a `tenants:` entry (for all its keys), an upstream `api.keys` entry,
# and the /admin/api-keys registry.
KEY_LIMIT_FIELDS: tuple[str, ...] = (
    "mode",
    "max_occupancy_share",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "max_input_tokens",
    "images_max",
)
KEY_MODES: tuple[str, ...] = ("reserved", "serverless")
SERVERLESS = "serverless"
TENANT_KEYS: tuple[str, ...] = (
    "keys",
    "models",
    "requests_per_minute",
    "burst",
    "tokens_per_day",
    "max_concurrent",
    "max_input_bytes",
    "priority",
    *KEY_LIMIT_FIELDS,
)
KEY_PREFIX = "hnr-"
HASH_PREFIX = "sha256:"
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
# Names other gateways use for the same limits.
_ALIASES = {
    "rpm": "requests_per_minute",
    "rate_limit": "requests_per_minute",
    "tpd": "tokens_per_day",
    "token_quota": "tokens_per_day",
    "concurrency": "max_concurrent",
    "max_parallel_requests": "max_concurrent",
    "max_input_size": "max_input_bytes",
    "api_keys": "keys",
    "allowed_models": "models",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# The most any count or limit may be. Redis's scripts compute in doubles and pass
# numbers on as `%.17g` text, so a bucket of 10**18 gave EXPIRE "1e+20", a script error,
# and the router took Redis for down (every tenant counted alone); 10**12 keeps every
# sum and expiry exact, and is a trillion tokens or requests, more than any fleet serves.
MAX_LIMIT = 10**12


def hash_key(key: str) -> str:
    """The form an auth file stores. Keys are random and long, so a plain hash suffices."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_id_of(digest: str) -> str:
    """The id of a key that names none (a static key): 12 hex digits of its hash, so
    that every static key has its own admission state and audit identity, and the id
    reveals nothing of the key (48 bits of a SHA-256 of 256 random bits)."""
    return "key-" + digest.removeprefix(HASH_PREFIX)[:12]


@dataclass(frozen=True)
class KeyLimits:
    """What one key may put on the fleet, beside its tenant's shared counts.

    Upstream's serverless fields: `max_occupancy_share` bounds the key's token-weighted
    in-flight footprint to that share of `admit_budget_tokens * healthy replicas`; the
    two per-minute buckets are kept per key and model. They apply when the key's `mode`
    or the model's policy `mode` is `serverless`. `max_input_tokens` and `images_max`
    are the key's B1 caps, checked beside the model policy's in every mode. 0 is
    unlimited everywhere, as upstream.
    """

    mode: str = ""  # "" follows the model policy's `mode`; else one of KEY_MODES
    max_occupancy_share: float = 0.0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    max_input_tokens: int = 0
    images_max: int = 0

    def serverless(self, policy_mode: str) -> bool:
        return (self.mode or policy_mode) == SERVERLESS

    @property
    def any(self) -> bool:
        # Most keys have none: the identity test spares a six-field comparison.
        return self is not NO_LIMITS and self != NO_LIMITS

    def public(self) -> dict[str, Any]:
        return {
            "mode": self.mode or None,
            "max_occupancy_share": self.max_occupancy_share,
            "input_tokens_per_minute": self.input_tokens_per_minute,
            "output_tokens_per_minute": self.output_tokens_per_minute,
            "max_input_tokens": self.max_input_tokens,
            "images_max": self.images_max,
        }


NO_LIMITS = KeyLimits()


@dataclass(frozen=True)
class ApiKey:
    """One client key as admission sees it: who it is (`id`, never the key), whose
    counts it shares (`tenant`), and its own limits, per model where `per_model` names
    the model (upstream's `quota.per_model` entries may carry the serverless fields)."""

    id: str
    key_hash: str
    tenant: str
    name: str = ""
    preview: str = ""
    limits: KeyLimits = NO_LIMITS
    per_model: tuple[tuple[str, KeyLimits], ...] = ()

    def limits_for(self, model: str) -> KeyLimits:
        for name, limits in self.per_model:
            if name == model:
                return limits
        return self.limits


def check_key_limits(validator: Validator, path: str, raw: dict[Any, Any]) -> KeyLimits:
    """The `KEY_LIMIT_FIELDS` of `raw` (a key, tenant or per_model entry), every
    problem reported on `validator` with its path."""
    mode = raw.get("mode")
    if mode is not None and mode not in KEY_MODES:
        validator.error(f"{path}mode", f"must be one of {', '.join(KEY_MODES)}, got {kind(mode)}")
        mode = None
    share = raw.get("max_occupancy_share")
    if share is None:
        share = 0.0
    elif not is_number(share) or not 0.0 <= float(share) <= 1.0:
        validator.error(
            f"{path}max_occupancy_share",
            f"must be a number in (0, 1] (0: unset), got {kind(share)}",
        )
        share = 0.0
    ints = {
        name: validator.integer(f"{path}{name}", raw.get(name), 0, MAX_LIMIT)
        for name in KEY_LIMIT_FIELDS[2:]
    }
    limits = KeyLimits(mode=mode or "", max_occupancy_share=float(share), **ints)
    return NO_LIMITS if limits == NO_LIMITS else limits  # `any` reads identity first


@dataclass(frozen=True)
class Tenant:
    name: str
    # Higher is served first in a per-model queue; what shed_if rules can name.
    priority: int = 0
    key_hashes: tuple[str, ...] = ()
    # Exact names and globs (`meta-llama/*`); empty: every model.
    models: tuple[str, ...] = ()
    requests_per_minute: int = 0  # 0: unlimited
    burst: int = 0  # bucket size; defaults to requests_per_minute
    tokens_per_day: int = 0  # prompt + completion per UTC day; 0: unlimited
    max_concurrent: int = 0  # 0: unlimited
    max_input_bytes: int = 0  # request body size; 0: the router-wide limit only
    # Upstream's `quota.per_model`: model → (requests per minute per healthy replica,
    # tokens per day); its models are then the allowlist, each with its own counts.
    per_model: tuple[tuple[str, int, int], ...] = ()

    def for_model(self, model: str, replicas: int) -> Tenant:
        """The record whose limits and counts apply to a request for `model`. With no
        healthy replica the rate check is skipped (upstream): routing then answers
        with the more accurate availability error."""
        for name, rpm_per_replica, tokens in self.per_model:
            if name == model:
                rpm = rpm_per_replica * replicas
                return Tenant(
                    name=f"{self.name}/{model}",
                    priority=self.priority,
                    requests_per_minute=rpm,
                    burst=burst_of(rpm, self.burst_seconds),
                    tokens_per_day=tokens,
                    max_concurrent=self.max_concurrent,
                    max_input_bytes=self.max_input_bytes,
                )
        return self

    # HIVENET_ROUTER_RPM_BURST_SECONDS for per-model buckets (their rate moves).
    burst_seconds: int = 0
    # A `tenants:` entry's KEY_LIMIT_FIELDS, for each of its keys (each with its own
    # counts: a key's limits are never pooled with another key's).
    key_limits: KeyLimits = NO_LIMITS

    def allows_model(self, model: str) -> bool:
        if self.per_model:
            return any(model == name for name, _, _ in self.per_model)
        return self.lists_model(model)

    def lists_model(self, model: str) -> bool:
        """The `models` allowlist alone (empty: every model)."""
        if not self.models:
            return True
        return any(model == p or fnmatch.fnmatchcase(model, p) for p in self.models)

    @property
    def limited(self) -> bool:
        """Counts to keep (shared over Redis when configured)."""
        return bool(self.requests_per_minute or self.tokens_per_day or self.max_concurrent)

    def public(self) -> dict[str, Any]:
        """The tenant as `GET /admin/auth` shows it: everything but the key hashes."""
        return {
            "name": self.name,
            "keys": len(self.key_hashes),
            "models": list(self.models),
            "requests_per_minute": self.requests_per_minute,
            "burst": self.burst,
            "tokens_per_day": self.tokens_per_day,
            "max_concurrent": self.max_concurrent,
            "max_input_bytes": self.max_input_bytes,
            "priority": self.priority,
        }


def burst_of(rpm: int, seconds: int) -> int:
    """A bucket holding `seconds` of `rpm` (at least 1); 0 seconds: a full minute."""
    return max(1, rpm * seconds // 60) if seconds and rpm else rpm


@dataclass(frozen=True)
class AuthConfig:
    tenants: dict[str, Tenant]
    by_hash: dict[str, Tenant]
    source: str = ""
    # Upstream's auth.yaml: key hash → the first second it is no longer valid.
    expires: dict[str, float] = field(default_factory=dict)
    # Upstream's `api.mode: none`: /v1/* open to every caller (tenant `default`).
    api_open: bool = False
    # Upstream's `api.mode: dynamic`: the client keys are the /admin/api-keys registry's.
    dynamic: bool = False
    # Upstream's `admin.mode` ("none", "api-key"); empty for a `tenants:` file.
    admin_mode: str = ""
    # Valid but probably wrong (a placeholder key hash); check-auth prints them.
    warnings: tuple[str, ...] = ()
    # Key hash → the key's record (its id and own limits); every hash of `by_hash`.
    keys: dict[str, ApiKey] = field(default_factory=dict)

    def key_for(self, key: str, now: float | None = None) -> ApiKey | None:
        """The record of a presented key that is valid now."""
        digest = hash_key(key)
        until = self.expires.get(digest)
        if until is not None and (time.time() if now is None else now) >= until:
            return None
        return self.keys.get(digest)

    def tenant_for_key(self, key: str, now: float | None = None) -> Tenant | None:
        digest = hash_key(key)
        until = self.expires.get(digest)
        if until is not None and (time.time() if now is None else now) >= until:
            return None
        return self.by_hash.get(digest)

    def expired(self, key: str, now: float | None = None) -> bool:
        until = self.expires.get(hash_key(key))
        return until is not None and (time.time() if now is None else now) >= until


class AuthError(DocumentError):
    """An auth file that cannot be loaded; `errors` holds one message per problem."""

    label = "auth file"


def load_auth(text: str, burst_seconds: int = 0) -> AuthConfig:
    """Either shape: this router's `tenants:` or the Go router's `api:`/`admin:`."""
    # Imported here: upstream_auth builds this module's records, so it imports it.
    from router.tenants.upstream_auth import is_upstream, upstream_config

    document, errors = parse_document(text, AuthError)
    if is_upstream(document):
        config = upstream_config(document, text, errors, burst_seconds)
    else:
        validator = _Validator(errors)
        validator.burst_seconds = burst_seconds
        config = validator.config(document, text)
    if errors or config is None:
        raise AuthError(errors)
    return config


def load_auth_file(path: str | Path, burst_seconds: int = 0) -> AuthConfig:
    return load_auth(read_document(path, AuthError, "auth file"), burst_seconds)


class _Validator(Validator):
    burst_seconds = 0

    def config(self, document: object, source: str) -> AuthConfig | None:
        if not isinstance(document, dict):
            self.error("auth", f"must be a mapping with `tenants`, got {kind(document)}")
            return None
        self.unknown_keys("", document, ("tenants",), "unknown top-level key")
        raw = document.get("tenants")
        if not isinstance(raw, dict) or not raw:
            self.error("tenants", f"must be a mapping of tenant names to tenants, got {kind(raw)}")
            return None
        tenants: dict[str, Tenant] = {}
        by_hash: dict[str, Tenant] = {}
        keys: dict[str, ApiKey] = {}
        owner: dict[str, str] = {}
        for name, body in raw.items():
            tenant = self.tenant(str(name), body, owner)
            if tenant is None:
                continue
            tenants[tenant.name] = tenant
            by_hash.update(dict.fromkeys(tenant.key_hashes, tenant))
            for digest in tenant.key_hashes:
                keys[digest] = ApiKey(
                    key_id_of(digest), digest, tenant.name, limits=tenant.key_limits
                )
        return AuthConfig(tenants, by_hash, source, keys=keys)

    def tenant(self, name: str, raw: object, owner: dict[str, str]) -> Tenant | None:
        """The tenant, or None when it has errors. `owner` maps each key hash seen so
        far to its tenant, valid or not, so that no other error hides a shared key."""
        path = f"tenants.{name}"
        before = len(self.errors)
        if not _NAME.match(name):
            self.error(path, "tenant names are 1-64 letters, digits, `.`, `_` or `-`")
        if not isinstance(raw, dict):
            self.error(path, f"must be a mapping with at least `keys`, got {kind(raw)}")
            return None
        self.unknown_keys(f"{path}.", raw, TENANT_KEYS, "unknown tenant key", aliases=_ALIASES)
        keys = self.key_hashes(f"{path}.keys", raw.get("keys"))
        models = self.models(f"{path}.models", raw.get("models"))
        ints = {
            field: self.integer(f"{path}.{field}", raw.get(field), low, MAX_LIMIT)
            for field, low in (
                ("requests_per_minute", 1),
                ("burst", 1),
                ("tokens_per_day", 1),
                ("max_concurrent", 1),
                ("max_input_bytes", 1),
            )
        }
        priority = self.integer(f"{path}.priority", raw.get("priority"), -1000, 1000)
        limits = check_key_limits(self, f"{path}.", raw)
        if ints["burst"] and not ints["requests_per_minute"]:
            self.error(f"{path}.burst", "needs requests_per_minute (the bucket's refill rate)")
        for digest in keys:
            if digest in owner:
                self.error(
                    f"{path}.keys", f"key {digest[:19]}… is also a key of tenant {owner[digest]!r}"
                )
            owner[digest] = name
        if len(self.errors) > before:
            return None
        return Tenant(
            name=name,
            priority=priority,
            key_hashes=keys,
            models=models,
            requests_per_minute=ints["requests_per_minute"],
            burst=ints["burst"] or burst_of(ints["requests_per_minute"], self.burst_seconds),
            tokens_per_day=ints["tokens_per_day"],
            max_concurrent=ints["max_concurrent"],
            max_input_bytes=ints["max_input_bytes"],
            key_limits=limits,
        )

    def key_hashes(self, path: str, raw: object) -> tuple[str, ...]:
        if not isinstance(raw, list) or not raw:
            self.error(
                path,
                "must be a list of key hashes (`hivenet-router hash-key` prints one),"
                f" got {kind(raw)}",
            )
            return ()
        out: list[str] = []
        for i, value in enumerate(raw):
            if not isinstance(value, str) or not _HASH.match(value):
                clear = isinstance(value, str) and value.startswith(KEY_PREFIX)
                shown = "a key in clear" if clear else kind(value)
                self.error(
                    f"{path}[{i}]",
                    "must be `sha256:` and 64 lowercase hex digits"
                    f" (from `hivenet-router hash-key`), got {shown}",
                )
            elif value in out:
                self.error(f"{path}[{i}]", "listed twice")
            else:
                out.append(value)
        return tuple(out)

    def models(self, path: str, raw: object) -> tuple[str, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list) or not raw:
            self.error(path, f"must be a non-empty list of model names or globs, got {kind(raw)}")
            return ()
        for i, value in enumerate(raw):
            if not isinstance(value, str) or not value:
                self.error(f"{path}[{i}]", f"must be a non-empty string, got {kind(value)}")
        return tuple(v for v in raw if isinstance(v, str) and v)
