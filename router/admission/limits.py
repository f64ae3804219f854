"""A policy's admission fields (upstream's names, at the top level of a global or
per-model policy) and the router-wide admission settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.documents import Validator, kind

POLICY_FIELDS: tuple[str, ...] = (
    "mode",
    "max_input_tokens",
    "images_max",
    "admit_budget_tokens",
    "max_inflight",
)
MODES: tuple[str, ...] = ("reserved", "serverless")
DEFAULT_ADMIT_FRACTION = 0.90
# Upstream's 250 ms: long enough for a short answer to end and make room, short
# enough that a client at the limit hears 429 before its own timeout matters.
DEFAULT_PARK_TIMEOUT = 0.25


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """0 disables a check, as upstream. The budget and backstop are per healthy replica."""

    mode: str = "reserved"
    max_input_tokens: int = 0
    images_max: int = 0
    admit_budget_tokens: int = 0
    max_inflight: int = 0

    @property
    def active(self) -> bool:
        """Whether any check reads the input estimate for this model."""
        return self is not NO_ADMISSION_LIMITS and self != NO_ADMISSION_LIMITS

    @property
    def pooled(self) -> bool:
        """Whether B2 counts this model's occupancy at all."""
        return bool(self.admit_budget_tokens or self.max_inflight)


NO_ADMISSION_LIMITS = AdmissionLimits()


@dataclass(frozen=True)
class AdmitSettings:
    # HIVENET_ROUTER_ADMIT_FRACTION: the share of admit_budget_tokens B2 fills, (0, 1].
    fraction: float = DEFAULT_ADMIT_FRACTION
    # HIVENET_ROUTER_ADMIT_PARK_TIMEOUT: how long a request that does not fit waits.
    park_timeout: float = DEFAULT_PARK_TIMEOUT


def parse_fraction(raw: str) -> float:
    value = float(raw)
    if not 0.0 < value <= 1.0:
        raise ValueError("must be greater than 0 and at most 1")
    return value


def check_policy_limits(validator: Validator, document: dict[Any, Any]) -> AdmissionLimits:
    """The admission fields of a policy document; errors on `validator`, with paths."""
    mode = document.get("mode")
    if mode is None:
        mode = "reserved"
    elif mode not in MODES:
        validator.error("mode", f"must be one of {', '.join(MODES)}, got {kind(mode)}")
        mode = "reserved"
    ints = {name: validator.integer(name, document.get(name), 0) for name in POLICY_FIELDS[1:]}
    limits = AdmissionLimits(mode=mode, **ints)
    return NO_ADMISSION_LIMITS if limits == NO_ADMISSION_LIMITS else limits  # see `active`
