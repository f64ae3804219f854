"""The shared JWT secret: from a file (which wins) or from the environment."""

from __future__ import annotations

import os

from protocol.files import read_regular
from protocol.tokens import check_secret

SECRET_ENV = "HIVENET_ROUTER_JWT_SECRET"
# The secret being rotated out: a router accepts agents' tokens signed by either.
PREVIOUS_ENV = "HIVENET_ROUTER_JWT_SECRET_PREVIOUS"
# A secret file is a line of text; a larger file is some other file.
MAX_SECRET_FILE_BYTES = 64 * 1024


def load_secret(path: str | None, environ: dict[str, str] | None = None) -> bytes:
    env = os.environ if environ is None else environ
    if path:
        secret = read_regular(path, MAX_SECRET_FILE_BYTES).strip()
    elif env.get(SECRET_ENV):
        secret = env[SECRET_ENV].strip().encode()
    else:
        raise ValueError(f"a JWT secret is required: --jwt-secret-file or {SECRET_ENV}")
    check_secret(secret)
    return secret


def load_previous_secret(
    path: str | None, environ: dict[str, str] | None = None, missing_ok: bool = False
) -> bytes:
    """The previous secret (file first, then PREVIOUS_ENV); empty when there is none.
    An empty file is none: emptying it (then SIGHUP) ends a rotation; so is a missing
    one when `missing_ok` (a reload after the file was removed)."""
    env = os.environ if environ is None else environ
    if path:
        try:
            secret = read_regular(path, MAX_SECRET_FILE_BYTES).strip()
        except FileNotFoundError:
            if missing_ok:
                return b""
            raise
        if not secret:
            return b""
    elif env.get(PREVIOUS_ENV):
        secret = env[PREVIOUS_ENV].strip().encode()
    else:
        return b""
    check_secret(secret)
    return secret
