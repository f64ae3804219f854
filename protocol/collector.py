"""The garbage collector's young-generation threshold for the daemons' processes.

A trio daemon keeps each task suspended in a chain of coroutines that is built anew
with every frame or request it waits for, so between two collections the youngest
generation fills with live objects: about 50,000 in a router with 1,000 idle agents.
CPython's default collects that generation every 700 net allocations and walks all of
them each time (10-20 ms a collection there). Measured with `gc.callbacks` and the
benchmarks, at the default: about 9% of an idle fleet's router CPU, and 0.29 against
0.25 ms of router CPU per whole answer at 64 clients (`bench.stream_relay --whole`);
the agent's CPU per stream about 5% lower with the raised threshold. Every 20,000 net
allocations walks the same live objects about thirty times less often; the cyclic
garbage that waits for it meanwhile is a few MB at most.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """Raise the young generation's threshold; the older two keep their defaults."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
