"""Per-model policies (`--policy-model-dir`, `/admin/policy/models/{name}`): named
documents that each claim some models and replace the global policy for them.

The Go router's layout and names: `_default.yaml` (or `.yml`) is the global policy,
every other `.yaml`/`.yml` file a named document whose name is the file's stem, and a
model belongs to at most one document. Two things differ, both on purpose: at start-up
an invalid or conflicting file is fatal (upstream skips it, so its models silently fall
back to the global policy), and a reload that finds `_default.yaml` gone keeps the
running global policy (upstream reverts to the built-in one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from router.documents import DocumentError, read_text
from router.policy.schema import Policy, PolicyError, load_policy

DEFAULT_NAMES: tuple[str, ...] = ("_default.yaml", "_default.yml")
SUFFIXES: tuple[str, ...] = (".yaml", ".yml")
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclass(frozen=True)
class Named:
    """One named per-model document and where it came from (`file` or `admin_api`)."""

    name: str
    policy: Policy
    origin: str


class ModelConflict(ValueError):
    """A document claims a model another document already has (HTTP 409)."""


def check_name(name: str) -> str | None:
    """Why `name` cannot name a document, or None."""
    if not name or len(name) > 128 or not set(name) <= NAME_CHARS or name.startswith("_"):
        return "policy names are 1-128 letters, digits, `.`, `_` or `-`, not starting with `_`"
    if not name.strip("."):
        return "a policy name needs a letter, digit, `_` or `-` (`.` and `..` name directories)"
    return None


def parse_named(text: str) -> Policy:
    """A named document: a valid policy with at least one model."""
    policy = load_policy(text)
    if not policy.models:
        raise PolicyError(["models: missing (required: the models a per-model policy serves)"])
    return policy


class ModelPolicies:
    """The named documents, and which one owns each model."""

    def __init__(self) -> None:
        self.named: dict[str, Named] = {}
        self.owner: dict[str, str] = {}

    def for_model(self, model: str) -> Policy | None:
        name = self.owner.get(model)
        return None if name is None else self.named[name].policy

    def check(self, name: str, policy: Policy) -> None:
        """ModelConflict when another document than `name` has one of `policy`'s models."""
        for model in policy.models:
            other = self.owner.get(model)
            if other is not None and other != name:
                raise ModelConflict(f"model {model!r} already belongs to policy {other!r}")

    def put(self, name: str, policy: Policy, origin: str) -> None:
        """Install or replace `name`; ModelConflict when another document has a model."""
        self.check(name, policy)
        self.delete(name)
        self.named[name] = Named(name, policy, origin)
        self.owner.update(dict.fromkeys(policy.models, name))

    def delete(self, name: str) -> bool:
        old = self.named.pop(name, None)
        if old is None:
            return False
        for model in old.policy.models:
            self.owner.pop(model, None)
        return True

    def view(self) -> dict[str, dict[str, object]]:
        """`GET /admin/policy/models`: an object keyed by document name."""
        return {name: self.describe(name) for name in sorted(self.named)}

    def describe(self, name: str) -> dict[str, object]:
        """The document as JSON, as upstream shows it (`models`, `routing_policy`, …),
        and this router's view of it: `chain`, `origin` and `source` (the YAML)."""
        named = self.named[name]
        return {
            **as_json(named.policy.source),
            "models": list(named.policy.models),
            "chain": named.policy.chain_names(),
            "origin": named.origin,
            "source": named.policy.source,
        }


@dataclass
class Listing:
    """What a policy directory holds: `_default.yaml`'s text (None when absent or
    unreadable), each named file's text by name, the names of the named files that
    are there but could not be read, and the errors."""

    default: str | None
    named: dict[str, str]
    unreadable: set[str]
    errors: list[str]


def read_directory(directory: str) -> Listing:
    """The directory's policy files. Names are sorted: a deterministic order, where
    upstream's depends on modification times."""
    root = Path(directory)
    if not root.is_dir():
        raise PolicyError([f"{directory}: not a directory (--policy-model-dir)"])
    found = Listing(None, {}, set(), [])
    for path in sorted(root.iterdir()):
        # A hidden file is no operator's policy: the temporary file of an editor or of a
        # tool that writes by rename (`.x.yaml.tmp`, Ansible's `.ansible_tmp….yaml`).
        if path.name.startswith(".") or path.suffix not in SUFFIXES or not path.is_file():
            continue
        default = path.name in DEFAULT_NAMES
        why = None if default else check_name(path.stem)
        if why is not None:
            found.errors.append(f"{path}: {why}")
            continue
        try:
            text = read_text(path)
        except (OSError, UnicodeDecodeError) as exc:
            found.errors.append(f"{path}: cannot read policy file ({exc})")
            if not default:
                found.unreadable.add(path.stem)
            continue
        if default and found.default is not None:
            # Upstream takes whichever it reads last: neither is safe to guess.
            found.errors.append(
                f"{path}: both {' and '.join(DEFAULT_NAMES)} are there; keep one of them"
            )
            found.default = None
        elif default:
            found.default = text
        else:
            found.named[path.stem] = text
    return found


@dataclass
class Checked:
    """A policy directory as start-up loads it: the global policy (None when there is
    no valid `_default.yaml`), the named documents that loaded, and every problem."""

    default: Policy | None
    policies: ModelPolicies
    errors: list[str]


def load_directory(directory: str) -> tuple[Policy | None, ModelPolicies]:
    """Start-up: every file valid and no model claimed twice, or PolicyError naming each
    file's problems."""
    checked = check_directory(directory)
    if checked.errors:
        raise PolicyError(checked.errors)
    return checked.default, checked.policies


def check_directory(directory: str) -> Checked:
    """What `load_directory` would load and every reason it would refuse; shared with
    `check-policy DIR`, so the check cannot pass a directory start-up refuses."""
    found = read_directory(directory)
    errors = found.errors
    default: Policy | None = None
    if found.default is not None:
        try:
            default = load_policy(found.default)
        except DocumentError as exc:
            errors += [f"{directory}/_default.yaml: {e}" for e in exc.errors]
    policies = ModelPolicies()
    for name, text in found.named.items():
        try:
            policies.put(name, parse_named(text), "file")
        except DocumentError as exc:
            errors += [f"{directory}/{name}: {e}" for e in exc.errors]
        except ModelConflict as exc:
            errors.append(f"{directory}/{name}: {exc}")
    return Checked(default, policies, errors)


# YAML aliases are written out in full as JSON: a 0.8 MB policy of 64 steps sharing one
# 90,000-tag list by alias became 63 MB of JSON and 3.4 s of the router's one thread.
# A policy is a few hundred values; past this many its JSON form is not built.
MAX_JSON_VALUES = 100_000


def as_json(source: str) -> dict[str, object]:
    """A loaded (so valid) policy's YAML as a JSON object; {} for what JSON cannot hold,
    or what its aliases would expand past MAX_JSON_VALUES values."""
    try:
        document = yaml.safe_load(source)
        if not _values_within(document, MAX_JSON_VALUES):
            return {}
        json.dumps(document)
    except (yaml.YAMLError, TypeError, ValueError, RecursionError):
        return {}
    return document if isinstance(document, dict) else {}


def _values_within(document: object, budget: int) -> bool:
    """Whether `document`, its aliases expanded, holds at most `budget` values; the
    walk stops at the budget, so it costs no more than that."""
    stack = [document]
    count = 0
    while stack:
        item = stack.pop()
        count += 1
        if count > budget:
            return False
        if isinstance(item, dict):
            stack.extend(item.values())
            count += len(item)  # the keys
        elif isinstance(item, list):
            stack.extend(item)
    return True
