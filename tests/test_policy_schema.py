"""Loading and validating policy YAML, and describing a policy for check-policy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from router.policy.describe import describe, policy_warnings
from router.policy.rank import STRATEGIES
from router.policy.rank_prefix import PrefixParams
from router.policy.schema import (
    DEFAULT_POLICY_YAML,
    GATE_FIELDS,
    Match,
    Policy,
    PolicyError,
    ProviderFallback,
    Rule,
    Step,
    default_policy,
    load_policy,
    load_policy_file,
)

PRODUCTION = """\
# Primary: production vLLM agents in France
routing_policy:
  match:
    region: EU-France
    engine: vllm
    tags:
      - production
  exclude_if:
    kv_cache_utilization:
      gt: 0.85
    gpu_temperature_c:
      gt: 82
    success_rate:
      lt: 0.95
    srtt:
      gt: 500
  strategy: least-loaded
  max_tries: 3

# Fallback: any vLLM region with relaxed health thresholds
fallback_chain:
  - name: any-vllm-region
    match:
      engine: vllm
    exclude_if:
      success_rate:
        lt: 0.9
    strategy: least-loaded
    max_tries: 2

# Last resort for language-model chat requests
fallback_provider:
  engine: openai
  model: gpt-4o-mini
"""


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy(text)
    return caught.value.errors


def primary(body: str) -> str:
    """A policy whose routing_policy has `body` (indented two spaces) and a strategy."""
    lines = "".join(f"  {line}\n" for line in body.strip("\n").splitlines())
    return f"routing_policy:\n{lines}  strategy: least-loaded\n"


# --- what loads ------------------------------------------------------------------------


def test_production_example_loads_into_exact_objects() -> None:
    policy = load_policy(PRODUCTION)
    assert policy == Policy(
        routing_policy=Step(
            name="routing_policy",
            match=Match(region="EU-France", engine="vllm", tags=("production",)),
            exclude_if=(
                Rule("kv_cache_utilization", "gt", 0.85),
                Rule("gpu_temperature_c", "gt", 82.0),
                Rule("success_rate", "lt", 0.95),
                Rule("srtt", "gt", 500.0),
            ),
            strategy="least-loaded",
            max_tries=3,
        ),
        fallback_chain=(
            Step(
                name="any-vllm-region",
                match=Match(engine="vllm"),
                exclude_if=(Rule("success_rate", "lt", 0.9),),
                strategy="least-loaded",
                max_tries=2,
            ),
        ),
        fallback_provider=ProviderFallback("openai", "gpt-4o-mini"),
        source=PRODUCTION,
    )
    assert policy.chain_names() == ["routing_policy", "any-vllm-region"]
    assert policy.steps == (policy.routing_policy, *policy.fallback_chain)


def test_default_policy_is_the_seeds_default() -> None:
    policy = default_policy()
    assert policy.routing_policy == Step("routing_policy", Match(), (), "least-loaded", 0)
    assert policy.fallback_chain == ()
    assert policy.fallback_provider is None
    assert policy.source == DEFAULT_POLICY_YAML
    assert policy.chain_names() == ["routing_policy"]


def test_unnamed_fallback_steps_are_named_by_position() -> None:
    text = primary("match: {}") + (
        "fallback_chain:\n"
        "  - strategy: least-loaded\n"
        "  - name: named\n    strategy: least-loaded\n"
        "  - strategy: least-loaded\n"
    )
    assert load_policy(text).chain_names() == [
        "routing_policy",
        "fallback_chain[0]",
        "named",
        "fallback_chain[2]",
    ]


@pytest.mark.parametrize(
    ("written", "budget"),
    [("", 3), ("max_tries: 0", 3), ("max_tries: -2", 3), ("max_tries: 1", 1), ("max_tries: 5", 5)],
)
def test_max_tries_zero_omitted_or_negative_uses_the_router_default(
    written: str, budget: int
) -> None:
    step = load_policy(primary(written or "match: {}")).routing_policy
    assert step.budget(3) == budget


def test_empty_match_and_exclude_if_restrict_nothing() -> None:
    for body in ("match: {}\nexclude_if: {}", "match:\nexclude_if:", "max_tries: 1"):
        step = load_policy(primary(body)).routing_policy
        assert (step.match, step.exclude_if) == (Match(), ())


def test_integer_thresholds_become_floats() -> None:
    rule = load_policy(primary("exclude_if:\n  srtt: {gt: 500}")).routing_policy.exclude_if[0]
    assert rule == Rule("srtt", "gt", 500.0)
    assert type(rule.threshold) is float


def test_negative_threshold_is_valid() -> None:
    # The seeds' way to force a step to drain while testing a chain.
    text = primary("exclude_if:\n  success_rate:\n    gt: -1")
    assert load_policy(text).routing_policy.exclude_if == (Rule("success_rate", "gt", -1.0),)


def test_objects_are_immutable() -> None:
    policy = load_policy(PRODUCTION)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.routing_policy.max_tries = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.routing_policy.match.region = "US"  # type: ignore[misc]
    assert hash(policy.routing_policy)  # usable as a key


def test_all_16_gate_fields_and_4_operators_load() -> None:
    body = "exclude_if:\n" + "".join(
        f"  {field}: {{{('gt', 'gte', 'lt', 'lte')[i % 4]}: {i}}}\n"
        for i, field in enumerate(GATE_FIELDS)
    )
    rules = load_policy(primary(body)).routing_policy.exclude_if
    assert [(r.field, r.op, r.threshold) for r in rules] == [
        (field, ("gt", "gte", "lt", "lte")[i % 4], float(i)) for i, field in enumerate(GATE_FIELDS)
    ]


def test_load_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(PRODUCTION, encoding="utf-8")
    assert load_policy_file(path) == load_policy(PRODUCTION)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy_file(tmp_path / "missing.yaml")


# --- what does not load, and the message for it ----------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            primary("exclude_if:\n  kv_cache_utilizaton:\n    gt: 0.85"),
            "routing_policy.exclude_if.kv_cache_utilizaton: unknown gate field (known: "
            + ", ".join(GATE_FIELDS)
            + "); did you mean 'kv_cache_utilization'?",
        ),
        (
            primary("exclude_if:\n  success_rate:\n    lt: 0.95\n    gt: 0.5"),
            "routing_policy.exclude_if.success_rate: exactly one operator required, got 2 (lt, gt)",
        ),
        (
            primary("exclude_if:\n  success_rate: {}"),
            "routing_policy.exclude_if.success_rate: exactly one operator required, got 0",
        ),
        (
            primary("exclude_if:\n  waiting_requests: {ge: 1}"),
            "routing_policy.exclude_if.waiting_requests.ge: unknown operator"
            " (known: gt, gte, lt, lte); did you mean 'gte'?",
        ),
        (
            primary("exclude_if:\n  srtt: 500"),
            "routing_policy.exclude_if.srtt: must be a mapping of one operator to a threshold,"
            " e.g. {gt: 0.9}, got number 500",
        ),
        (
            primary("exclude_if:\n  srtt: {gt: '500'}"),
            "routing_policy.exclude_if.srtt.gt: threshold must be a number, got string '500'",
        ),
        (
            primary("exclude_if:\n  srtt: {gt: true}"),
            "routing_policy.exclude_if.srtt.gt: threshold must be a number,"
            " got boolean true (quote the value if it is text)",
        ),
        (
            primary("exclude_if:\n  srtt: {gt: .nan}"),
            "routing_policy.exclude_if.srtt.gt: threshold must be a finite number, got nan",
        ),
        (
            primary("exclude_if: [srtt]"),
            "routing_policy.exclude_if: must be a mapping of gate fields, got a list",
        ),
        ("routing_policy:\n  match: {}\n", "routing_policy.strategy: missing (required)"),
        (
            primary("match: {}") + "fallback_chain:\n  - strategy: round_robin\n",
            "fallback_chain[0].strategy: unknown strategy 'round_robin' (one of "
            + ", ".join(STRATEGIES)
            + "); did you mean 'round-robin'?",
        ),
        (
            "routing_policy:\n  strategy: least_loaded\n",
            "routing_policy.strategy: unknown strategy 'least_loaded' (one of "
            + ", ".join(STRATEGIES)
            + "); did you mean 'least-loaded'?",
        ),
        (
            "routing_policy:\n  strategy: 1\n",
            "routing_policy.strategy: must be a string, got number 1",
        ),
        (
            primary("max_tries: two"),
            "routing_policy.max_tries: must be an integer, got string 'two'",
        ),
        (
            primary("max_tries: 2.0"),
            "routing_policy.max_tries: must be an integer, got number 2.0",
        ),
        (
            primary("max_tries: yes"),
            "routing_policy.max_tries: must be an integer,"
            " got boolean true (quote the value if it is text)",
        ),
        (
            primary("match:\n  model: llama"),
            "routing_policy.match.model: unknown match field"
            " (known: region, engine, organization, machine, gpu_model, tags);"
            " did you mean 'gpu_model'?",
        ),
        (
            primary("match:\n  region: NO"),
            "routing_policy.match.region: must be a string,"
            " got boolean false (quote the value if it is text)",
        ),
        (
            primary("match:\n  tags: production,high-memory"),
            "routing_policy.match.tags: must be a list of strings,"
            " got string 'production,high-memory'",
        ),
        (
            primary("match:\n  tags: [production, 7]"),
            "routing_policy.match.tags[1]: must be a non-empty string, got number 7",
        ),
        (
            primary("match: vllm"),
            "routing_policy.match: must be a mapping of metadata fields, got string 'vllm'",
        ),
        (
            primary("region: EU"),
            "routing_policy.region: unknown step key"
            " (known: name, match, exclude_if, shed_if, strategy, strategy_params, max_tries);"
            " it belongs under match",
        ),
        (
            primary("srtt: {gt: 500}"),
            "routing_policy.srtt: unknown step key"
            " (known: name, match, exclude_if, shed_if, strategy, strategy_params, max_tries);"
            " it belongs under exclude_if",
        ),
        (
            primary("name: primary"),
            "routing_policy.name: not allowed (the primary step is always routing_policy)",
        ),
        (
            primary("match: {}") + "fallback_chain:\n  - name: 7\n    strategy: least-loaded\n",
            "fallback_chain[0].name: must be a non-empty string, got number 7",
        ),
        (
            primary("match: {}")
            + "fallback_chain:\n  - name: a\n    strategy: least-loaded\n"
            + "  - name: a\n    strategy: least-loaded\n",
            "fallback_chain[1].name: duplicate step name 'a' (also fallback_chain[0]);"
            " logs could not tell the steps apart",
        ),
        (
            primary("match: {}")
            + "fallback_chain:\n  - name: routing_policy\n    strategy: least-loaded\n",
            "fallback_chain[0].name: duplicate step name 'routing_policy' (also routing_policy);"
            " logs could not tell the steps apart",
        ),
        (
            primary("match: {}") + "fallback_chain:\n  strategy: least-loaded\n",
            "fallback_chain: must be a list of steps, got a mapping",
        ),
        (
            primary("match: {}") + "fallback_chain:\n  - least-loaded\n",
            "fallback_chain[0]: must be a mapping (a policy step), got string 'least-loaded'",
        ),
        (
            primary("match: {}")
            + "fallback_chain:\n  - strategy: least-loaded\n"
            + "    fallback_provider: {engine: openai, model: gpt-4o-mini}\n",
            "fallback_chain[0].fallback_provider: unknown step key"
            " (known: name, match, exclude_if, shed_if, strategy, strategy_params, max_tries);"
            " fallback_provider is a top-level field, not part of a step",
        ),
        (
            primary("match: {}") + "fallback_provider:\n  engine: openai\n",
            "fallback_provider.model: missing (required: the provider's model name)",
        ),
        (
            primary("match: {}") + "fallback_provider:\n  engine: openai\n  model: ''\n",
            "fallback_provider.model: must not be empty (required: the provider's model name)",
        ),
        (
            primary("match: {}") + "fallback_provider:\n  model: gpt-4o-mini\n",
            "fallback_provider.engine: missing (required: openai or anthropic)",
        ),
        (
            primary("match: {}") + "fallback_provider:\n  engine: azure\n  model: gpt-4o\n",
            "fallback_provider.engine: must be openai or anthropic, got 'azure'",
        ),
        (
            primary("match: {}") + "fallback_provider:\n",
            "fallback_provider: must be a mapping with engine and model, got null"
            " (remove the key for no provider fallback)",
        ),
        (
            primary("match: {}")
            + "fallback_provider:\n  engine: openai\n  model: gpt-4o\n  api_key: sk\n",
            "fallback_provider.api_key: unknown key (known: engine, model)",
        ),
        (
            primary("match: {}") + "fallback_chains: []\n",
            "fallback_chains: unknown top-level key"
            " (known: routing_policy, fallback_chain, fallback_provider);"
            " did you mean 'fallback_chain'?",
        ),
        ("", "routing_policy: missing (required)"),
        ("fallback_chain: []\n", "routing_policy: missing (required)"),
        (
            "routing_policy:\n",
            "routing_policy: empty (required: a step with at least a strategy)",
        ),
        (
            "- routing_policy\n",
            "policy: the document must be a mapping with routing_policy at the top level,"
            " got a list",
        ),
        (
            "routing_policy:\n  strategy: least-loaded\n  strategy: round-robin\n",
            "routing_policy.strategy: duplicate key at line 3 (only the last one would apply)",
        ),
    ],
)
def test_error_message(text: str, expected: str) -> None:
    assert expected in errors_of(text)


def test_lost_indentation_is_explained() -> None:
    # The seeds' default policy as routing-concepts.md prints it, indentation lost.
    errors = errors_of("routing_policy:\nmatch: {}\nstrategy: least-loaded\n")
    hint = (
        "unknown top-level key (known: routing_policy, fallback_chain, fallback_provider);"
        " check the indentation: it belongs inside routing_policy or a fallback step"
    )
    assert errors == [
        f"match: {hint}",
        f"strategy: {hint}",
        "routing_policy: empty (required: a step with at least a strategy)",
    ]


def test_bad_yaml_names_the_line() -> None:
    text = "routing_policy:\n  match:\n    engine: vllm\n   strategy: least-loaded\n"
    [error] = errors_of(text)
    assert error.startswith("line 4, column 4: invalid YAML: ")


def test_every_error_is_collected() -> None:
    text = """\
routing_policy:
  match:
    region: EU
    colour: blue
  exclude_if:
    kv_cache_utilizaton: {gt: 0.85}
    success_rate: {lt: 0.95, gt: 0.5}
  max_tries: 1.5
fallback_chain:
  - name: relaxed
    strategy: round_robin
  - strategy: best_ttft
    exclude_if:
      srtt: {gt: fast}
fallback_provider:
  engine: anthropic
"""
    errors = errors_of(text)
    assert [error.split(":")[0] for error in errors] == [
        "routing_policy.match.colour",
        "routing_policy.exclude_if.kv_cache_utilizaton",
        "routing_policy.exclude_if.success_rate",
        "routing_policy.strategy",
        "routing_policy.max_tries",
        "fallback_chain[0].strategy",
        "fallback_chain[1].exclude_if.srtt.gt",
        "fallback_chain[1].strategy",
        "fallback_provider.model",
    ]


def test_policy_error_is_a_value_error_listing_everything() -> None:
    with pytest.raises(ValueError, match=r"^invalid policy: routing_policy.strategy: missing"):
        load_policy("routing_policy:\n  match: {}\n")
    error = PolicyError(["a: x", "b: y"])
    assert str(error) == "invalid policy: a: x; b: y"
    assert error.errors == ["a: x", "b: y"]


def test_rule_violated() -> None:
    assert Rule("srtt", "gt", 500).violated(500.1)
    assert not Rule("srtt", "gt", 500).violated(500)
    assert Rule("srtt", "gte", 500).violated(500)
    assert Rule("success_rate", "lt", 0.95).violated(0.94)
    assert not Rule("success_rate", "lt", 0.95).violated(0.95)
    assert Rule("success_rate", "lte", 0.95).violated(0.95)
    assert not Rule("success_rate", "lte", 0.95).violated(0.96)
    with pytest.raises(ValueError, match="unknown operator '=='"):
        Rule("srtt", "==", 1).violated(1)


# --- describe (check-policy) -----------------------------------------------------------


def test_describe_production_example() -> None:
    assert describe(load_policy(PRODUCTION), 3) == (
        "chain: routing_policy → any-vllm-region → provider openai (gpt-4o-mini)\n"
        "\n"
        "step 1: routing_policy\n"
        "  match:      region = 'EU-France', engine = 'vllm', tags include 'production'\n"
        "  exclude_if: kv_cache_utilization > 0.85\n"
        "              gpu_temperature_c > 82 °C\n"
        "              success_rate < 0.95\n"
        "              srtt > 500 ms\n"
        "  strategy:   least-loaded\n"
        "  max_tries:  3\n"
        "\n"
        "step 2: any-vllm-region\n"
        "  match:      engine = 'vllm'\n"
        "  exclude_if: success_rate < 0.9\n"
        "  strategy:   least-loaded\n"
        "  max_tries:  2\n"
        "\n"
        "fallback_provider: openai, model gpt-4o-mini"
        " (llm requests, streamed or whole; never embeddings or rerank;"
        " needs HIVENET_ROUTER_OPENAI_API_KEY)\n"
    )


def test_describe_default_policy_uses_the_router_wide_budget() -> None:
    assert describe(default_policy(), 5) == (
        "chain: routing_policy\n"
        "\n"
        "step 1: routing_policy\n"
        "  match:      any agent\n"
        "  exclude_if: none\n"
        "  strategy:   least-loaded\n"
        "  max_tries:  5 (router-wide --max-tries-per-step)\n"
        "\n"
        "fallback_provider: none (the request fails when every step is exhausted)\n"
    )


def test_warnings_for_the_seeds_common_mistakes() -> None:
    text = primary("exclude_if:\n  gpu_util_percent: {gt: 95}\n  srtt: {gt: 0.5}") + (
        "fallback_chain:\n"
        "  - name: same-agents-again\n"
        "    exclude_if:\n"
        "      gpu_util_percent: {gt: 95}\n"
        "      srtt: {gt: 0.5}\n"
        "    strategy: least-loaded\n"
    )
    policy = load_policy(text)
    warnings = [
        "routing_policy.exclude_if.gpu_util_percent.gt: 95 is outside 0.0 to 1.0,"
        " but gpu_util_percent is a fraction (did you mean 0.95?)",
        "routing_policy.exclude_if.srtt.gt: srtt is in milliseconds; 0.5 ms is far below"
        " any real round trip (did you mean 500?)",
        "fallback_chain[0].exclude_if.gpu_util_percent.gt: 95 is outside 0.0 to 1.0,"
        " but gpu_util_percent is a fraction (did you mean 0.95?)",
        "fallback_chain[0].exclude_if.srtt.gt: srtt is in milliseconds; 0.5 ms is far below"
        " any real round trip (did you mean 500?)",
        "fallback_chain[0]: same match and exclude_if as routing_policy; it selects from the"
        " same agents again, so it can only retry them",
    ]
    assert policy_warnings(policy) == warnings
    assert policy_warnings(load_policy(PRODUCTION)) == []


# --- strategies and strategy_params ------------------------------------------------------


def prefix_step(params: str = "") -> str:
    text = "routing_policy:\n  match: {}\n  strategy: prefix-aware\n"
    return text + (f"  strategy_params:\n{params}" if params else "")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_name_loads(name: str) -> None:
    step = load_policy(f"routing_policy:\n  strategy: {name}\n").routing_policy
    assert step.strategy == name
    assert (step.strategy_params is not None) == (name == "prefix-aware")


def test_prefix_aware_parameters_have_documented_defaults() -> None:
    params = load_policy(prefix_step()).routing_policy.strategy_params
    assert params == PrefixParams(
        block_chars=1024,
        max_blocks=65_536,
        balance_threshold=0.375,
        balance_rel_threshold=1.5,
        cache_threshold=0.7,
    )
    written = prefix_step(
        "    block_chars: 64\n    max_blocks: 1000\n    balance_threshold: 1\n"
        "    balance_rel_threshold: 2\n    cache_threshold: 0.5\n"
    )
    policy = load_policy(written)
    assert policy.routing_policy.strategy_params == PrefixParams(64, 1000, 1.0, 2.0, 0.5)
    assert (
        "block_chars 64, max_blocks 1000, balance_threshold 1, balance_rel_threshold 2,"
        " cache_threshold 0.5" in describe(policy, 3)
    )


@pytest.mark.parametrize(("name", "low"), [("balance_rel_threshold", 1), ("cache_threshold", 0)])
@pytest.mark.parametrize("value", ["-0.5", ".inf", ".nan", "yes", "'0.5'"])
def test_prefix_aware_thresholds_must_be_finite_and_in_range(
    name: str, low: int, value: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(prefix_step(f"    {name}: {value}\n"))
    expected = f"routing_policy.strategy_params.{name}: must be a finite number of at least {low}"
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        # Percentages written as such: a threshold no prompt, or no agent, ever reaches.
        (
            "cache_threshold: 70",
            "cache_threshold: must be at most 1 (a fraction of the prompt), got 70",
        ),
        (
            "cache_threshold: 1.01",
            "cache_threshold: must be at most 1 (a fraction of the prompt), got 1.01",
        ),
        (
            "balance_threshold: 37.5",
            "balance_threshold: must be at most 1 (a capacity fraction), got 37.5",
        ),
        # Under 1 no new conversation has room but on the least-loaded agent.
        (
            "balance_rel_threshold: 0.5",
            "balance_rel_threshold: must be a finite number of at"
            " least 1 (a ratio of loads), got 0.5",
        ),
    ],
)
def test_prefix_aware_thresholds_out_of_range_are_named(written: str, expected: str) -> None:
    assert "routing_policy.strategy_params." + expected in errors_of(
        prefix_step(f"    {written}\n")
    )


def test_prefix_aware_thresholds_at_their_bounds_load() -> None:
    written = "    balance_threshold: 0\n    balance_rel_threshold: 1\n    cache_threshold: 1\n"
    params = load_policy(prefix_step(written)).routing_policy.strategy_params
    assert params == PrefixParams(
        balance_threshold=0.0, balance_rel_threshold=1.0, cache_threshold=1.0
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "routing_policy:\n  strategy: prefix_aware\n",
            "routing_policy.strategy: unknown strategy 'prefix_aware' (one of "
            + ", ".join(STRATEGIES)
            + "); did you mean 'prefix-aware'?",
        ),
        (
            prefix_step("    balance_treshold: 0.5\n"),
            "routing_policy.strategy_params.balance_treshold: unknown prefix-aware parameter"
            " (known: block_chars, max_blocks, balance_threshold, balance_rel_threshold,"
            " cache_threshold); did you mean 'balance_threshold'?",
        ),
        (
            prefix_step("    block_chars: 8\n"),
            "routing_policy.strategy_params.block_chars: must be between 16 and 65536, got 8",
        ),
        (
            prefix_step("    block_chars: 100000\n"),
            "routing_policy.strategy_params.block_chars: must be between 16 and 65536, got 100000",
        ),
        (
            prefix_step("    max_blocks: 0\n"),
            "routing_policy.strategy_params.max_blocks: must be between 1 and 10000000, got 0",
        ),
        (
            prefix_step("    max_blocks: lots\n"),
            "routing_policy.strategy_params.max_blocks: must be an integer, got string 'lots'",
        ),
        (
            prefix_step("    balance_threshold: -0.5\n"),
            "routing_policy.strategy_params.balance_threshold: must be a finite number of at"
            " least 0 (a capacity fraction), got -0.5",
        ),
        (
            prefix_step("    balance_threshold: .inf\n"),
            "routing_policy.strategy_params.balance_threshold: must be a finite number of at"
            " least 0 (a capacity fraction), got inf",
        ),
        (
            prefix_step("    balance_threshold: yes\n"),
            "routing_policy.strategy_params.balance_threshold: must be a finite number of at"
            " least 0 (a capacity fraction), got True",
        ),
        (
            "routing_policy:\n  strategy: prefix-aware\n  strategy_params: [1]\n",
            "routing_policy.strategy_params: must be a mapping, got a list",
        ),
        (
            "routing_policy:\n  strategy: round-robin\n  strategy_params: {max_blocks: 5}\n",
            "routing_policy.strategy_params: strategy 'round-robin' takes no parameters"
            " (only prefix-aware does)",
        ),
        (
            "routing_policy:\n  strategy: prefix-aware\n  balance_threshold: 0.5\n",
            "routing_policy.balance_threshold: unknown step key (known: name, match, exclude_if,"
            " shed_if, strategy, strategy_params, max_tries); it belongs under strategy_params",
        ),
    ],
)
def test_strategy_errors(text: str, expected: str) -> None:
    assert expected in errors_of(text)
