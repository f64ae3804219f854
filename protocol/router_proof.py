"""The router's proof of the shared secret, answering the agent's challenge.

An agent given only the router's address (`--router /ip4/…/tcp/9000`, as the Go
agent's `--router-grpc host:port`) learns the router's peer ID from the Noise handshake,
which proves only that the peer holds that key, not that it is the operator's router.
So the hello carries a random challenge and the welcome an HMAC of it under the shared
secret, bound to both peer IDs of this Noise session: a relay in the middle has another
peer ID than the router it relays to, so the router's proof fails at the agent, and the
agent's JWT (its subject is the agent's peer ID) fails at the router.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

CHALLENGE_BYTES = 16
# The router refuses a longer challenge: it is hostile input hashed before the hello
# is accepted, and an honest agent sends 32 hex digits.
MAX_CHALLENGE = 128
_LABEL = b"hivenet-router-proof/1"


def new_challenge() -> str:
    return secrets.token_hex(CHALLENGE_BYTES)


def router_proof(secret: bytes, router_peer_id: str, agent_peer_id: str, challenge: str) -> str:
    message = b"\n".join(
        (_LABEL, router_peer_id.encode(), agent_peer_id.encode(), challenge.encode())
    )
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def proof_valid(
    secret: bytes, router_peer_id: str, agent_peer_id: str, challenge: str, proof: object
) -> bool:
    if not isinstance(proof, str):
        return False
    expected = router_proof(secret, router_peer_id, agent_peer_id, challenge)
    return hmac.compare_digest(expected.encode(), proof.encode("utf-8", "replace"))
