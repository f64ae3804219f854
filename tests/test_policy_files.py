"""Every example policy in configs/policies/ loads; every one in invalid/ is rejected.

Each file states what it should produce in its header comments: `# expect: TEXT` lines
in invalid/ must each appear in one of the loader's error messages, and `# warning:
TEXT` lines in valid files must be exactly the warnings check-policy prints.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from router.policy.describe import describe, policy_warnings
from router.policy.rank_prefix import PrefixParams
from router.policy.schema import PolicyError, default_policy, load_policy_file

POLICIES = Path(__file__).resolve().parent.parent / "configs" / "policies"
VALID = sorted(POLICIES.glob("*.yaml"))
INVALID = sorted((POLICIES / "invalid").glob("*.yaml"))


def header(path: Path, key: str) -> list[str]:
    prefix = f"# {key}: "
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]


def test_the_example_sets_are_there() -> None:
    assert len(VALID) >= 30
    assert len(INVALID) >= 25
    names = {path.name for path in VALID}
    assert {"default.yaml", "production.yaml", "graduated-relaxation.yaml"} <= names


@pytest.mark.parametrize("path", VALID, ids=lambda path: path.name)
def test_valid_policy_loads(path: Path) -> None:
    policy = load_policy_file(path)
    assert policy.source == path.read_text(encoding="utf-8")
    # strategy-<name>.yaml shows one strategy each; every other example ranks by load.
    expected = path.stem.removeprefix("strategy-") if path.stem.startswith("strategy-") else ""
    assert policy.routing_policy.strategy == (expected or "least-loaded")
    assert policy_warnings(policy) == header(path, "warning")
    assert describe(policy, 3).startswith("chain: routing_policy")


@pytest.mark.parametrize("path", INVALID, ids=lambda path: path.name)
def test_invalid_policy_is_rejected_naming_the_field(path: Path) -> None:
    expected = header(path, "expect")
    assert expected, f"{path.name} has no '# expect:' line"
    with pytest.raises(PolicyError) as caught:
        load_policy_file(path)
    errors = caught.value.errors
    for text in expected:
        assert any(text in error for error in errors), (text, errors)


def test_the_default_file_is_the_built_in_default() -> None:
    loaded = load_policy_file(POLICIES / "default.yaml")
    assert loaded.steps == default_policy().steps
    assert loaded.fallback_provider is None


def test_the_prefix_aware_example_shows_the_defaults_it_says_it_shows() -> None:
    loaded = load_policy_file(POLICIES / "strategy-prefix-aware.yaml")
    assert loaded.routing_policy.strategy_params == PrefixParams()
