"""The client-key registry of upstream's dynamic mode, managed through /admin/api-keys.

The registry is one document, `{"version": …, "keys": [entry, …]}` as canonical JSON,
so that it reloads, syncs to the other routers (router/fleet/config_sync.py) and is
validated the way the policy and the auth file are: a write builds the whole next
document, which is checked as a whole (each entry as an auth.yaml `api.keys` entry, no
hash under two ids, one owner's keys with one quota, each with its own
`allowed_models`) and installed only when
valid, so a bad write leaves the running set in force.

Unlike upstream, whose registry lives in memory and is empty after every restart, a
write is saved in the router's SQLite state (`RegistryFile`, `router_api_keys.sqlite3`
beside the per-agent history, a file of its own so that `--reset-disk-db` does not
drop the keys) before it is acknowledged, and loaded at start-up.

Versions are upstream's: opaque strings compared lexicographically; a write whose
version sorts below the running one is stale (409), an equal one is accepted.

The check runs on the event loop, so a write checks only the entries that changed
(`Registry.checked`) and keeps the records of owners it did not touch: measured at
10,000 keys (one owner each), a PUT costs 30 ms of CPU and installing a copy from
another router 43 ms, where checking every entry again took 340 ms; a replace that
brings 10,000 new entries still costs 310 ms once.
"""

from __future__ import annotations

import calendar
import contextlib
import logging
import os
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import trio

from router.admission.crosscheck import PolicyLimits, below_serverless_cap
from router.documents import DocumentError, DocumentStore, Validator, kind, shown
from router.metrics import RouterMetrics
from router.tenants.config import HASH_PREFIX, ApiKey, AuthConfig, Tenant
from router.tenants.upstream_auth import shared_limits, upstream_key, with_models

log = logging.getLogger("tenant")

KIND = "api_keys"
# Upstream's body limits: one entry 1 MiB, a whole registry 16 MiB.
MAX_ENTRY_BYTES = 1024 * 1024
MAX_REGISTRY_BYTES = 16 * 1024 * 1024
MAX_VERSION = 200
ENTRY_FIELDS: tuple[str, ...] = (
    "id",
    "key_hash",
    "key_preview",
    "owner",
    "name",
    "enabled",
    "expires_at",
    "allowed_models",
    "quota",
    "max_occupancy_share",
    "mode",
    "max_input_tokens",
    "images_max",
)
# Fields of an entry passed on, as they are, to the auth.yaml entry checks.
_PASSED = ("max_occupancy_share", "mode", "max_input_tokens", "images_max")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_HEX = re.compile(r"^(sha256:)?[0-9a-fA-F]{64}$")
_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?(Z|z|[+-]\d{2}:\d{2})$"
)


class RegistryError(DocumentError):
    label = "api key registry"


@dataclass(frozen=True)
class StaleVersion(Exception):
    """A write whose version sorts below the running one (HTTP 409)."""

    current: str


# An entry as checked: the normalized entry, its tenant, expiry and key record.
Checked = tuple[dict[str, Any], Tenant, float | None, ApiKey]


@dataclass(frozen=True)
class Registry:
    version: str
    entries: dict[str, dict[str, Any]]  # id → entry, the hash normalized
    config: AuthConfig
    source: str
    # id → the entry as checked: the next write checks only the entries that changed
    # (one PUT into 10,000 keys: 0.34 s of CPU to check them all, blocking the loop).
    checked: dict[str, Checked] = field(default_factory=dict)
    # Owner → its tenant without key hashes (an unchanged owner keeps its record).
    bases: dict[str, Tenant] = field(default_factory=dict)

    def public(self, key_id: str) -> dict[str, Any]:
        """An entry as the API shows it: upstream's fields, the hash always empty."""
        return {**self.entries[key_id], "key_hash": ""}


def canonical(version: str, entries: dict[str, dict[str, Any]]) -> str:
    """The registry's text: the same keys are the same text (and version) everywhere."""
    document = {"version": version, "keys": [entries[k] for k in sorted(entries)]}
    return orjson.dumps(document, option=orjson.OPT_SORT_KEYS).decode()


def rfc3339(text: str) -> float | None:
    """An RFC 3339 instant as epoch seconds; None when it is not one."""
    m = _RFC3339.match(text)
    if m is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    try:
        time.strptime(f"{year:04d}-{month:02d}-{day:02d}", "%Y-%m-%d")
    except ValueError:
        return None
    if hour > 23 or minute > 59 or second > 60:
        return None
    at = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    zone = m.group(8)
    if zone not in ("Z", "z"):
        if int(zone[1:3]) > 23 or int(zone[4:6]) > 59:
            return None  # RFC 3339's offsets run to 23:59
        sign = 1 if zone[0] == "+" else -1
        at -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    return float(at) + float(m.group(7) or 0)


class _Entries(Validator):
    def __init__(
        self, errors: list[str], burst_seconds: int, running: Registry | None = None
    ) -> None:
        super().__init__(errors)
        self.burst_seconds = burst_seconds
        self.running = running
        self.known = running.checked if running is not None else {}
        self.checked: dict[str, Checked] = {}

    def registry(self, document: object, source: str) -> Registry | None:
        if not isinstance(document, dict):
            self.error("registry", f"must be an object with version and keys, got {kind(document)}")
            return None
        self.unknown_keys("", document, ("version", "keys"), "unknown field")
        version = self.version("version", document.get("version"), required=False)
        raw = document.get("keys")
        if not isinstance(raw, list):
            self.error("keys", f"must be a list of key entries, got {kind(raw)}")
            return None
        entries: dict[str, dict[str, Any]] = {}
        # Owner → its tenant without key hashes, the first key's id, the enabled hashes.
        base: dict[str, Tenant] = {}
        first_of_owner: dict[str, str] = {}
        hashes: dict[str, list[str]] = {}
        owner_of_hash: dict[str, str] = {}
        # Each key's own allowed_models (keys of one owner share everything else).
        models_of_hash: dict[str, tuple[str, ...]] = {}
        records: dict[str, ApiKey] = {}
        id_of_hash: dict[str, str] = {}
        expires: dict[str, float] = {}
        for i, body in enumerate(raw):
            path = f"keys[{i}]"
            checked = self.entry(path, body)
            if checked is None:
                continue
            entry, tenant, until, record = checked
            self.checked.setdefault(entry["id"], checked)
            key_id, digest = entry["id"], HASH_PREFIX + entry["key_hash"]
            if key_id in entries:
                self.error(f"{path}.id", f"{key_id!r} is listed twice")
                continue
            if digest in id_of_hash:
                self.error(
                    f"{path}.key_hash",
                    f"is also the hash of key {id_of_hash[digest]!r}: delete that key first",
                )
                continue
            known = base.get(tenant.name)
            if (
                known is not None
                and known is not tenant
                and shared_limits(known) != shared_limits(tenant)
            ):
                self.error(
                    path,
                    f"owner {tenant.name!r} is also key {first_of_owner[tenant.name]!r} with"
                    " another quota; keys of one owner share one bucket, so give them the"
                    " same quota (each key's allowed_models may differ)",
                )
                continue
            entries[key_id] = entry
            id_of_hash[digest] = key_id
            if known is None:
                first_of_owner[tenant.name] = key_id
                base[tenant.name] = tenant
                hashes[tenant.name] = []
            if entry["enabled"]:
                hashes[tenant.name].append(digest)
                owner_of_hash[digest] = tenant.name
                models_of_hash[digest] = tenant.models
                records[digest] = record
                if until is not None:
                    expires[digest] = until
        if self.errors:
            return None
        # Each key's record is its tenant's final one, with every key hash.
        tenants = {name: self.tenant(name, t, tuple(hashes[name])) for name, t in base.items()}
        by_hash = {
            digest: with_models(tenants[name], models_of_hash[digest])
            for digest, name in owner_of_hash.items()
        }
        config = AuthConfig(
            tenants,
            by_hash,
            source,
            expires=expires,
            admin_mode="api-key",
            dynamic=True,
            keys=records,
        )
        return Registry(version, entries, config, source, self.checked, base)

    def tenant(self, name: str, base: Tenant, hashes: tuple[str, ...]) -> Tenant:
        running = self.running
        if running is not None and running.bases.get(name) is base:
            old = running.config.tenants[name]
            if old.key_hashes == hashes:
                return old
        return replace(base, key_hashes=hashes)

    def version(self, path: str, raw: object, required: bool = True) -> str:
        if raw is None and not required:
            return ""
        if not isinstance(raw, str) or (required and not raw) or len(raw) > MAX_VERSION:
            self.error(
                path,
                f"must be a string of 1-{MAX_VERSION} characters that sorts after the"
                f" running version (`rev_00000042`, an RFC 3339 time), got {kind(raw)}",
            )
            return ""
        return raw

    def entry(self, path: str, raw: object) -> Checked | None:
        """The normalized entry, its tenant, expiry and key record; None when it has
        errors. An entry the running registry holds as it is was checked already."""
        known = self.known.get(raw.get("id")) if isinstance(raw, dict) else None  # type: ignore[arg-type]
        if known is not None and (known[0] is raw or known[0] == raw):
            return known
        if not isinstance(raw, dict):
            self.error(path, f"must be an object (a key entry), got {kind(raw)}")
            return None
        before = len(self.errors)
        self.unknown_keys(f"{path}.", raw, ENTRY_FIELDS, "unknown key field")
        key_id = raw.get("id")
        if not isinstance(key_id, str) or not _ID.match(key_id):
            self.error(
                f"{path}.id",
                "must be 1-128 letters, digits, `.`, `_`, `:`, `@` or `-`, starting with a"
                f" letter or digit, got {kind(key_id)}",
            )
        digest = raw.get("key_hash")
        if not isinstance(digest, str) or not _HEX.match(digest):
            clear = isinstance(digest, str) and digest.startswith(("sk-", "hnr-"))
            self.error(
                f"{path}.key_hash",
                'must be the key\'s SHA-256, exactly 64 hex digits (`printf %s "$KEY" |'
                " sha256sum`), got " + ("a key in clear" if clear else kind(digest)),
            )
            digest = None
        else:
            digest = digest.removeprefix(HASH_PREFIX).lower()
        enabled = raw.get("enabled")
        if not isinstance(enabled, bool):
            self.error(f"{path}.enabled", f"must be true or false (required), got {kind(enabled)}")
        expires_at = raw.get("expires_at") or ""
        until = None
        if expires_at:
            until = rfc3339(expires_at) if isinstance(expires_at, str) else None
            if until is None:
                self.error(
                    f"{path}.expires_at",
                    f"must be an RFC 3339 time (`2027-01-01T00:00:00Z`), got {kind(expires_at)}",
                )
        models = raw.get("allowed_models")
        if models is not None and not isinstance(models, list):
            self.error(f"{path}.allowed_models", f"must be a list of models, got {kind(models)}")
            models = None
        for name in ("owner", "name", "key_preview"):
            if raw.get(name) is not None and not isinstance(raw.get(name), str):
                self.error(f"{path}.{name}", f"must be a string, got {kind(raw.get(name))}")
        if len(self.errors) > before:
            return None
        # The rest is an auth.yaml entry's: checked by the same code, with its paths.
        upstream: dict[str, Any] = {
            "key_hash": digest,
            "metadata": {"name": raw.get("name"), "owner": raw.get("owner")},
            "models": models,
            "quota": raw.get("quota"),
            **{name: raw[name] for name in _PASSED if name in raw},
        }
        errors: list[str] = []
        checked = upstream_key(errors, self.burst_seconds, path, upstream)
        for error in errors:
            self.errors.append(
                error.replace(f"{path}.metadata.", f"{path}.").replace(
                    f"{path}.models", f"{path}.allowed_models"
                )
            )
        if checked is None or errors:
            return None
        tenant: Tenant = checked[1]
        # The registry's id is the key's id: its admission state and audit identity.
        record: ApiKey = replace(checked[3], id=key_id)
        entry = {
            "id": key_id,
            "key_hash": digest,
            "key_preview": raw.get("key_preview") or "",
            "owner": raw["owner"],
            "name": raw["name"],
            "enabled": enabled,
            "expires_at": expires_at,
            "allowed_models": list(models or []),
            "quota": raw.get("quota") or {},
            **{name: raw[name] for name in _PASSED if name in raw},
        }
        return entry, tenant, until, record


def parse_registry(text: str, burst_seconds: int = 0, running: Registry | None = None) -> Registry:
    """The registry in `text`; what `running` holds as it is is not checked again."""
    try:
        document = orjson.loads(text)
    except ValueError as exc:
        raise RegistryError([f"not JSON: {exc}"]) from None
    return check_registry(document, text, burst_seconds, running)


def check_registry(
    document: object, source: str, burst_seconds: int = 0, running: Registry | None = None
) -> Registry:
    errors: list[str] = []
    registry = _Entries(errors, burst_seconds, running).registry(document, source)
    if registry is None or errors:
        raise RegistryError(errors or ["invalid registry"])
    return registry


EMPTY = canonical("", {})


class KeyRegistry(DocumentStore[Registry]):
    """The running registry, its writes and where they are saved."""

    kind = KIND
    noun = "api key registry"
    title = "api key registry"
    max_bytes = MAX_REGISTRY_BYTES * 2  # a registry with its JSON quoting

    def __init__(
        self, metrics: RouterMetrics, saved: RegistryFile | None, burst_seconds: int = 0
    ) -> None:
        super().__init__(metrics.auth_reloads, log, None)
        self.burst_seconds = burst_seconds
        self.saved = saved
        # The running policies' admission caps (the daemon points it at its PolicyStore).
        self.policies: Callable[[], list[PolicyLimits]] = list
        self.current = parse_registry(EMPTY)
        text = saved.load() if saved is not None else None
        if text is not None:
            # A saved registry this router cannot read is a startup error, not an empty
            # registry that would refuse every client.
            self.current = self.parse(text)
            log.info(
                "api_keys_loaded keys=%d registry_version=%s",
                len(self.current.entries),
                self.current.version or "-",
            )
        self._save_send, self._save_receive = trio.open_memory_channel[str](1)
        self.on_replaced.append(self._saved_later)

    def parse(self, text: str) -> Registry:
        try:
            document = orjson.loads(text)
        except ValueError as exc:
            raise RegistryError([f"not JSON: {exc}"]) from None
        return self.check(document, text)

    def check(self, document: object, source: str) -> Registry:
        """The registry `document` would be; only entries that changed are checked."""
        registry = check_registry(document, source, self.burst_seconds, self.current)
        errors = below_serverless_cap(registry.config, self.policies())
        if errors:
            raise RegistryError(errors)
        return registry

    def source(self) -> str:
        return self.current.source

    def install(self, value: Registry) -> str:
        self.current = value
        return f"keys={len(value.entries)} registry_version={value.version or '-'}"

    def supersedes(self, text: str) -> bool:
        """Whether the running registry is newer than `text` (a fleet copy): then the
        fleet gets this one back, so routers that wrote at once converge on the newer."""
        try:
            version = orjson.loads(text).get("version", "")
        except (ValueError, AttributeError):
            return False
        return isinstance(version, str) and version < self.current.version

    def check_version(self, version: str) -> None:
        if version < self.current.version:
            raise StaleVersion(self.current.version)

    def with_entry(self, key_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """The next registry with `body` as key `key_id` (the URL's id wins)."""
        errors: list[str] = []
        version = _Entries(errors, 0).version("version", body.get("version"))
        if errors:
            raise RegistryError(errors)
        self.check_version(version)
        entry = {k: v for k, v in body.items() if k != "version"}
        entry["id"] = key_id
        others = [e for k, e in sorted(self.current.entries.items()) if k != key_id]
        # The entry goes last, so that a conflict is reported on it (`keys[n]`).
        return {"version": version, "keys": [*others, entry]}

    def without_entry(self, key_id: str, version: str) -> dict[str, Any]:
        errors: list[str] = []
        _Entries(errors, 0).version("version", version)
        if errors:
            raise RegistryError(errors)
        self.check_version(version)
        keys = [e for k, e in sorted(self.current.entries.items()) if k != key_id]
        return {"version": version, "keys": keys}

    def replaced_by(self, body: object) -> dict[str, Any]:
        errors: list[str] = []
        if not isinstance(body, dict):
            why = f"body: must be an object with version and keys, got {kind(body)}"
            raise RegistryError([why])
        checker = _Entries(errors, 0)
        checker.unknown_keys("", body, ("version", "keys"), "unknown field")
        version = checker.version("version", body.get("version"))
        keys = body.get("keys")
        if not isinstance(keys, list):
            errors.append(f"keys: must be a list of key entries, got {kind(keys)}")
        if errors:
            raise RegistryError(errors)
        self.check_version(version)
        entries: dict[str, dict[str, Any]] = {}
        for i, entry in enumerate(keys):  # type: ignore[arg-type]
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                if entry["id"] in entries:
                    errors.append(f"keys[{i}].id: {shown(entry['id'])} is listed twice")
                entries.setdefault(entry["id"], entry)
            else:
                got = kind(entry.get("id")) if isinstance(entry, dict) else kind(entry)
                errors.append(f"keys[{i}].id: a string is required in a replace, got {got}")
        if errors:
            raise RegistryError(errors)
        # In the caller's order, so that `keys[i]` in an error is the caller's entry i.
        return {"version": version, "keys": keys}

    async def write(self, document: dict[str, Any], origin: str) -> list[str]:
        """Validate `document`, save it, then run it; the errors, empty on success."""
        return await self.change(lambda: self.finished(self.check(document, "")), origin)

    async def edit(
        self, build: Callable[[], dict[str, Any]], origin: str, if_match: str | None = None
    ) -> list[str]:
        """A write of the admin API: `build` makes the next document (`with_entry`,
        `without_entry`, `replaced_by`) from the running one, which with --state-url is
        the fleet's at that moment (again when another router wrote meanwhile), so
        concurrent writes on several routers all land. StaleVersion and
        PreconditionFailed propagate."""
        return await self.change(lambda: self.finished(self.check(build(), "")), origin, if_match)

    def finished(self, value: Registry) -> Registry:
        """`value` with its canonical text, the same on every router."""
        try:
            text = canonical(value.version, value.entries)
        except orjson.JSONEncodeError as exc:  # an integer past 64 bits, as 2**70
            raise RegistryError([f"registry: {exc}; numbers must fit in 64 bits"]) from None
        return replace(value, source=text, config=replace(value.config, source=text))

    async def before_commit(self, value: Registry) -> None:
        # Saved before it is acknowledged: a restart keeps what a 200 promised.
        if self.saved is not None:
            await self.saved.save(value.source)

    def _saved_later(self, origin: str) -> None:
        """A registry from the fleet is saved too, so a restart without Redis keeps it."""
        if origin == "fleet" and self.saved is not None:
            # A full channel has a save queued already; it reads the text then.
            with contextlib.suppress(trio.WouldBlock):
                self._save_send.send_nowait(self.current.source)

    async def run(self) -> None:
        async for _ in self._save_receive:
            if self.saved is not None:
                await self.saved.save(self.current.source)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    kind TEXT PRIMARY KEY,
    text TEXT NOT NULL,
    updated_at REAL NOT NULL
)
"""


FILE_NAME = "router_api_keys.sqlite3"


def registry_path(history: str) -> str:
    """The registry's file, in the directory of the per-agent history file."""
    return os.path.join(os.path.dirname(os.path.abspath(history)), FILE_NAME)


class RegistryFile:
    """The registry in an SQLite file of the router's state (router/lifetime.py keeps
    the other): one row, rewritten in one transaction per write."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = trio.Lock()

    def __repr__(self) -> str:
        return f"<RegistryFile {self.path}>"

    def _connect(self) -> sqlite3.Connection:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        db = sqlite3.connect(self.path, timeout=10)
        db.execute(_SCHEMA)
        return db

    def load(self) -> str | None:
        """The saved registry, at start-up before the event loop runs."""
        try:
            db = self._connect()
            try:
                row = db.execute("SELECT text FROM documents WHERE kind = ?", (KIND,)).fetchone()
            finally:
                db.close()
        except (sqlite3.Error, OSError) as exc:
            raise ValueError(f"api key registry in {self.path}: {exc}") from exc
        return None if row is None else str(row[0])

    def _save(self, text: str) -> None:
        db = self._connect()
        try:
            with db:
                db.execute(
                    "INSERT INTO documents (kind, text, updated_at) VALUES (?, ?, ?)"
                    " ON CONFLICT(kind) DO UPDATE SET text=excluded.text,"
                    " updated_at=excluded.updated_at",
                    (KIND, text, time.time()),
                )
        finally:
            db.close()

    async def save(self, text: str) -> None:
        # sqlite3 blocks: one write at a time in a worker thread, as router/lifetime.py.
        async with self._lock:
            await trio.to_thread.run_sync(self._save, text)
