"""Policy files: YAML in, immutable step objects out, or every reason it is invalid.

A policy is a primary `routing_policy` step, an ordered `fallback_chain` of further
steps, and an optional external `fallback_provider`. Parsing and the shared checks
(every error with its path, did-you-mean hints) are router/documents.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.fields import ENGINE_FIELDS, HARDWARE_FIELDS
from router.admission.limits import NO_ADMISSION_LIMITS, AdmissionLimits, check_policy_limits
from router.admission.limits import POLICY_FIELDS as ADMISSION_FIELDS
from router.documents import (
    DocumentError,
    Validator,
    hint,
    is_number,
    kind,
    parse_document,
    read_document,
    shown,
)
from router.peers import UNIVERSAL_FIELDS
from router.policy.rank import PARAMS, STRATEGIES
from router.policy.rank_prefix import PrefixParams

GATE_FIELDS: tuple[str, ...] = UNIVERSAL_FIELDS + ENGINE_FIELDS + HARDWARE_FIELDS
OPERATORS: tuple[str, ...] = ("gt", "gte", "lt", "lte")
MATCH_FIELDS: tuple[str, ...] = ("region", "engine", "organization", "machine", "gpu_model")
STEP_KEYS: tuple[str, ...] = (
    "name",
    "match",
    "exclude_if",
    "shed_if",
    "strategy",
    "strategy_params",
    "max_tries",
)
# `shed_if`: router-wide load conditions, and the selectors of the requests it refuses.
SHED_FIELDS: tuple[str, ...] = (
    "model_queue_depth",
    "total_queue_depth",
    "model_capacity_utilization",
)
SHED_SELECTORS: tuple[str, ...] = ("tenants", "priority")
SHED_KEYS: tuple[str, ...] = (*SHED_FIELDS, *SHED_SELECTORS, "retry_after")
# The Go router's front-door `shed_if` (top level): engine signals averaged over the
# healthy agents of the model. The same mechanism as a step's, one level up, so the
# top level takes the router-wide fields too.
POOL_SHED_FIELDS: tuple[str, ...] = ("kv_cache_utilization", "waiting_requests")
POLICY_SHED_FIELDS: tuple[str, ...] = (*POOL_SHED_FIELDS, *SHED_FIELDS)
DEFAULT_RETRY_AFTER = 1
MAX_RETRY_AFTER = 3600
TOP_LEVEL_KEYS: tuple[str, ...] = ("routing_policy", "fallback_chain", "fallback_provider")
MAX_FALLBACK_STEPS = 64
# Upstream's top-level fields: `models` names the models of a per-model file
# (--policy-model-dir), `shed_if` is the front-door check. Not in the `known:` list of
# the message above, which tests and operators' notes pin.
UPSTREAM_TOP_LEVEL_KEYS: tuple[str, ...] = ("models", "shed_if", *ADMISSION_FIELDS)
# This router's own top-level options, also outside that list; a close misspelling
# still gets its did-you-mean.
ROUTER_TOP_LEVEL_KEYS: tuple[str, ...] = ("stream_continuation",)
PROVIDER_ENGINES: tuple[str, ...] = ("openai", "anthropic")
PROVIDER_KEYS: tuple[str, ...] = ("engine", "model")
PRIMARY = "routing_policy"

DEFAULT_POLICY_YAML = "routing_policy:\n  match: {}\n  strategy: least-loaded\n"


@dataclass(frozen=True)
class Rule:
    """One `exclude_if` gate: the agent is excluded when `value <op> threshold`."""

    field: str
    op: str  # gt | gte | lt | lte
    threshold: float

    def violated(self, value: float) -> bool:
        if self.op == "gt":
            return value > self.threshold
        if self.op == "gte":
            return value >= self.threshold
        if self.op == "lt":
            return value < self.threshold
        if self.op == "lte":
            return value <= self.threshold
        raise ValueError(f"unknown operator {self.op!r}")


@dataclass(frozen=True)
class Match:
    """Static metadata filters; an empty field does not restrict."""

    region: str = ""
    engine: str = ""
    organization: str = ""
    machine: str = ""
    gpu_model: str = ""
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shed:
    """`shed_if`: refuse a selected request at its step when any load rule is violated.

    A request is selected when its tenant is listed (or no list is given) and its
    priority satisfies the `priority` comparison (or none is given).
    """

    rules: tuple[Rule, ...]  # load fields of SHED_FIELDS; any violated rule sheds
    tenants: tuple[str, ...] = ()  # empty: every tenant
    priority: Rule | None = None  # e.g. priority < 5; None: every priority
    retry_after: int = DEFAULT_RETRY_AFTER  # seconds, sent as Retry-After

    def selects(self, tenant: str, priority: int) -> bool:
        if self.tenants and tenant not in self.tenants:
            return False
        return self.priority is None or self.priority.violated(priority)


@dataclass(frozen=True)
class Step:
    name: str
    match: Match
    exclude_if: tuple[Rule, ...]
    strategy: str
    max_tries: int  # as written; zero or negative means "use the router-wide value"
    shed_if: Shed | None = None
    # The strategy's parameters with their defaults filled in; None for one without.
    strategy_params: PrefixParams | None = None

    def budget(self, default: int) -> int:
        """Forward tries allowed in this step, given `--max-tries-per-step`."""
        return self.max_tries if self.max_tries > 0 else default


@dataclass(frozen=True)
class ProviderFallback:
    engine: str  # openai | anthropic
    model: str


@dataclass(frozen=True)
class Policy:
    routing_policy: Step
    fallback_chain: tuple[Step, ...]
    fallback_provider: ProviderFallback | None
    source: str  # the YAML text it was loaded from, served back by GET /admin/policy
    # The models of a per-model file; ignored for the global policy, as upstream.
    models: tuple[str, ...] = ()
    # Front door: checked once, before the first step (429 concurrency_limit_exceeded).
    shed_if: Shed | None = None
    # Upstream's top-level admission fields (router/admission/limits.py).
    admission: AdmissionLimits = NO_ADMISSION_LIMITS
    # A stream whose agent breaks goes on from another agent (router/continuation.py).
    stream_continuation: bool = True

    @property
    def steps(self) -> tuple[Step, ...]:
        """Every local step in evaluation order, the primary first."""
        return (self.routing_policy, *self.fallback_chain)

    def chain_names(self) -> list[str]:
        return [step.name for step in self.steps]


class PolicyError(DocumentError):
    """A policy that cannot be loaded; `errors` holds one message per problem."""

    label = "policy"


def load_policy(text: str) -> Policy:
    document, errors = parse_document(text, PolicyError)
    policy = _Validator(errors).policy(document, text)
    if errors or policy is None:
        raise PolicyError(errors)
    return policy


def load_policy_file(path: str | Path) -> Policy:
    return load_policy(read_document(path, PolicyError, "policy file"))


def default_policy() -> Policy:
    """The seeds' policy for a router started without --policy-file."""
    return load_policy(DEFAULT_POLICY_YAML)


class _Validator(Validator):
    def policy(self, document: object, source: str) -> Policy | None:
        if document is None:
            document = {}
        if not isinstance(document, dict):
            self.error(
                "policy",
                "the document must be a mapping with routing_policy at the top level,"
                f" got {kind(document)}",
            )
            return None
        own = (*UPSTREAM_TOP_LEVEL_KEYS, *ROUTER_TOP_LEVEL_KEYS)
        others = {k: v for k, v in document.items() if k not in own}
        typos = {str(k): o for k in others for o in ROUTER_TOP_LEVEL_KEYS if hint(str(k), (o,))}
        self.unknown_keys(
            "", others, TOP_LEVEL_KEYS, "unknown top-level key", _MISPLACED_TOP, typos
        )
        continuation = document.get("stream_continuation", True)
        if not isinstance(continuation, bool):
            self.error("stream_continuation", f"must be true or false, got {kind(continuation)}")
            continuation = True

        models = self.models(document.get("models"))
        front = self.shed_if("shed_if", document.get("shed_if"), POLICY_SHED_FIELDS)
        primary = self.primary(document)
        chain = self.chain(document.get("fallback_chain"))
        provider = self.provider(document)
        admission = check_policy_limits(self, document)
        if primary is None or chain is None:
            return None
        self.unique_names((primary, *chain))
        return Policy(primary, chain, provider, source, models, front, admission, continuation)

    def models(self, raw: object) -> tuple[str, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list) or not raw:
            self.error("models", f"must be a non-empty list of model names, got {kind(raw)}")
            return ()
        out: list[str] = []
        for i, model in enumerate(raw):
            if not isinstance(model, str) or not model.strip():
                self.error(f"models[{i}]", f"must be a non-empty string, got {kind(model)}")
            elif model in out:
                self.error(f"models[{i}]", f"{model!r} listed twice")
            else:
                out.append(model)
        return tuple(out)

    def primary(self, document: dict[Any, Any]) -> Step | None:
        if PRIMARY not in document:
            self.error(PRIMARY, "missing (required)")
            return None
        raw = document[PRIMARY]
        if raw is None:
            self.error(PRIMARY, "empty (required: a step with at least a strategy)")
            return None
        if isinstance(raw, dict) and "name" in raw:
            self.error(f"{PRIMARY}.name", f"not allowed (the primary step is always {PRIMARY})")
            raw = {k: v for k, v in raw.items() if k != "name"}
        return self.step(PRIMARY, raw, PRIMARY)

    def chain(self, raw: object) -> tuple[Step, ...] | None:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            self.error("fallback_chain", f"must be a list of steps, got {kind(raw)}")
            return None
        if len(raw) > MAX_FALLBACK_STEPS:
            # Each step is checked against the others: thousands would hold up the
            # router while it checks them, for a chain no request could walk in time.
            self.error("fallback_chain", f"{len(raw)} steps, at most {MAX_FALLBACK_STEPS}")
            return None
        steps: list[Step] = []
        valid = True
        for i, item in enumerate(raw):
            path = f"fallback_chain[{i}]"
            step = self.step(path, item, path)
            if step is None:
                valid = False
            else:
                steps.append(step)
        return tuple(steps) if valid else None

    def step(self, path: str, raw: object, default_name: str) -> Step | None:
        if not isinstance(raw, dict):
            self.error(path, f"must be a mapping (a policy step), got {kind(raw)}")
            return None
        before = len(self.errors)
        self.unknown_keys(f"{path}.", raw, STEP_KEYS, "unknown step key", _MISPLACED_IN_STEP)
        name = self.step_name(path, raw.get("name"), default_name)
        match = self.match(f"{path}.match", raw.get("match"))
        rules = self.exclude_if(f"{path}.exclude_if", raw.get("exclude_if"))
        shed = self.shed_if(f"{path}.shed_if", raw.get("shed_if"))
        strategy = self.strategy(f"{path}.strategy", raw)
        params = self.strategy_params(f"{path}.strategy_params", strategy, raw)
        max_tries = self.max_tries(f"{path}.max_tries", raw.get("max_tries"))
        if len(self.errors) > before:
            return None
        return Step(name, match, rules, strategy, max_tries, shed, params)

    def step_name(self, path: str, raw: object, default: str) -> str:
        if raw is None:
            return default
        if not isinstance(raw, str) or not raw.strip():
            self.error(f"{path}.name", f"must be a non-empty string, got {kind(raw)}")
            return default
        return raw

    def match(self, path: str, raw: object) -> Match:
        if raw is None:
            return Match()
        if not isinstance(raw, dict):
            self.error(path, f"must be a mapping of metadata fields, got {kind(raw)}")
            return Match()
        self.unknown_keys(f"{path}.", raw, (*MATCH_FIELDS, "tags"), "unknown match field")
        values: dict[str, str] = {}
        for name in MATCH_FIELDS:
            value = raw.get(name)
            if value is None:
                continue
            if isinstance(value, str):
                values[name] = value
            else:
                self.error(f"{path}.{name}", f"must be a string, got {kind(value)}")
        return Match(**values, tags=self.tags(f"{path}.tags", raw.get("tags")))

    def tags(self, path: str, raw: object) -> tuple[str, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            self.error(path, f"must be a list of strings, got {kind(raw)}")
            return ()
        for i, tag in enumerate(raw):
            if not isinstance(tag, str) or not tag:
                self.error(f"{path}[{i}]", f"must be a non-empty string, got {kind(tag)}")
        return tuple(tag for tag in raw if isinstance(tag, str))

    def exclude_if(self, path: str, raw: object) -> tuple[Rule, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, dict):
            self.error(path, f"must be a mapping of gate fields, got {kind(raw)}")
            return ()
        rules: list[Rule] = []
        for key, body in raw.items():
            field = str(key)
            if key not in GATE_FIELDS:
                self.error(
                    f"{path}.{field}",
                    f"unknown gate field (known: {', '.join(GATE_FIELDS)})"
                    + hint(field, GATE_FIELDS),
                )
                continue
            rule = self.rule(f"{path}.{field}", field, body)
            if rule is not None:
                rules.append(rule)
        return tuple(rules)

    def shed_if(self, path: str, raw: object, fields: tuple[str, ...] = SHED_FIELDS) -> Shed | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            self.error(path, f"must be a mapping of load fields and selectors, got {kind(raw)}")
            return None
        keys = (*fields, *SHED_SELECTORS, "retry_after")
        misplaced = {k: v for k, v in _MISPLACED_IN_SHED.items() if k not in fields}
        self.unknown_keys(f"{path}.", raw, keys, "unknown shed_if key", misplaced)
        rules = [self.rule(f"{path}.{key}", key, raw[key]) for key in raw if key in fields]
        if not any(field in raw for field in fields):
            self.error(
                path,
                "needs at least one load condition"
                f" ({', '.join(fields)}), e.g. model_queue_depth: {{gte: 10}}",
            )
        priority = None
        if "priority" in raw:
            priority = self.rule(f"{path}.priority", "priority", raw["priority"])
        return Shed(
            tuple(rule for rule in rules if rule is not None),
            self.shed_tenants(f"{path}.tenants", raw.get("tenants")),
            priority,
            self.retry_after(f"{path}.retry_after", raw.get("retry_after")),
        )

    def shed_tenants(self, path: str, raw: object) -> tuple[str, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list) or not raw:
            self.error(
                path,
                f"must be a non-empty list of tenant names, got {kind(raw)}"
                " (remove the key to shed every tenant)",
            )
            return ()
        for i, tenant in enumerate(raw):
            if not isinstance(tenant, str) or not tenant.strip():
                self.error(f"{path}[{i}]", f"must be a non-empty string, got {kind(tenant)}")
        return tuple(tenant for tenant in raw if isinstance(tenant, str))

    def retry_after(self, path: str, raw: object) -> int:
        if raw is None:
            return DEFAULT_RETRY_AFTER
        if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= MAX_RETRY_AFTER:
            self.error(path, f"must be whole seconds from 0 to {MAX_RETRY_AFTER}, got {kind(raw)}")
            return DEFAULT_RETRY_AFTER
        return raw

    def rule(self, path: str, field: str, body: object) -> Rule | None:
        if not isinstance(body, dict):
            self.error(
                path,
                f"must be a mapping of one operator to a threshold, e.g. {{gt: 0.9}},"
                f" got {kind(body)}",
            )
            return None
        unknown = [str(op) for op in body if op not in OPERATORS]
        for op in unknown:
            self.error(
                f"{path}.{op}",
                f"unknown operator (known: {', '.join(OPERATORS)}){hint(op, OPERATORS)}",
            )
        ops = [op for op in body if op in OPERATORS]
        if len(ops) != 1:
            if len(ops) > 1 or not unknown:
                listed = f" ({', '.join(ops)})" if ops else ""
                self.error(path, f"exactly one operator required, got {len(ops)}{listed}")
            return None
        op = ops[0]
        threshold = body[op]
        if not is_number(threshold):
            self.error(f"{path}.{op}", f"threshold must be a number, got {kind(threshold)}")
            return None
        if not math.isfinite(threshold):
            self.error(f"{path}.{op}", f"threshold must be a finite number, got {threshold}")
            return None
        return Rule(field, op, float(threshold))

    def strategy(self, path: str, raw: dict[Any, Any]) -> str:
        if "strategy" not in raw or raw["strategy"] is None:
            self.error(path, "missing (required)")
            return ""
        value = raw["strategy"]
        if not isinstance(value, str):
            self.error(path, f"must be a string, got {kind(value)}")
            return ""
        if value in STRATEGIES:
            return value
        only = ", ".join(STRATEGIES)
        self.error(path, f"unknown strategy {value!r} (one of {only}){hint(value, _KNOWN)}")
        return ""

    def strategy_params(self, path: str, strategy: str, raw: dict[Any, Any]) -> PrefixParams | None:
        """The `prefix-aware` parameters, defaults filled in; other strategies take none."""
        body = raw.get("strategy_params")
        if strategy not in PARAMS:
            if body is not None and strategy:
                takes = ", ".join(PARAMS)
                self.error(path, f"strategy {strategy!r} takes no parameters (only {takes} does)")
            return None
        if body is None:
            return PrefixParams()
        if not isinstance(body, dict):
            self.error(path, f"must be a mapping, got {kind(body)}")
            return None
        self.unknown_keys(f"{path}.", body, PREFIX_PARAM_KEYS, f"unknown {strategy} parameter")
        defaults = _PREFIX_DEFAULTS
        block = self.integer(f"{path}.block_chars", body.get("block_chars"), *_BLOCK_CHARS)
        blocks = self.integer(f"{path}.max_blocks", body.get("max_blocks"), *_MAX_BLOCKS)
        return PrefixParams(
            block or defaults.block_chars,
            blocks or defaults.max_blocks,
            self.threshold(body, path, "balance_threshold", "a capacity fraction", 0.0, 1.0),
            self.threshold(body, path, "balance_rel_threshold", "a ratio of loads", 1.0),
            self.threshold(body, path, "cache_threshold", "a fraction of the prompt", 0.0, 1.0),
        )

    def threshold(
        self,
        body: dict[Any, Any],
        path: str,
        name: str,
        unit: str,
        low: float,
        high: float | None = None,
    ) -> float:
        """The number under `name`, within its range, or its default. A fraction past 1
        is a percentage written as one (`cache_threshold: 70`): a share of the prompt no
        match covers, a load gap no agent reaches. A ratio of loads under 1 is met by
        every busier agent, and leaves a new conversation no room (fewest blocks times
        the ratio) but the least-loaded agent."""
        default: float = getattr(_PREFIX_DEFAULTS, name)
        if name not in body:
            return default
        value = body[name]
        if not is_number(value) or not math.isfinite(value) or value < low:
            self.error(
                f"{path}.{name}",
                f"must be a finite number of at least {low:g} ({unit}), got {shown(value)}",
            )
            return default
        if high is not None and value > high:
            self.error(f"{path}.{name}", f"must be at most {high:g} ({unit}), got {shown(value)}")
            return default
        return float(value)

    def max_tries(self, path: str, raw: object) -> int:
        if raw is None:
            return 0
        if not isinstance(raw, int) or isinstance(raw, bool):
            self.error(path, f"must be an integer, got {kind(raw)}")
            return 0
        return raw

    def provider(self, document: dict[Any, Any]) -> ProviderFallback | None:
        if "fallback_provider" not in document:
            return None
        path = "fallback_provider"
        raw = document[path]
        if not isinstance(raw, dict):
            self.error(
                path,
                f"must be a mapping with engine and model, got {kind(raw)}"
                " (remove the key for no provider fallback)",
            )
            return None
        self.unknown_keys(f"{path}.", raw, PROVIDER_KEYS, "unknown key")
        engine = self.required_string(f"{path}.engine", raw, "openai or anthropic")
        if engine and engine not in PROVIDER_ENGINES:
            self.error(f"{path}.engine", f"must be openai or anthropic, got {shown(engine)}")
            engine = ""
        model = self.required_string(f"{path}.model", raw, "the provider's model name")
        if not engine or not model:
            return None
        return ProviderFallback(engine, model)

    def unique_names(self, steps: tuple[Step, ...]) -> None:
        first: dict[str, int] = {}
        for i, step in enumerate(steps):
            if step.name in first:
                where = _step_path(i)
                earlier = _step_path(first[step.name])
                self.error(
                    f"{where}.name",
                    f"duplicate step name {step.name!r} (also {earlier}); logs could not"
                    " tell the steps apart",
                )
            else:
                first[step.name] = i


_KNOWN: tuple[str, ...] = tuple(STRATEGIES)
PREFIX_PARAM_KEYS: tuple[str, ...] = (
    "block_chars",
    "max_blocks",
    "balance_threshold",
    "balance_rel_threshold",
    "cache_threshold",
)
_PREFIX_DEFAULTS = PrefixParams()
# A block under 16 characters (4 tokens) costs a dict lookup per word; over 64 KiB a
# long prompt would share no block with its own next turn.
_BLOCK_CHARS = (16, 65_536)
# 10 M nodes is about 3 GB of router memory: past that a typo, not a tree size.
_MAX_BLOCKS = (1, 10_000_000)

# Keys that are valid one level up or down: usually lost or extra indentation.
_MISPLACED_TOP: dict[str, str] = dict.fromkeys(
    STEP_KEYS, "; check the indentation: it belongs inside routing_policy or a fallback step"
)
_MISPLACED_IN_STEP: dict[str, str] = {
    **dict.fromkeys((*MATCH_FIELDS, "tags"), "; it belongs under match"),
    **dict.fromkeys(GATE_FIELDS, "; it belongs under exclude_if"),
    **dict.fromkeys((*SHED_FIELDS, *SHED_SELECTORS, "retry_after"), "; it belongs under shed_if"),
    **dict.fromkeys(PREFIX_PARAM_KEYS, "; it belongs under strategy_params"),
    "fallback_provider": "; fallback_provider is a top-level field, not part of a step",
    "fallback_chain": "; fallback_chain is a top-level field, not part of a step",
}

_MISPLACED_IN_SHED: dict[str, str] = {
    **dict.fromkeys(
        GATE_FIELDS,
        "; shed_if reads router-wide load, not one agent's metrics:"
        " per-agent fields belong under exclude_if",
    ),
    "capacity_utilization": "; did you mean 'model_capacity_utilization'? (capacity_utilization"
    " is one agent's, under exclude_if)",
    "queue_depth": "; did you mean 'model_queue_depth' or 'total_queue_depth'?",
    "tenant": "; did you mean 'tenants' (a list)?",
}


def _step_path(index: int) -> str:
    return PRIMARY if index == 0 else f"fallback_chain[{index - 1}]"
