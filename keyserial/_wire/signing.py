"""Replies a client can take without reading them back: signed by the worker that sent them.
(Workers sign their grant requests, grants and decision notices to each other the same way: a
worker's coordination channel names a key of its own, as a client's reply channel does. A client
can publish on that channel but cannot sign for it, so it cannot make a request a worker takes.)

Anyone who may publish on a service's reply channels can publish a reply, so an unsigned one is
only a hint to read the op's record (``_client.outcomes``). A signed one is as good as that record:
its tag is an HMAC-SHA256 under a key only the client and the signing worker can derive, by X25519
from the client's key pair (its public half is the last part of its reply channel's name) and
the worker's (its public half in the namespace's signers hash, which only workers may write). No
secret is ever stored in Redis, and a signature costs each side one HMAC (the key exchange runs
once per client and worker).

A signed message is the reply's JSON object with ``,"k":<signer id>,"t":<tag>`` before its
closing brace; the tag covers the channel's name and the text before that suffix, which is all
a client reads of it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

#: The suffix a signature adds to a reply message.
_SIGNED = re.compile(r',"k":"([0-9a-f]{16})","t":"([0-9a-f]{32})"}\Z')
_SIGNED_BYTES = re.compile(_SIGNED.pattern.encode())
#: A public key as a reply channel ends with it: 32 bytes, base64url without padding.
_PUBLIC_KEY = re.compile(r"[A-Za-z0-9_-]{43}\Z")
_CONTEXT = b"keyserial reply signature v1"
#: How long a signer's public key stays in the signers hash after its worker last renewed it.
SIGNER_TTL = 24 * 3600.0
#: How often a worker renews its entry (and drops those whose workers stopped renewing).
SIGNER_RENEW = 600.0
#: Derived keys kept per side: one per client a worker replies to, one per worker a client hears.
_CACHED_KEYS = 4096


def encode_public_key(key: X25519PublicKey) -> str:
    return _encode_raw(key.public_bytes_raw())


def _encode_raw(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_public_key(text: str) -> X25519PublicKey | None:
    """The key in ``text`` (43 base64url characters), or None if it holds none."""
    if not _PUBLIC_KEY.match(text):
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=")
    except (binascii.Error, ValueError):
        return None
    return X25519PublicKey.from_public_bytes(raw) if len(raw) == 32 else None


def _shared_key(
    own: X25519PrivateKey,
    peer: X25519PublicKey,
    client_public: str,
    signer_public: str,
    signer_id: str,
) -> bytes | None:
    """The HMAC key of one client and one signer (both sides derive the same); None for a
    peer key of low order, which would give every such peer the same (all-zero) secret."""
    try:
        secret = own.exchange(peer)
    except ValueError:
        return None
    parts = (_CONTEXT, secret, client_public.encode(), signer_public.encode(), signer_id.encode())
    return hashlib.sha256(b"\n".join(parts)).digest()


def _tag(key: bytes, channel: str, signed: str) -> str:
    text = f"{channel}\n{signed}".encode("utf-8", "surrogatepass")
    return hmac.digest(key, text, "sha256")[:16].hex()


def signer_record(public_key: str, at: float) -> str:
    """A signer's entry in the signers hash: its public key, and when it was last renewed."""
    return json.dumps({"key": public_key, "at": round(at)})


def parse_signer_record(raw: bytes | str | None) -> X25519PublicKey | None:
    """A signer's public key, or None for an entry that holds none."""
    try:
        record = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    key = record.get("key") if isinstance(record, dict) else None
    return decode_public_key(key) if isinstance(key, str) else None


def signer_renewed_at(raw: bytes | str) -> float:
    """When a signer's entry was last renewed (0 for one that does not say)."""
    try:
        at = json.loads(raw).get("at")
    except (ValueError, AttributeError):
        return 0.0
    return float(at) if isinstance(at, int | float) else 0.0


def without_signature(raw: bytes) -> bytes:
    """A signed message as it was before it was signed (a message with no signature as it is):
    what a receiver that cannot check the signature reads of it."""
    found = _SIGNED_BYTES.search(raw)
    return raw if found is None else raw[: found.start()] + b"}"


class ReplySigner:
    """A worker's signing key: drawn when the worker starts, never written anywhere but its
    public half (in the signers hash, see :meth:`record`)."""

    def __init__(self) -> None:
        self._key = X25519PrivateKey.generate()
        self.public_key = encode_public_key(self._key.public_key())
        self.signer_id = os.urandom(8).hex()
        self._keys: OrderedDict[str, bytes | None] = OrderedDict()

    def record(self) -> str:
        return signer_record(self.public_key, time.time())

    def sign(self, channel: str, message: str) -> str:
        """``message`` (a reply's JSON object) signed for ``channel``'s client; as it is for
        a channel that names no client key."""
        key = self._key_for(channel)
        if key is None:
            return message
        tag = _tag(key, channel, message[:-1])
        return f'{message[:-1]},"k":"{self.signer_id}","t":"{tag}"}}'

    def _key_for(self, channel: str) -> bytes | None:
        # By the client's key, not the channel: a client has a channel per shard on a cluster.
        client_public = channel.rsplit(".", 1)[-1]
        if client_public in self._keys:
            self._keys.move_to_end(client_public)
            return self._keys[client_public]
        client = decode_public_key(client_public)
        key = (
            None
            if client is None
            else _shared_key(self._key, client, client_public, self.public_key, self.signer_id)
        )
        self._keys[client_public] = key
        if len(self._keys) > _CACHED_KEYS:
            self._keys.popitem(last=False)
        return key


class ReplyVerifier:
    """A receiver's key pair, the channel that names it, and the signers it has met: a client's
    for its replies, or a worker's for the coordination messages other workers send it."""

    def __init__(self, channel_prefix: str) -> None:
        self._key = X25519PrivateKey.generate()
        self.public_key = encode_public_key(self._key.public_key())
        #: The client's reply channel: ``<prefix>.<public key>``.
        self.channel = f"{channel_prefix}.{self.public_key}"
        self._keys: OrderedDict[str, bytes] = OrderedDict()

    def knows(self, signer_id: str) -> bool:
        return signer_id in self._keys

    def learn(self, signer_id: str, record: bytes | str | None) -> bool:
        """Take a signer's public key from its entry in the signers hash (read from Redis, which
        only workers write); False if the entry holds none."""
        signer = parse_signer_record(record)
        key = (
            None
            if signer is None
            else _shared_key(
                self._key, signer, self.public_key, encode_public_key(signer), signer_id
            )
        )
        if key is None:
            return False
        self._keys[signer_id] = key
        if len(self._keys) > _CACHED_KEYS:
            self._keys.popitem(last=False)
        return True

    def verified(
        self, raw: bytes, unknown: Callable[[str], None], channel: str | None = None
    ) -> str | None:
        """The signed part of a reply message (a JSON object), if a signer this client knows
        signed it for the channel it came on (``channel``, one of this receiver's: by default
        :attr:`channel`); else None, and ``unknown`` is told the id of a signer not met yet
        (its key may be looked up for the next messages)."""
        try:
            text = raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
        found = _SIGNED.search(text)
        if found is None:
            return None
        signer_id, tag = found.groups()
        key = self._keys.get(signer_id)
        if key is None:
            unknown(signer_id)
            return None
        signed = text[: found.start()]
        if not hmac.compare_digest(_tag(key, channel or self.channel, signed), tag):
            return None
        return signed + "}"
