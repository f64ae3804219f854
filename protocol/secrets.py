"""The shared JWT secret: from a file (which wins) or from the environment."""

from __future__ import annotations

import os
from pathlib import Path

from protocol.tokens import check_secret

SECRET_ENV = "HIVENET_ROUTER_JWT_SECRET"


def load_secret(path: str | None, environ: dict[str, str] | None = None) -> bytes:
    env = os.environ if environ is None else environ
    if path:
        secret = Path(path).read_bytes().strip()
    elif env.get(SECRET_ENV):
        secret = env[SECRET_ENV].strip().encode()
    else:
        raise ValueError(f"a JWT secret is required: --jwt-secret-file or {SECRET_ENV}")
    check_secret(secret)
    return secret
