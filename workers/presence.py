"""The online counter of a chat namespace: exact, however many servers log users in and out.

The key names the namespace (``"chat:lobby:online"``); its state is the number of users online,
an integer (no state: 0). ``count += 1`` is a read-modify-write that loses updates when two
servers run it at once; here every op on the key runs on its shard, one after another::

    await ks.submit("chat:lobby:online", login())    # -> 1
    await ks.submit("chat:lobby:online", logout())   # -> 0
    await ks.submit("chat:lobby:online", logout())   # -> 0: never below zero

Serve with ``keyserial worker --app workers.presence``.
"""

from __future__ import annotations

import keyserial


def _online(ctx: keyserial.Context) -> int:
    value = ctx.state
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"key {ctx.key!r} holds {value!r}, not an online count")
    return value


@keyserial.op
def login(ctx: keyserial.Context) -> int:
    """One more user online; return the new count."""
    ctx.state = _online(ctx) + 1
    return int(ctx.state)


@keyserial.op
def logout(ctx: keyserial.Context) -> int:
    """One user fewer online, but never below zero (a duplicate logout is harmless)."""
    ctx.state = max(0, _online(ctx) - 1)
    return int(ctx.state)


@keyserial.op
def online(ctx: keyserial.Context) -> int:
    """The users online, ordered after every login and logout submitted before it."""
    return _online(ctx)
