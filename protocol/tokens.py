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


# Why a token was refused, in a few fixed words: the label of the router's refusal
# count. The message says more, some of it the token's own text, which would make each
# refusal a series of its own, for peers that have proved nothing.
BAD_SIGNATURE = "bad token signature"
EXPIRED = "token expired"
NOT_YET_VALID = "token not yet valid"
WRONG_ALGORITHM = "token algorithm"
MALFORMED = "malformed token"
INVALID = "invalid token"
SUBJECT = "token subject"
NO_SECRET = "no JWT secret"


class TokenError(Exception):
    """The token cannot admit this peer; the message says why, `kind` in a fixed word."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


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
        raise TokenError(f"malformed token: {exc}", MALFORMED) from None
    if header.get("alg") != ALGORITHM:
        # The header is the peer's own text, of any length: its first characters say enough.
        alg = repr(header.get("alg"))[:40]
        raise TokenError(f"token algorithm {alg} refused; only HS256", WRONG_ALGORITHM)
    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=[ALGORITHM],
            options={"require": ["sub", "exp"]},
            leeway=5,
        )
    except jwt.ExpiredSignatureError:
        raise TokenError("token expired", EXPIRED) from None
    except jwt.ImmatureSignatureError:
        raise TokenError("token not yet valid", NOT_YET_VALID) from None
    except jwt.InvalidSignatureError:
        raise TokenError(
            "bad token signature (check the shared JWT secret)", BAD_SIGNATURE
        ) from None
    except jwt.PyJWTError as exc:
        raise TokenError(f"invalid token: {exc}", INVALID) from None
    if claims["sub"] != peer_id:
        raise TokenError(
            f"token subject {claims['sub']} is not the connecting peer {peer_id}", SUBJECT
        )
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
            if exc.kind != BAD_SIGNATURE:
                raise
            first = first or exc
            continue
        return secret
    raise first or TokenError("no JWT secret configured", NO_SECRET)
