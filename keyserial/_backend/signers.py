"""Learning the signers of signed messages: a client's replies, a worker's grants and notices.

A message signed by a signer the receiver has not met yet is only a hint (see
``_wire.signing``); its signer's key is read from the signers hash for the next messages. Any
publisher can name a signer, so the reads are bounded: one read at a time, for every signer met
meanwhile, at most :data:`SIGNERS_DUE` of them, and after a read that failed or found one not
listed (a forged id, or a worker not listed yet), the next only after :data:`SIGNER_RETRY`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import anyio

from .._scripts.refusals import Refused
from .._wire.signing import ReplyVerifier
from ..errors import BackendUnavailable
from .outage import Outage

#: Reads the signers hash's entries of some signer ids (None where there is none).
ReadSigners = Callable[[Sequence[str]], Awaitable[list[bytes | None]]]
#: Signers met and not read yet that a receiver keeps at most (more are met again later).
SIGNERS_DUE = 64
#: Seconds before the next read, after one that failed or found a signer not listed.
SIGNER_RETRY = 1.0


class SignersMet:
    """The signers a receiver met and does not know yet; :meth:`learn` reads their keys into
    its ``verifier``. ``what`` names them in log lines, ``meanwhile`` says what their messages
    cost until then."""

    def __init__(
        self,
        verifier: ReplyVerifier,
        log: logging.Logger,
        *,
        what: str,
        meanwhile: str,
        learned: Callable[[list[str], list[str]], None] | None = None,
    ) -> None:
        self._verifier = verifier
        #: Told, after each read, the signers whose keys it found (and took) and the others.
        self._learned = learned
        self._log = log
        self._what = what
        self._meanwhile = meanwhile
        self._due: dict[str, None] = {}
        #: Set when signers are due; made in the loop :meth:`learn` runs on. (An asyncio event:
        #: messages arrive in a callback of that loop, outside any task, where anyio cannot
        #: tell which library runs it.)
        self._wanted: asyncio.Event | None = None

    def met(self, signer_id: str) -> None:
        """A message came signed by ``signer_id``, not met yet: read its key (the ``unknown``
        callback of ``ReplyVerifier.verified``)."""
        if len(self._due) < SIGNERS_DUE:
            self._due[signer_id] = None
            if self._wanted is not None:
                self._wanted.set()

    async def learn(self, read: ReadSigners, outage: Outage | None = None) -> NoReturn:
        """Read the keys of the signers met, until cancelled. A failed read is tried again (its
        warning logged once per ``outage``, if given, when the server does not answer)."""
        wanted = self._wanted = asyncio.Event()
        while True:
            while not self._due:
                wanted.clear()
                await wanted.wait()
            asked = list(self._due)
            try:
                records = await read(asked)
            except (BackendUnavailable, Refused, ValueError) as exc:
                message = "reading %s: %s (%s; retrying)"
                if outage is not None and isinstance(exc, BackendUnavailable):
                    outage.warn(self._log, message, self._what, exc, self._meanwhile)
                else:
                    self._log.warning(message, self._what, exc, self._meanwhile)
                await anyio.sleep(SIGNER_RETRY)
                continue
            for signer_id in asked:
                self._due.pop(signer_id, None)
            found = [
                self._verifier.learn(signer_id, record)
                for signer_id, record in zip(asked, records, strict=True)
            ]
            unknown = [signer_id for signer_id, ok in zip(asked, found, strict=True) if not ok]
            if self._learned is not None:
                known = [signer_id for signer_id, ok in zip(asked, found, strict=True) if ok]
                self._learned(known, unknown)
            if unknown:
                self._log.info(
                    "%s %s are not listed (yet): %s", self._what, _few(unknown), self._meanwhile
                )
                await anyio.sleep(SIGNER_RETRY)


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(map(json.dumps, names[:3]))
    return shown if len(names) <= 3 else f"{shown} and {len(names) - 3} more"
