"""Upstream's cross-config check between the keys and the policies: a serverless key's
nonzero `input_tokens_per_minute` must be at least the `max_input_tokens` of every
serverless model it can reach, or a request at that cap could never pass its bucket.

A key is checked with the limits that apply to the model (its `per_model` entry, else
its own) and the mode that applies (its own, else the policy's). Run at start-up and on
every change of either side: a reload, `PUT /admin/policy`, a per-model policy write,
`PUT /admin/auth`, the key registry's writes; a change that breaks it is refused.
"""

from __future__ import annotations

from router.tenants.config import ApiKey, AuthConfig, KeyLimits, Tenant

# A policy's (model, or None for the global policy; mode; max_input_tokens).
PolicyLimits = tuple[str | None, str, int]


def _reaches_global(tenant: Tenant, key: ApiKey, named: set[str]) -> bool:
    """Whether the key may reach a model under the global policy with its own limits:
    any model when its tenant lists none, else one listed (by name or glob) that no
    named policy takes and no `per_model` entry of the key covers."""
    if not (tenant.models or tenant.per_model):
        return True
    own = {name for name, _ in key.per_model}
    listed = (*tenant.models, *(name for name, _, _ in tenant.per_model))
    return any(m not in named and m not in own for m in listed)


def below_serverless_cap(config: AuthConfig | None, policies: list[PolicyLimits]) -> list[str]:
    """Every key of `config` below a serverless cap it can reach, one message each."""
    if config is None:
        return []
    named = {model for model, _, _ in policies if model is not None}
    errors: list[str] = []

    def check(key: ApiKey, path: str, limits: KeyLimits, mode: str, cap: int, what: str) -> None:
        rate = limits.input_tokens_per_minute
        if rate and cap and rate < cap and limits.serverless(mode):
            errors.append(
                f"{key.id}.quota.{path}input_tokens_per_minute: {rate} is below"
                f" max_input_tokens {cap} of serverless {what} (a request at that cap"
                " could never pass)"
            )

    for digest, key in sorted(config.keys.items(), key=lambda kv: kv[1].id):
        tenant = config.by_hash[digest]
        own = dict(key.per_model)
        for model, mode, cap in policies:
            if model is not None:
                if tenant.allows_model(model):
                    path = f"per_model.{model}." if model in own else ""
                    check(key, path, key.limits_for(model), mode, cap, f"model {model!r}")
                continue
            # The global policy: the key's own limits where no per_model entry applies,
            # and each per_model entry of a model no named policy takes.
            if _reaches_global(tenant, key, named):
                check(key, "", key.limits, mode, cap, "global policy")
            for name, limits in key.per_model:
                if name not in named and tenant.allows_model(name):
                    check(key, f"per_model.{name}.", limits, mode, cap, f"model {name!r}")
    return errors
