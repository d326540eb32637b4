"""Replies a client can take without reading them back: signed by the worker that sent them.
(Workers sign their grants and decision notices to each other the same way: a worker's
coordination channel names a key of its own, as a client's reply channel does.)

What a worker appends on its own authority (a grant request) is read by whichever worker owns
the shard then, not by one receiver, so it is signed with Ed25519 instead: the worker's signing
key's public half is in its signers-hash entry too (``"sign"``), and any worker checks the
signature against it (:class:`RequestVerifier`). A client can append to a stream but cannot
write that hash, so it cannot make a request that a worker takes. Checking that signature costs
about 100 µs, so a request also carries a tag for the owner its coordinator expects (the one
whose grant it last took from that shard): an HMAC under their pairwise key, which that owner
checks in about a microsecond; any other owner (after a takeover) checks the signature.

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

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

#: The suffix a signature adds to a reply message.
_SIGNED = re.compile(r',"k":"([0-9a-f]{16})","t":"([0-9a-f]{32})"}\Z')
_SIGNED_BYTES = re.compile(_SIGNED.pattern.encode())
#: A public key as a reply channel ends with it: 32 bytes, base64url without padding.
_PUBLIC_KEY = re.compile(r"[A-Za-z0-9_-]{43}\Z")
_CONTEXT = b"keyserial reply signature v1"
_REQUEST_CONTEXT = b"keyserial request signature v1\n"
#: What a request tag's input starts with: a message tag's starts with its channel (``ks:``).
_REQUEST_TAG_CONTEXT = "keyserial request tag v1"
#: A request tag: the first 16 bytes of its HMAC, in hex.
_REQUEST_TAG = re.compile(r"[0-9a-f]{32}\Z")
#: An Ed25519 signature: 64 bytes, base64url without padding.
_SIGNATURE = re.compile(r"[A-Za-z0-9_-]{86}\Z")
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


def _request_tag(key: bytes, receiver_public: str, text: str) -> str:
    """The tag of a request's signed ``text`` for the worker whose channel key is
    ``receiver_public``, under that worker's and the signer's pairwise ``key``."""
    return _tag(key, f"{_REQUEST_TAG_CONTEXT}\n{receiver_public}", text)


def signer_record(public_key: str, at: float, signing_key: str | None = None) -> str:
    """A signer's entry in the signers hash: its public key, the public half of its request
    signing key (if it has one), and when it was last renewed."""
    record: dict[str, str | int] = {"key": public_key, "at": round(at)}
    if signing_key is not None:
        record["sign"] = signing_key
    return json.dumps(record)


def parse_signer_record(raw: bytes | str | None) -> X25519PublicKey | None:
    """A signer's public key, or None for an entry that holds none."""
    try:
        record = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    key = record.get("key") if isinstance(record, dict) else None
    return decode_public_key(key) if isinstance(key, str) else None


def parse_signing_key(raw: bytes | str | None) -> Ed25519PublicKey | None:
    """A signer's request-checking key (its entry's ``"sign"``), or None for an entry that
    holds none (a forged signer id, or a worker of a version that signs no request)."""
    try:
        record = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    key = record.get("sign") if isinstance(record, dict) else None
    if not isinstance(key, str) or not _PUBLIC_KEY.match(key):
        return None
    try:
        return Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(key + "="))
    except (binascii.Error, ValueError):
        return None


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
        self._signing_key = Ed25519PrivateKey.generate()
        self.signing_key = _encode_raw(self._signing_key.public_key().public_bytes_raw())
        self.signer_id = os.urandom(8).hex()
        self._keys: OrderedDict[str, bytes | None] = OrderedDict()

    def record(self) -> str:
        return signer_record(self.public_key, time.time(), self.signing_key)

    def sign_request(self, text: str) -> str:
        """The signature of a request's canonical ``text`` (base64url, no padding), which any
        worker checks against this signer's listed signing key."""
        signature = self._signing_key.sign(_REQUEST_CONTEXT + text.encode("utf-8", "surrogatepass"))
        return _encode_raw(signature)

    def tag_request(self, channel: str, text: str) -> str:
        """The tag of a request's canonical ``text`` for the worker whose (coordination)
        channel is ``channel``, which checks it instead of the signature (see
        :meth:`RequestVerifier.verified`); '' for a channel that names no key."""
        key = self._key_for(channel)
        return "" if key is None else _request_tag(key, channel.rsplit(".", 1)[-1], text)

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

    def tagged(self, signer_id: str, text: str, tag: str) -> bool:
        """Whether a signer this receiver knows tagged a request's ``text`` for it (see
        :meth:`ReplySigner.tag_request`)."""
        key = self._keys.get(signer_id)
        if key is None or not _REQUEST_TAG.match(tag):  # (no tag; or not ASCII: not comparable)
            return False
        return hmac.compare_digest(_request_tag(key, self.public_key, text), tag)


class RequestVerifier:
    """The request-checking keys of the signers a worker has met (read from the signers hash,
    which only workers write): a request is taken only if one of them signed it. With a
    ``receiver`` (the worker's coordination key, :class:`ReplyVerifier`), a request that a
    listed signer tagged for that receiver is taken on its tag, without checking the
    signature; without one (the mover, which owns no shard), every signature is checked."""

    def __init__(self, receiver: ReplyVerifier | None = None) -> None:
        self._keys: OrderedDict[str, Ed25519PublicKey | None] = OrderedDict()
        self._receiver = receiver
        #: Requests taken on their tag, and signatures checked (the fast path, seen working).
        self.taken_on_tag = 0
        self.signatures_checked = 0

    def knows(self, signer_id: str) -> bool:
        """Whether the signer's entry was read (listed or not): no read is due for it."""
        return signer_id in self._keys

    def learn(self, signer_id: str, record: bytes | str | None) -> bool:
        """Take a signer's checking key from its entry; False (and remembered as unlisted, so
        a forged id costs one read) if the entry holds none."""
        key = parse_signing_key(record)
        if self._receiver is not None:  # (its tag is taken only if it is listed, as here)
            self._receiver.learn(signer_id, record)
        self._keys[signer_id] = key
        self._keys.move_to_end(signer_id)
        if len(self._keys) > _CACHED_KEYS:
            self._keys.popitem(last=False)
        return key is not None

    def forget_unlisted(self) -> None:
        """Read again, next time, the signers that were not listed (a worker lists itself when
        it starts: its first request may be read before its entry)."""
        for signer_id in [s for s, key in self._keys.items() if key is None]:
            del self._keys[signer_id]

    def verified(self, signer_id: str, text: str, signature: str, tag: str = "") -> bool:
        """Whether the listed signer ``signer_id`` signed ``text``: by its ``tag`` for this
        worker, if that checks out (only the signer and this worker hold the tag's key, so it
        proves what the signature does); else by the signature, as any worker checks it (a tag
        for another owner, or a wrong one, costs one HMAC more, never a refusal)."""
        key = self._keys.get(signer_id)
        if key is None:
            return False
        if self._receiver is not None and self._receiver.tagged(signer_id, text, tag):
            self.taken_on_tag += 1
            return True
        if not _SIGNATURE.match(signature):
            return False
        self.signatures_checked += 1
        try:
            key.verify(
                base64.urlsafe_b64decode(signature + "=="),
                _REQUEST_CONTEXT + text.encode("utf-8", "surrogatepass"),
            )
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True
