"""Which grant requests a participant shard takes: only those a listed worker signed, for this
very shard, taken in soon after they were signed. (Signed: tagged for this worker by the signer,
or, failing that, with a signature that any worker checks; see ``_wire.signing``.)

A grant request holds keys until its attempt is decided, and only the attempt's coordinator
can decide it. A request that no coordinator sent (a client user's ``XADD``) would hold its
keys until the home shard changed owner; a copy of a genuine one, appended after its decision
record expired, the same. So the rule is checked when the entry is taken in, before its op
holds anything, and a refused request is dead-lettered: it holds no key, and costs no restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from .codec import GRANT_OP, Envelope, decode_entry_leniently
from .messages import GrantRequest, MalformedMessage
from .signing import RequestVerifier

#: How a grant request's op name appears in an entry's ``ops`` (a cheap test before decoding).
_GRANT_BYTES = f'"{GRANT_OP}"'.encode()


class RequestCheck:
    """The rule for one shard of one layout generation (see the module doc)."""

    def __init__(
        self,
        verifier: RequestVerifier,
        *,
        namespace: str,
        shard: int,
        shard_name: str,
        max_age_ms: int,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self._verifier = verifier
        self._namespace = namespace
        self._shard = shard
        self._shard_name = shard_name
        #: How far apart the signing (the coordinator's clock) and the intake (this worker's)
        #: may be: a decision record is kept this long (``result_ttl``). (Not the entry id's
        #: time: a client user may XADD under a far-future id, and every later id follows it.)
        self._max_age_ms = max_age_ms
        self._clock_ms = clock_ms

    def signers_to_read(self, entries: Iterable[Mapping[bytes, bytes]]) -> list[str]:
        """The signers of the grant requests in ``entries`` (their fields) whose listing is not
        known yet."""
        wanted: dict[str, None] = {}
        for fields in entries:
            if _GRANT_BYTES not in fields.get(b"ops", b""):
                continue
            for envelope in decode_entry_leniently(fields):
                signer = envelope.kwargs.get("k") if envelope.name == GRANT_OP else None
                if isinstance(signer, str) and signer and not self._verifier.knows(signer):
                    wanted[signer] = None
        return list(wanted)

    def learn(self, signers: list[str], records: list[bytes | None]) -> None:
        for signer, record in zip(signers, records, strict=True):
            self._verifier.learn(signer, record)

    def refusal(self, envelope: Envelope) -> str | None:
        """Why the grant request ``envelope`` is not taken; None if it is."""
        try:
            request = GrantRequest.from_wire(envelope.kwargs, below=self._shard)
        except MalformedMessage as exc:
            return str(exc)
        if not request.signature:
            return "an unsigned grant request (only a worker may ask for a grant)"
        if request.target != self._shard_name:
            return f"a grant request for shard {request.target!r}, not {self._shard_name!r}"
        if abs(self._clock_ms() - request.at) > self._max_age_ms:
            return "a grant request taken in too long after it was signed (a copy)"
        text = request.signed_text(self._namespace, envelope.keys)
        if not self._verifier.verified(request.signer, text, request.signature, request.tag):
            return "a grant request that no listed worker signed"
        return None
