"""HS256 agent tokens: the subject is the agent's libp2p peer ID.

During a rotation a router accepts two secrets (`verify_with`): agents move to the new
one one at a time, each reconnecting on its own, and no agent is ever refused for
being early or late; the Go router needs every router and agent restarted together.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jwt

ALGORITHM = "HS256"
MIN_SECRET_BYTES = 32


class TokenError(Exception):
    """The token cannot admit this peer; the message says why."""


def check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"JWT secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required"
        )


def issue_token(secret: bytes, peer_id: str, ttl_seconds: float, now: float | None = None) -> str:
    check_secret(secret)
    issued = int(now if now is not None else time.time())
    claims = {"sub": peer_id, "iat": issued, "nbf": issued, "exp": issued + int(ttl_seconds)}
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def verify_token(secret: bytes, token: str, peer_id: str) -> dict:
    """Claims of a valid token for `peer_id`; TokenError with the reason otherwise."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise TokenError(f"malformed token: {exc}") from None
    if header.get("alg") != ALGORITHM:
        raise TokenError(f"token algorithm {header.get('alg')!r} refused; only HS256")
    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=[ALGORITHM],
            options={"require": ["sub", "exp"]},
            leeway=5,
        )
    except jwt.ExpiredSignatureError:
        raise TokenError("token expired") from None
    except jwt.ImmatureSignatureError:
        raise TokenError("token not yet valid") from None
    except jwt.InvalidSignatureError:
        raise TokenError("bad token signature (check the shared JWT secret)") from None
    except jwt.PyJWTError as exc:
        raise TokenError(f"invalid token: {exc}") from None
    if claims["sub"] != peer_id:
        raise TokenError(f"token subject {claims['sub']} is not the connecting peer {peer_id}")
    return claims


def verify_with(secrets: Sequence[bytes], token: str, peer_id: str) -> bytes:
    """The secret, of `secrets` (current first), that signed a valid token for `peer_id`;
    TokenError with the current secret's reason when none did. Only a bad signature
    moves on to the next secret: an expired or malformed token is refused as it is."""
    first: TokenError | None = None
    for secret in secrets:
        if not secret:
            continue
        try:
            verify_token(secret, token, peer_id)
        except TokenError as exc:
            if not str(exc).startswith("bad token signature"):
                raise
            first = first or exc
            continue
        return secret
    raise first or TokenError("no JWT secret configured")
