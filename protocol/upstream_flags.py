"""Flags and variables of the Go router that mean nothing here: accepted, each with
one warning line that names it and says what happens instead.

An operator switching from the Go router keeps its unit files (issue 47: its
bare-metal units start as written). A flag this project has no use for (the gRPC
link, its session token) therefore must not stop the daemon; but silently ignoring it
would leave an operator believing a port is served that is not, so each one that is
set is named once in the log at start, with what the daemon does instead.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.logs import quote


@dataclass(frozen=True)
class Ignored:
    """One upstream flag (and its variable, if it has one) and what happens instead."""

    flag: str
    env: str | None
    instead: str
    # Whether the flag takes a value (`--grpc-port :50051`) or is a switch.
    takes_value: bool = True

    @property
    def dest(self) -> str:
        return f"upstream_{self.flag.strip('-').replace('-', '_')}"


def add_ignored(parser: argparse.ArgumentParser, table: Sequence[Ignored]) -> None:
    """Each flag of `table` as a hidden option whose value lands in `entry.dest`."""
    for entry in table:
        parser.add_argument(
            entry.flag,
            nargs=None if entry.takes_value else 0,
            default=None,
            help=argparse.SUPPRESS,
            dest=entry.dest,
        )


def ignored_warnings(
    args: argparse.Namespace, env: Mapping[str, str], table: Sequence[Ignored]
) -> list[str]:
    """One `upstream_flag_ignored` line for each entry set by flag or variable (an
    empty variable counts as unset); the flag wins when both are set."""
    lines = []
    for entry in table:
        value: Any = getattr(args, entry.dest, None)
        name = entry.flag
        if value is None and entry.env and env.get(entry.env):
            value, name = env[entry.env], entry.env
        if value is None:
            continue
        shown = value if isinstance(value, str) else ""
        lines.append(
            f"upstream_flag_ignored flag={name} value={quote(shown)} instead={quote(entry.instead)}"
        )
    return lines


def warn_ignored(
    log: logging.Logger,
    args: argparse.Namespace,
    env: Mapping[str, str],
    table: Sequence[Ignored],
) -> None:
    for line in ignored_warnings(args, env, table):
        log.warning("%s", line)
