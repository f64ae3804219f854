"""A loaded policy as an operator reads it: `hivenet-router check-policy FILE`.

The text is stable (tests compare it whole) so scripts and reviews can diff it. The
warnings flag values that load fine but are almost certainly mistakes, the ones the
seeds call out: percentages where fractions are expected, SRTT in seconds, and a
fallback step that repeats an earlier one exactly.
"""

from __future__ import annotations

from router.policy.schema import MATCH_FIELDS, Policy, Rule, Shed, Step

_SYMBOL = {"gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
_FRACTIONS = frozenset(
    {
        "capacity_utilization",
        "success_rate",
        "kv_cache_utilization",
        "gpu_util_percent",
        "gpu_vram_used_percent",
        "memory_used_percent",
        "cpu_usage_percent",
        "model_capacity_utilization",
    }
)
_UNITS = {
    "srtt": " ms",
    "gpu_temperature_c": " °C",
    "avg_ttft_seconds": " s",
    "p90_ttft_seconds": " s",
    "avg_itl_seconds": " s",
    "p90_itl_seconds": " s",
}
_PROVIDER_KEYS = {
    "openai": "HIVENET_ROUTER_OPENAI_API_KEY",
    "anthropic": "HIVENET_ROUTER_ANTHROPIC_API_KEY",
}


def describe(policy: Policy, default_max_tries: int) -> str:
    """The chain, each step's filters, gates, strategy and budget, and the provider.
    Warnings are `policy_warnings`', which check-policy prints after it."""
    chain = " → ".join(policy.chain_names())
    provider = policy.fallback_provider
    if provider is not None:
        chain += f" → provider {provider.engine} ({provider.model})"
    lines = [f"chain: {chain}"]
    if policy.models:
        lines.append(f"models: {', '.join(policy.models)} (a per-model file)")
    if policy.shed_if is not None:
        lines += ["", "front door (every request, before step 1):"]
        lines += _shed(policy.shed_if, "429 concurrency_limit_exceeded")
    for number, step in enumerate(policy.steps, start=1):
        lines += ["", f"step {number}: {step.name}", *_step(step, default_max_tries)]
    lines.append("")
    if provider is None:
        lines.append("fallback_provider: none (the request fails when every step is exhausted)")
    else:
        lines.append(
            f"fallback_provider: {provider.engine}, model {provider.model}"
            f" (llm requests, streamed or whole; never embeddings or rerank;"
            f" needs {_PROVIDER_KEYS[provider.engine]})"
        )
    return "\n".join(lines) + "\n"


def policy_warnings(policy: Policy) -> list[str]:
    """Valid settings that are probably mistakes, each naming the field's path."""
    warnings: list[str] = []
    paths = ["routing_policy"] + [f"fallback_chain[{i}]" for i in range(len(policy.fallback_chain))]
    front = [("shed_if", rule) for rule in policy.shed_if.rules] if policy.shed_if else []
    for path, step in [("", None), *zip(paths, policy.steps, strict=True)]:
        if step is None:
            located = front
        else:
            shed_rules = step.shed_if.rules if step.shed_if else ()
            located = [("exclude_if", rule) for rule in step.exclude_if]
            located += [("shed_if", rule) for rule in shed_rules]
        for key, rule in located:
            where = f"{path}.{key}.{rule.field}.{rule.op}".lstrip(".")
            value = _number(rule.threshold)
            if rule.field in _FRACTIONS and rule.threshold > 1:
                warnings.append(
                    f"{where}: {value} is outside 0.0 to 1.0, but {rule.field} is a fraction"
                    f" (did you mean {_number(rule.threshold / 100)}?)"
                )
            if rule.field == "srtt" and 0 < rule.threshold < 1:
                warnings.append(
                    f"{where}: srtt is in milliseconds; {value} ms is far below any real"
                    f" round trip (did you mean {_number(rule.threshold * 1000)}?)"
                )
    for later in range(1, len(policy.steps)):
        step = policy.steps[later]
        for earlier in policy.steps[:later]:
            if step.match == earlier.match and step.exclude_if == earlier.exclude_if:
                warnings.append(
                    f"{paths[later]}: same match and exclude_if as {earlier.name}; it selects"
                    " from the same agents again, so it can only retry them"
                )
                break
    return warnings


def _step(step: Step, default_max_tries: int) -> list[str]:
    match = [
        f"{name} = {getattr(step.match, name)!r}"
        for name in MATCH_FIELDS
        if getattr(step.match, name)
    ]
    if step.match.tags:
        match.append("tags include " + ", ".join(repr(tag) for tag in step.match.tags))
    rules = [_rule(rule) for rule in step.exclude_if] or ["none"]
    if step.max_tries > 0:
        budget = f"{step.max_tries}"
    else:
        budget = f"{step.budget(default_max_tries)} (router-wide --max-tries-per-step)"
    lines = [f"  match:      {', '.join(match) if match else 'any agent'}"]
    lines.append(f"  exclude_if: {rules[0]}")
    lines += [f"              {rule}" for rule in rules[1:]]
    if step.shed_if is not None:
        lines += _shed(step.shed_if)
    lines.append(f"  strategy:   {step.strategy}")
    if step.strategy_params is not None:
        params = step.strategy_params
        lines.append(
            f"              block_chars {params.block_chars}, max_blocks {params.max_blocks},"
            f" balance_threshold {_number(params.balance_threshold)},"
            f" balance_rel_threshold {_number(params.balance_rel_threshold)},"
            f" cache_threshold {_number(params.cache_threshold)}"
        )
    lines.append(f"  max_tries:  {budget}")
    return lines


def _shed(shed: Shed, answer: str = "503 load_shed") -> list[str]:
    """Shown only for steps that have it, so older policies print as they always did."""
    who = []
    if shed.tenants:
        who.append("tenants " + ", ".join(repr(t) for t in shed.tenants))
    if shed.priority is not None:
        who.append(f"priority {_SYMBOL[shed.priority.op]} {_number(shed.priority.threshold)}")
    rules = [_rule(rule) for rule in shed.rules]
    lines = [f"  shed_if:    {rules[0]}"]
    lines += [f"              {rule}" for rule in rules[1:]]
    lines.append(f"              applies to {' and '.join(who) if who else 'every request'}")
    lines.append(f"              {answer}, Retry-After: {shed.retry_after}")
    return lines


def _rule(rule: Rule) -> str:
    unit = _UNITS.get(rule.field, "")
    return f"{rule.field} {_SYMBOL[rule.op]} {_number(rule.threshold)}{unit}"


def _number(value: float) -> str:
    """82.0 as 82, 0.85 as 0.85: thresholds read as they were written."""
    return str(int(value)) if value.is_integer() else repr(value)
