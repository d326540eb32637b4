"""A signer of the tests' own, listed in a namespace's signers hash as a worker lists itself:
what a worker (or whoever holds a worker's rights) can sign, and a client user cannot."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import redis

from keyserial._wire.layout import shard_name, signers_key
from keyserial._wire.messages import GrantRequest
from keyserial._wire.signing import ReplySigner

GRANT_OP = "keyserial.grant"


def listed_signer(admin: redis.Redis, namespace: str) -> ReplySigner:
    """A signer whose entry is in ``namespace``'s signers hash (written as admin)."""
    signer = ReplySigner()
    admin.hset(signers_key(namespace), signer.signer_id, signer.record())
    return signer


def grant_request(
    signer: ReplySigner | None,
    namespace: str,
    *,
    home: int,
    participant: int,
    op: str,
    attempt: int,
    channel: str,
    keys: Sequence[str],
    at: int | None = None,
    generation: int = 0,
) -> dict[str, Any]:
    """A grant request's envelope for ``keys`` on shard ``participant``, signed by ``signer``
    (unsigned if None), as a coordinator appends it."""
    request = GrantRequest(
        home,
        op,
        attempt,
        channel,
        shard_name(participant, generation),
        int(time.time() * 1000) if at is None else at,
    )
    if signer is not None:
        signature = signer.sign_request(request.signed_text(namespace, keys))
        request = replace(request, signer=signer.signer_id, signature=signature)
    return {
        "id": f"{op}#{attempt}",
        "keys": list(keys),
        "op": GRANT_OP,
        "kwargs": request.to_wire(),
    }


#: The request the rule tests sign and then change one thing of: home 1, participant 5.
SAMPLE_REQUEST: dict[str, Any] = {
    "home": 1,
    "participant": 5,
    "op": "order-9",
    "attempt": 3,
    "keys": ["sku:1", "sku:2"],
    "at": 1_800_000_000_000,
}


def sample_request(
    signer: ReplySigner | None, namespace: str, channel: str, **changes: Any
) -> dict[str, Any]:
    """:data:`SAMPLE_REQUEST` for ``channel``, with ``changes``, signed by ``signer``."""
    return grant_request(signer, namespace, **{**SAMPLE_REQUEST, "channel": channel, **changes})
