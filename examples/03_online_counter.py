"""The online counter of a chat namespace stays exact under concurrent logins and logouts.

Seed article 003 (a Chinese post on distributed locks with redis-py): ``self.count += 1`` is a
read-modify-write, so two servers running it at once lose updates, and the article reaches for a
Redis lock plus a watchdog to renew it. Here every login and logout of one namespace runs on the
namespace's shard, one after another: no lock, no lease to renew, and the count is exact.

This script names the ops with ``keyserial.call("login")``: a client needs no import of the
worker's code (``workers/presence.py``), only the op names.

Run: ``keyserial dev --app workers.shop --app workers.presence --app workers.mail`` in one
terminal, then ``python -m examples.03_online_counter``.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid

import keyserial

URL = os.environ.get("KEYSERIAL_REDIS_URL", "redis://127.0.0.1:6390/0")
#: Seconds to wait for a worker: with no ``keyserial dev`` running, fail instead of hanging.
TIMEOUT = 10.0
SERVERS = 4
LOGINS = 400
#: Second wave, concurrent: more logouts than logins, yet the count never nears zero.
LOGOUTS, RELOGINS = 300, 100


async def wave(chat: str, op_names: list[str]) -> None:
    """Spread the ops over SERVERS client connections, all in flight at once."""
    await asyncio.gather(*(server(chat, op_names[n::SERVERS]) for n in range(SERVERS)))


async def server(chat: str, op_names: list[str]) -> None:
    async with keyserial.connect(URL, shards=16) as ks:
        await asyncio.gather(
            *(ks.submit(chat, keyserial.call(name), timeout=TIMEOUT) for name in op_names)
        )


async def main() -> None:
    chat = f"chat:{uuid.uuid4().hex[:12]}:online"
    async with keyserial.connect(URL, shards=16) as ks:
        await wave(chat, ["login"] * LOGINS)
        online = await ks.submit(chat, keyserial.call("online"), timeout=TIMEOUT)
        print(f"{chat}: {LOGINS} concurrent logins from {SERVERS} servers -> {online} online")
        assert online == LOGINS, online

        mixed = ["logout"] * LOGOUTS + ["login"] * RELOGINS
        random.shuffle(mixed)
        await wave(chat, mixed)
        online = await ks.submit(chat, keyserial.call("online"), timeout=TIMEOUT)
        expected = LOGINS - LOGOUTS + RELOGINS
        print(f"{LOGOUTS} logouts and {RELOGINS} logins, interleaved -> {online} online")
        assert online == expected, (online, expected)

        quiet = f"chat:{uuid.uuid4().hex[:12]}:online"
        await wave(quiet, ["login"] * 3)
        await wave(quiet, ["logout"] * 5)
        online = await ks.submit(quiet, keyserial.call("online"), timeout=TIMEOUT)
        print(f"{quiet}: 3 logins, then 5 logouts -> {online} online (never below zero)")
        assert online == 0, online
    print(f"OK: the counter is exact ({expected} online) and never goes below zero")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except (keyserial.BackendUnavailable, keyserial.SubmitTimeout) as exc:
        raise SystemExit(f"{exc}\nIs `keyserial dev` running? (see the Run: line above)") from None
