"""The Go router's auth.yaml (`api:`/`admin:` sections, keys with bare-hex hashes,
`metadata.owner` as the tenant), read into the same records as a `tenants:` file.

Keys that share an owner share one tenant and its counts, as upstream; where upstream
lets two such keys carry different limits on one bucket ("can produce confusing
behaviour"), this loader refuses the file and names both keys. A key's `models`
allowlist is its own (upstream's allowlists are per key): each key's record in
`AuthConfig.by_hash` is its owner's tenant with that key's list.
"""

from __future__ import annotations

import calendar
import hashlib
import re
import secrets
import time
from dataclasses import replace
from typing import Any

from router.documents import Validator, kind, shown
from router.tenants.config import (
    HASH_PREFIX,
    MAX_LIMIT,
    ApiKey,
    AuthConfig,
    KeyLimits,
    Tenant,
    burst_of,
    check_key_limits,
    key_id_of,
)

TOP_KEYS: tuple[str, ...] = ("api", "admin")
API_KEYS: tuple[str, ...] = ("mode", "keys")
ADMIN_KEYS: tuple[str, ...] = ("mode",)
# `max_occupancy_share` is upstream's; `mode`, `max_input_tokens` and `images_max` this
# router's (KEY_LIMIT_FIELDS), so a key can be serverless or capped on its own.
KEY_KEYS: tuple[str, ...] = (
    "key_hash",
    "key_preview",
    "metadata",
    "models",
    "quota",
    "mode",
    "max_occupancy_share",
    "max_input_tokens",
    "images_max",
)
# The per-minute token buckets sit in `quota` upstream, beside the key's other rates.
KEY_QUOTA_LIMITS: tuple[str, ...] = ("input_tokens_per_minute", "output_tokens_per_minute")
METADATA_KEYS: tuple[str, ...] = ("name", "owner", "description", "created_at", "expires_at")
# The flat quota, and this router's own limits accepted beside it.
QUOTA_KEYS: tuple[str, ...] = (
    "requests_per_minute",
    "tokens_per_day",
    "per_model",
    "burst",
    "max_concurrent",
    "max_input_bytes",
    *KEY_QUOTA_LIMITS,
)
PER_MODEL_KEYS: tuple[str, ...] = ("requests_per_minute_per_replica", "tokens_per_day")
# Optional in a per_model entry: that model's serverless limits for this key.
PER_MODEL_LIMITS: tuple[str, ...] = ("max_occupancy_share", *KEY_QUOTA_LIMITS)
_HEX = re.compile(r"^(sha256:)?[0-9a-f]{64}$")
_DATE = re.compile(r"^(\d{2})-(\d{2})-(\d{4})$")
KEY_PREFIX = "sk-hivenet-"
MAX_TENANT_NAME = 200


def is_upstream(document: object) -> bool:
    return (
        isinstance(document, dict)
        and "tenants" not in document
        and any(key in document for key in TOP_KEYS)
    )


def upstream_config(
    document: dict[Any, Any], source: str, errors: list[str], burst_seconds: int
) -> AuthConfig | None:
    return _Upstream(errors, burst_seconds).config(document, source)


def upstream_key(
    errors: list[str], burst_seconds: int, path: str, raw: dict[Any, Any]
) -> tuple[Any, ...] | None:
    """One `api.keys` entry checked as an auth file's are (the /admin/api-keys registry
    writes its entries in this shape): the key's hash and tenant first, or None."""
    return _Upstream(errors, burst_seconds).key(path, raw)


def end_of_day(text: str) -> float | None:
    """`DD-MM-YYYY` → the first second (UTC) after that day; None when not a date."""
    m = _DATE.match(text)
    if m is None:
        return None
    day, month, year = (int(g) for g in m.groups())
    try:
        start = calendar.timegm(time.strptime(f"{year:04d}-{month:02d}-{day:02d}", "%Y-%m-%d"))
    except ValueError:
        return None
    return float(start + 86400)


# Bitcoin's Base58 alphabet: no 0, O, I or l, so a key read aloud or retyped survives.
BASE58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def base58(data: bytes) -> str:
    """`data` in Base58 (Bitcoin's alphabet): the bytes as one big-endian number in
    base 58, each leading zero byte kept as a `1`, as Bitcoin's addresses and
    upstream's keys have it."""
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, digit = divmod(number, 58)
        digits.append(BASE58_ALPHABET[digit])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(digits))


def new_upstream_key() -> str:
    """Upstream's key shape: `sk-hivenet-` and 32 random bytes in Base58 (mostly 44
    characters: 256 bits at 5.86 bits a character)."""
    return KEY_PREFIX + base58(secrets.token_bytes(32))


def preview(key: str) -> str:
    return f"sk-...{key[-4:]}"


def keygen_entry(tenant: str) -> str:
    """What `hivenet-router keygen` prints: the key once, its hash, and an entry."""
    if not tenant.strip() or len(tenant) > MAX_TENANT_NAME or '"' in tenant or "\n" in tenant:
        raise ValueError(f"--tenant must be 1-{MAX_TENANT_NAME} characters, without quotes")
    key = new_upstream_key()
    digest = hashlib.sha256(key.encode()).hexdigest()
    today = time.strftime("%d-%m-%Y", time.gmtime())
    return (
        f"key: {key}\n"
        f"hash: {digest}\n"
        f"preview: {preview(key)}\n"
        "\n"
        "# auth.yaml entry, under api.keys (store the key itself in a secret manager):\n"
        f'- key_hash: "{digest}"\n'
        f'  key_preview: "{preview(key)}"\n'
        "  metadata:\n"
        f'    name: "{tenant} key"\n'
        f'    owner: "{tenant}"\n'
        '    description: ""\n'
        f'    created_at: "{today}"\n'
        "  quota:\n"
        "    requests_per_minute: 100\n"
        "    tokens_per_day: 500000\n"
    )


class _Upstream(Validator):
    def __init__(self, errors: list[str], burst_seconds: int) -> None:
        super().__init__(errors)
        self.burst_seconds = burst_seconds
        self.warnings: list[str] = []

    def config(self, document: dict[Any, Any], source: str) -> AuthConfig | None:
        self.unknown_keys("", document, TOP_KEYS, "unknown top-level key")
        admin = document.get("admin")
        admin_mode = ""
        if admin is not None:
            if not isinstance(admin, dict):
                self.error("admin", f"must be a mapping with `mode`, got {kind(admin)}")
            else:
                self.unknown_keys("admin.", admin, ADMIN_KEYS, "unknown admin key")
                admin_mode = self.mode("admin.mode", admin.get("mode"), ("none", "api-key"))
        api = document.get("api")
        if api is None:
            # Only `admin:`: the client API stays as open as upstream leaves it.
            return AuthConfig({}, {}, source, api_open=True, admin_mode=admin_mode)
        if not isinstance(api, dict):
            self.error("api", f"must be a mapping with `mode` and `keys`, got {kind(api)}")
            return None
        self.unknown_keys("api.", api, API_KEYS, "unknown api key")
        mode = self.mode("api.mode", api.get("mode"), ("none", "api-key", "dynamic"))
        raw_keys = api.get("keys")
        if mode == "dynamic":
            if raw_keys:
                self.error("api.keys", "not read in dynamic mode: /admin/api-keys holds the keys")
            # The registry holds the keys, so the admin API must be protected.
            return AuthConfig({}, {}, source, admin_mode="api-key", dynamic=True)
        if mode == "none":
            if raw_keys:
                self.error("api.keys", "not read when api.mode is none: remove them or use api-key")
            return AuthConfig({}, {}, source, api_open=True, admin_mode=admin_mode)
        if not isinstance(raw_keys, list) or not raw_keys:
            self.error(
                "api.keys",
                "api.mode api-key needs a non-empty list of keys (`hivenet-router keygen`"
                f" prints one), got {kind(raw_keys)}",
            )
            return None
        tenants: dict[str, Tenant] = {}
        first_key: dict[str, int] = {}
        by_hash: dict[str, Tenant] = {}
        keys: dict[str, ApiKey] = {}
        expires: dict[str, float] = {}
        for i, raw in enumerate(raw_keys):
            entry = self.key(f"api.keys[{i}]", raw)
            if entry is None:
                continue
            digest, tenant, until, key = entry
            if digest in by_hash:
                self.error(f"api.keys[{i}].key_hash", "listed twice (each key once)")
                continue
            known = tenants.get(tenant.name)
            if known is not None and shared_limits(known) != shared_limits(tenant):
                self.error(
                    f"api.keys[{i}]",
                    f"owner {tenant.name!r} is also api.keys[{first_key[tenant.name]}] with"
                    " another quota; keys of one owner share one bucket, so give them the"
                    " same quota (each key's models may differ)",
                )
                continue
            if known is None:
                first_key[tenant.name] = i
                known = tenants[tenant.name] = tenant
            known = tenants[tenant.name] = _with_key(known, digest)
            by_hash[digest] = tenant  # for its models: the final record comes below
            keys[digest] = key
            if until is not None:
                expires[digest] = until
        # Each key's record must be the tenant's final one (with every key hash), with
        # the key's own models.
        by_hash = {digest: with_models(tenants[t.name], t.models) for digest, t in by_hash.items()}
        return AuthConfig(
            tenants,
            by_hash,
            source,
            expires=expires,
            admin_mode=admin_mode,
            warnings=tuple(self.warnings),
            keys=keys,
        )

    def mode(self, path: str, raw: object, allowed: tuple[str, ...]) -> str:
        if not isinstance(raw, str) or raw not in allowed:
            self.error(path, f"must be one of {', '.join(allowed)}, got {kind(raw)}")
            return ""
        return raw

    def key(self, path: str, raw: object) -> tuple[str, Tenant, float | None, ApiKey] | None:
        if not isinstance(raw, dict):
            self.error(path, f"must be a mapping with key_hash and metadata, got {kind(raw)}")
            return None
        before = len(self.errors)
        self.unknown_keys(f"{path}.", raw, KEY_KEYS, "unknown key field")
        digest = self.key_hash(f"{path}.key_hash", raw.get("key_hash"))
        preview_value = raw.get("key_preview")
        if preview_value is not None and not isinstance(preview_value, str):
            self.error(f"{path}.key_preview", f"must be a string, got {kind(preview_value)}")
        owner, until = self.metadata(f"{path}.metadata", raw.get("metadata"))
        models = self.models(f"{path}.models", raw.get("models"))
        quota = self.quota(f"{path}.quota", raw.get("quota"))
        limits = check_key_limits(self, f"{path}.", {k: raw[k] for k in KEY_KEYS[5:] if k in raw})
        if isinstance(raw.get("quota"), dict):
            rates = {k: raw["quota"][k] for k in KEY_QUOTA_LIMITS if k in raw["quota"]}
            own = check_key_limits(self, f"{path}.quota.", rates)
            limits = replace(
                limits,
                input_tokens_per_minute=own.input_tokens_per_minute,
                output_tokens_per_minute=own.output_tokens_per_minute,
            )
        if len(self.errors) > before or quota is None:
            return None
        rpm = quota["requests_per_minute"]
        tenant = Tenant(
            name=owner,
            models=models,
            requests_per_minute=rpm,
            burst=quota["burst"] or burst_of(rpm, self.burst_seconds),
            tokens_per_day=quota["tokens_per_day"],
            max_concurrent=quota["max_concurrent"],
            max_input_bytes=quota["max_input_bytes"],
            per_model=quota["per_model"],
            burst_seconds=self.burst_seconds,
        )
        name = raw["metadata"].get("name", "")
        per_model = tuple(
            (
                model,
                KeyLimits(
                    limits.mode,
                    share or limits.max_occupancy_share,
                    itpm,
                    otpm,
                    limits.max_input_tokens,
                    limits.images_max,
                ),
            )
            for model, share, itpm, otpm in quota["per_model_limits"]
        )
        key = ApiKey(
            key_id_of(digest),
            digest,
            owner,
            name=name,
            preview=preview_value or "",
            limits=limits,
            per_model=per_model,
        )
        return digest, tenant, until, key

    def key_hash(self, path: str, raw: object) -> str:
        if not isinstance(raw, str) or not raw:
            self.error(path, f"missing (required: the key's SHA-256 in hex), got {kind(raw)}")
            return ""
        if raw.startswith(KEY_PREFIX):
            self.error(path, "is a key in clear: store its SHA-256 (`hivenet-router keygen`)")
            return ""
        if _HEX.match(raw):
            return raw if raw.startswith(HASH_PREFIX) else HASH_PREFIX + raw
        # Upstream's example file ships a placeholder here; it loads there and matches
        # no key. Loading it too keeps that file working, and check-auth says so.
        self.warnings.append(
            f"{path}: {shown(raw)} is not a SHA-256 in hex, so no key can match it"
            " (`hivenet-router keygen` prints a real one)"
        )
        return HASH_PREFIX + raw

    def metadata(self, path: str, raw: object) -> tuple[str, float | None]:
        if not isinstance(raw, dict):
            self.error(path, f"missing (required: a mapping with name and owner), got {kind(raw)}")
            return "", None
        self.unknown_keys(f"{path}.", raw, METADATA_KEYS, "unknown metadata field")
        self.required_string(f"{path}.name", raw, "a label for the key")
        owner = self.required_string(f"{path}.owner", raw, "the tenant the key belongs to")
        if len(owner) > MAX_TENANT_NAME:
            self.error(f"{path}.owner", f"at most {MAX_TENANT_NAME} characters")
        for name in ("description", "created_at"):
            value = raw.get(name)
            if value is not None and not isinstance(value, str):
                self.error(f"{path}.{name}", f"must be a string, got {kind(value)}")
        expires = raw.get("expires_at")
        if expires is None or expires == "":
            return owner, None
        until = end_of_day(expires) if isinstance(expires, str) else None
        if until is None:
            self.error(
                f"{path}.expires_at",
                f"must be a date as DD-MM-YYYY (the last valid day, UTC), got {kind(expires)}",
            )
        return owner, until

    def models(self, path: str, raw: object) -> tuple[str, ...]:
        if raw is None or raw == []:
            return ()
        if not isinstance(raw, list):
            self.error(path, f"must be a list of model names, got {kind(raw)}")
            return ()
        for i, value in enumerate(raw):
            if not isinstance(value, str) or not value:
                self.error(f"{path}[{i}]", f"must be a non-empty string, got {kind(value)}")
        return tuple(v for v in raw if isinstance(v, str) and v)

    def quota(self, path: str, raw: object) -> dict[str, Any] | None:
        out: dict[str, Any] = dict.fromkeys(
            ("requests_per_minute", "tokens_per_day", "burst", "max_concurrent"), 0
        )
        out["max_input_bytes"] = 0
        out["per_model"] = ()
        out["per_model_limits"] = ()
        if raw is None:
            return out
        if not isinstance(raw, dict):
            self.error(path, f"must be a mapping of limits, got {kind(raw)}")
            return None
        self.unknown_keys(f"{path}.", raw, QUOTA_KEYS, "unknown quota field")
        # Upstream's 0 is "unlimited", as an absent field.
        for name in ("requests_per_minute", "tokens_per_day"):
            out[name] = self.integer(f"{path}.{name}", raw.get(name), 0, MAX_LIMIT)
        for name in ("burst", "max_concurrent", "max_input_bytes"):
            out[name] = self.integer(f"{path}.{name}", raw.get(name), 1, MAX_LIMIT)
        if out["burst"] and not out["requests_per_minute"]:
            self.error(f"{path}.burst", "needs requests_per_minute (the bucket's refill rate)")
        per_model = raw.get("per_model")
        if per_model is not None:
            if out["requests_per_minute"] or out["tokens_per_day"]:
                self.error(
                    f"{path}.per_model",
                    "cannot be combined with the flat requests_per_minute/tokens_per_day",
                )
            # Upstream refuses these beside per_model too, where they would otherwise
            # vanish silently (a per_model entry's own rates replace them).
            for name in KEY_QUOTA_LIMITS:
                if raw.get(name, 0) != 0:
                    self.error(
                        f"{path}.{name}",
                        "cannot be combined with quota.per_model: set it in each"
                        f" per_model entry instead (per_model.<model>.{name})",
                    )
            out["per_model"], out["per_model_limits"] = self.per_model(
                f"{path}.per_model", per_model
            )
        return out

    def per_model(
        self, path: str, raw: object
    ) -> tuple[tuple[tuple[str, int, int], ...], tuple[tuple[str, float, int, int], ...]]:
        """The quota entries, and the models whose entry carries serverless limits."""
        if not isinstance(raw, dict) or not raw:
            self.error(path, f"must be a mapping of model names to limits, got {kind(raw)}")
            return (), ()
        out: list[tuple[str, int, int]] = []
        limits: list[tuple[str, float, int, int]] = []
        for model, body in raw.items():
            where = f"{path}.{model}"
            if not isinstance(body, dict):
                self.error(where, f"must be a mapping of {', '.join(PER_MODEL_KEYS)}")
                continue
            known = (*PER_MODEL_KEYS, *PER_MODEL_LIMITS)
            self.unknown_keys(f"{where}.", body, known, "unknown per_model field")
            for name in PER_MODEL_KEYS:
                if name not in body:
                    self.error(f"{where}.{name}", "missing (required; 0 is unlimited)")
            rpm = self.integer(
                f"{where}.requests_per_minute_per_replica",
                body.get(PER_MODEL_KEYS[0]),
                0,
                MAX_LIMIT,
            )
            tokens = self.integer(
                f"{where}.tokens_per_day", body.get("tokens_per_day"), 0, MAX_LIMIT
            )
            out.append((str(model), rpm, tokens))
            if any(name in body for name in PER_MODEL_LIMITS):
                own = check_key_limits(self, f"{where}.", body)
                limits.append(
                    (
                        str(model),
                        own.max_occupancy_share,
                        own.input_tokens_per_minute,
                        own.output_tokens_per_minute,
                    )
                )
        return tuple(out), tuple(limits)


def shared_limits(tenant: Tenant) -> tuple[object, ...]:
    """What keys of one owner must agree on, their one bucket's limits: everything but
    the key hashes and the `models` allowlist, which is each key's own."""
    return (
        tenant.requests_per_minute,
        tenant.burst,
        tenant.tokens_per_day,
        tenant.max_concurrent,
        tenant.max_input_bytes,
        tenant.per_model,
    )


def with_models(tenant: Tenant, models: tuple[str, ...]) -> Tenant:
    """`tenant` as one of its keys sees it: with that key's `models` (the same record
    when they are the tenant's, as for most keys)."""
    return tenant if tenant.models == models else replace(tenant, models=models)


def _with_key(tenant: Tenant, digest: str) -> Tenant:
    return replace(tenant, key_hashes=(*tenant.key_hashes, digest))
