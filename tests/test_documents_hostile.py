"""Hostile policies, auth files and key registries: each is refused with a short, clear
error, in bounded time, and none stops the daemon (a reload runs in its signal task,
where an exception would end the router)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from protocol.secrets import MAX_SECRET_FILE_BYTES, load_previous_secret, load_secret
from router import documents
from router.documents import MAX_ERRORS, MAX_FILE_BYTES, read_text
from router.metrics import RouterMetrics
from router.policy.models import check_name
from router.policy.schema import MAX_FALLBACK_STEPS, PolicyError, load_policy
from router.policy.store import PolicyStore
from router.settings import MAX_KEYS_FILE_BYTES, read_admin_keys
from router.tenants.config import AuthError, load_auth
from router.tenants.registry import rfc3339

HUGE = "1" + "0" * 400  # an integer no float holds


def policy_errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as refused:
        load_policy(text)
    return refused.value.errors


@pytest.mark.parametrize(
    "body",
    [
        f"exclude_if: {{srtt: {{gt: {HUGE}}}}}",
        f"strategy_params: {{block_chars: {HUGE}}}",
        f"shed_if: {{model_capacity_utilization: {{gte: {HUGE}}}}}",
    ],
)
def test_an_integer_past_a_float_is_an_error_not_an_overflow(body: str) -> None:
    strategy = "prefix-aware" if "strategy_params" in body else "least-loaded"
    errors = policy_errors(f"routing_policy:\n  strategy: {strategy}\n  {body}\n")
    assert any("too large" in e for e in errors), errors
    assert all(len(e) < 300 for e in errors), errors


def test_an_auth_file_integer_past_a_float_is_an_error() -> None:
    text = f"tenants:\n  t:\n    keys: ['{'a' * 64}']\n    requests_per_minute: {HUGE}\n"
    with pytest.raises(AuthError) as refused:
        load_auth(text)
    assert any("requests_per_minute" in e and "too large" in e for e in refused.value.errors)


def test_an_alias_bomb_is_quoted_by_its_beginning() -> None:
    """Nine levels of nine aliases: a 450-byte document whose value's full repr would
    be gigabytes."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        levels.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    text = (
        "bomb:\n"
        + "".join(f"  {line}\n" for line in levels)
        + "routing_policy:\n  strategy: prefix-aware\n  strategy_params:\n"
        + "    balance_threshold: *a8\n"
    )
    started = time.monotonic()
    errors = policy_errors(text)
    assert time.monotonic() - started < 5
    assert all(len(e) < 500 for e in errors), [len(e) for e in errors]
    assert any("balance_threshold" in e for e in errors), errors


def test_errors_past_the_hundredth_are_counted_not_listed() -> None:
    keys = "".join(f"junk{i}: 1\n" for i in range(500))
    errors = policy_errors(keys + "routing_policy:\n  strategy: least-loaded\n")
    assert len(errors) == MAX_ERRORS + 1
    assert "not listed" in errors[-1]


def test_duplicate_keys_past_the_hundredth_are_counted_not_listed() -> None:
    text = "routing_policy:\n  strategy: least-loaded\n" + "x: 1\n" * 500
    errors = policy_errors(text)
    assert len(errors) == MAX_ERRORS + 1 and "not listed" in errors[-1]
    assert errors[0].startswith("x: duplicate key at line 4")


def test_a_chain_past_the_most_steps_is_refused_before_its_steps_are_checked() -> None:
    step = "  - {strategy: least-loaded, exclude_if: {srtt: {gt: 500}}}\n"
    text = "routing_policy:\n  strategy: least-loaded\nfallback_chain:\n" + step * 5000
    started = time.monotonic()
    errors = policy_errors(text)
    assert time.monotonic() - started < 5
    assert errors == [f"fallback_chain: 5000 steps, at most {MAX_FALLBACK_STEPS}"]
    load_policy(
        "routing_policy:\n  strategy: least-loaded\nfallback_chain:\n"
        + "".join(f"  - {{name: s{i}, strategy: least-loaded}}\n" for i in range(64))
    )


def test_a_file_that_is_no_regular_file_or_too_large_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "policy.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        read_text(fifo)  # would block the daemon until a writer came
    with pytest.raises(OSError, match="not a regular file"):
        read_text("/dev/zero")  # would never end
    big = tmp_path / "big.yaml"
    with big.open("wb") as file:
        file.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing written
    with pytest.raises(OSError, match="larger than"):
        read_text(big)


def test_a_reload_from_a_fifo_is_refused_and_the_policy_kept(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("routing_policy:\n  strategy: least-loaded\n")
    store = PolicyStore(RouterMetrics(), str(path))
    running = store.current
    path.unlink()
    os.mkfifo(path)
    errors = store.reload_file()
    assert errors and "not a regular file" in errors[0]
    assert store.current is running


def test_a_validator_bug_refuses_the_document_and_the_daemon_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = PolicyStore(RouterMetrics())
    running = store.current

    def broken(text: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(store, "parse", broken)
    errors = store.replace("routing_policy:\n  strategy: least-loaded\n", "sighup")
    assert errors == ["policy file could not be checked (RuntimeError)"]
    assert store.current is running


@pytest.mark.parametrize("offset", ["+99:99", "+24:00", "-23:60"])
def test_a_utc_offset_past_23_59_is_no_instant(offset: str) -> None:
    assert rfc3339(f"2027-01-01T00:00:00{offset}") is None
    assert rfc3339("2027-01-01T00:00:00+23:59") is not None


@pytest.mark.parametrize("name", [".", "..", "..."])
def test_a_policy_name_of_dots_alone_is_refused(name: str) -> None:
    assert check_name(name) is not None
    assert check_name("v1.2") is None


def test_secret_and_admin_key_files_are_read_the_same_guarded_way(tmp_path: Path) -> None:
    """Re-read on SIGHUP too: a FIFO put in a secret's place must not freeze the router."""
    fifo = tmp_path / "secret.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        load_secret(str(fifo))
    with pytest.raises(OSError, match="not a regular file"):
        load_previous_secret(str(fifo))
    with pytest.raises(ValueError, match="not a regular file"):
        read_admin_keys(str(fifo))
    big = tmp_path / "secret"
    big.write_bytes(b"s" * (MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(OSError, match="larger than"):
        load_secret(str(big))
    good = tmp_path / "good"
    good.write_bytes(b"s" * 40 + b"\n")
    assert load_secret(str(good)) == b"s" * 40
    keys = tmp_path / "admin-keys"
    keys.write_bytes(b"k" * (MAX_KEYS_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        read_admin_keys(str(keys))


def test_a_large_document_libyaml_refuses_is_not_parsed_again_by_the_pure_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pure-Python parser, only for a refused document's message, took 5.6 s of the
    router's thread to fail a 1 MiB one again (an admin PUT may send that much)."""
    parsers: list[object] = []
    parse = documents._parse

    def counted(text: str, loader: object) -> tuple[object, list[str]]:
        parsers.append(loader)
        return parse(text, loader)

    monkeypatch.setattr(documents, "_parse", counted)
    large = "".join(f"k{i}: {i}\n" for i in range(20_000)) + "broken: [\n"
    assert len(large) > documents.PURE_PARSER_BYTES
    with pytest.raises(documents.YamlInvalid):
        documents.parse_yaml(large)
    assert parsers == [documents._LOADER]
    with pytest.raises(documents.YamlInvalid):
        documents.parse_yaml("small: [\n")  # a small one still gets PyYAML's message
    assert parsers[1:] == [documents._LOADER, yaml.SafeLoader]
