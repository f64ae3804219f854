"""B4's per-minute token buckets, one pair per key and model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """Holds at most one minute of its rate and refills continuously."""

    per_minute: int
    level: float
    stamp: float

    def refill(self, now: float, per_minute: int) -> float:
        # A key's limit may change under a running bucket (a reload, the key API).
        self.per_minute = per_minute
        self.level = min(float(per_minute), self.level + (now - self.stamp) * per_minute / 60.0)
        self.stamp = now
        return self.level

    def seconds_until(self, level: float) -> float:
        missing = level - self.level
        return missing * 60.0 / self.per_minute if missing > 0 and self.per_minute else 0.0


@dataclass(slots=True)
class KeyModelBuckets:
    input: TokenBucket | None = None
    output: TokenBucket | None = None

    def idle(self, now: float) -> bool:
        """Both buckets full (or off): dropping the record changes nothing, as a new
        one starts full."""
        return all(
            bucket is None or bucket.refill(now, bucket.per_minute) >= bucket.per_minute
            for bucket in (self.input, self.output)
        )
