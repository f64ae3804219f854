"""B2: token-weighted occupancy of a model's pool, and each admitted request's share.

A request occupies its input estimate plus the output it declared; without a declared
limit its share grows with the output it streams. The pool's budget is
`fraction * admit_budget_tokens * healthy replicas` and its backstop
`max_inflight * healthy replicas`, both recomputed per request (replicas floored at 1,
so the gate holds while no replica is healthy and routing says why). A request that
does not fit parks until one that holds occupancy leaves, at most the park timeout;
one larger than the whole budget is refused at once (no release makes room for it).

Everything here is synchronous and this router's own; a `Reservation` is released
exactly once whatever ends the request, and `release` never awaits, so a cancelled
request (client gone, deadline) releases in its `finally` all the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trio.lowlevel import ParkingLot


@dataclass
class Pool:
    """One model's occupancy on this router."""

    model: str
    occupancy: int = 0
    inflight: int = 0
    # Key id → the tokens its requests occupy here (B4's max_occupancy_share).
    by_key: dict[str, int] = field(default_factory=dict)
    lot: ParkingLot = field(default_factory=ParkingLot)
    # The effective limits the last admission computed (the gauges show them).
    budget: int = 0
    backstop: int = 0
    # The fleet's (occupancy, in flight) as Redis last said, while the counts are shared.
    fleet: tuple[int, int] | None = None
    # Requests admitted here, ever; the idle sweep compares it between its passes
    # rather than the hot path reading a clock.
    served: int = 0
    seen: int = 0
    quiet_since: float = 0.0

    def shown_occupancy(self) -> float:
        return float(self.fleet[0] if self.fleet is not None else self.occupancy)

    def shown_inflight(self) -> float:
        return float(self.fleet[1] if self.fleet is not None else self.inflight)

    def fits(self, tokens: int) -> bool:
        """Whether `tokens` more fit. No exception for an empty pool (upstream): the
        floored budget of a pool without healthy replicas stays a limit."""
        if self.backstop and self.inflight >= self.backstop:
            return False
        return not self.budget or self.occupancy + tokens <= self.budget

    def __repr__(self) -> str:
        return (
            f"<Pool {self.model} occupancy={self.occupancy}/{self.budget}"
            f" inflight={self.inflight}/{self.backstop} parked={len(self.lot)}>"
        )


class Reservation:
    """What one admitted request occupies; `release` gives it back, exactly once."""

    __slots__ = ("grows", "input", "key_id", "output", "pool", "released")

    def __init__(
        self, pool: Pool, key_id: str | None, input_tokens: int, output: int, grows: bool
    ) -> None:
        self.pool = pool
        self.key_id = key_id
        self.input = input_tokens
        self.output = output
        self.grows = grows
        self.released = False
        pool.inflight += 1
        pool.served += 1
        self._add(input_tokens + output)

    @property
    def tokens(self) -> int:
        return self.input + self.output

    def _add(self, n: int) -> None:
        pool = self.pool
        pool.occupancy += n
        if self.key_id is not None:
            pool.by_key[self.key_id] = pool.by_key.get(self.key_id, 0) + n

    def grow(self, n: int) -> None:
        """Output streamed by a request that declared no limit."""
        if n and self.grows and not self.released:
            self.output += n
            self._add(n)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        pool = self.pool
        pool.inflight -= 1
        self._add(-self.tokens)
        if self.key_id is not None and not pool.by_key.get(self.key_id):
            pool.by_key.pop(self.key_id, None)
        if pool.lot:
            # Every parked request re-checks, in the order it parked.
            pool.lot.unpark_all()
