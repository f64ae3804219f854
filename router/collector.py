"""The garbage collector's young-generation threshold for the router process.

Every agent session keeps its readers suspended in chains of coroutines that are built
anew with each frame, so between two collections the youngest generation fills with
live objects: about 50,000 with 1,000 idle agents. CPython's default collects it every
700 net allocations and walks all of them each time (10-20 ms a collection there),
about a tenth of an idle fleet's router CPU (gen0 and gen1 together, `gc.callbacks`).
Collecting every 20,000 net allocations walks the same live objects about thirty times
less often; the cyclic garbage that waits for it meanwhile is a few MB at most.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """Raise the young generation's threshold; the older two keep their defaults."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
