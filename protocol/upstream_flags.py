"""Flags and variables of the Go router that mean nothing here, refused by name.

An operator switching from the Go router keeps its unit files; a flag this project
has no use for (the gRPC link, the BadgerDB store) must stop the daemon with what to
do instead, never be accepted and ignored: an ignored `--grpc-port` would leave an
operator believing a port is served that is not.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refused:
    """One upstream flag (and its variable, if it has one) and what to use instead."""

    flag: str
    env: str | None
    instead: str
    # Whether the flag takes a value (`--grpc-port :50051`) or is a switch.
    takes_value: bool = True


class _RefuseAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        self.refused: Refused = kwargs.pop("refused")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error(
            f"{self.refused.flag} is a Go router flag with no meaning here: {self.refused.instead}"
        )


def add_refused(parser: argparse.ArgumentParser, table: Sequence[Refused]) -> None:
    """Each flag of `table` as an option that exits 2 with its message."""
    for entry in table:
        parser.add_argument(
            entry.flag,
            action=_RefuseAction,
            refused=entry,
            nargs=None if entry.takes_value else 0,
            help=argparse.SUPPRESS,
            dest=f"_refused_{entry.flag.strip('-').replace('-', '_')}",
        )


def refused_environment(env: Mapping[str, str], table: Sequence[Refused]) -> list[str]:
    """A message for each variable of `table` that is set (empty counts as unset)."""
    return [
        f"{entry.env} is a Go router variable with no meaning here: {entry.instead}"
        for entry in table
        if entry.env and env.get(entry.env)
    ]
