"""Ops that the tests' workers serve (``--app tests.apps``)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import anyio
import anyio.lowlevel
import redis

from keyserial import Context, InsufficientFunds, MultiContext, multi_op, op


@op(inline=True)
def append(ctx: Context, value: Any) -> list[Any]:
    """Append to the key's list; return the whole list (ordering tests)."""
    items = ctx.state or []
    items.append(value)
    ctx.state = items
    return list(items)


@op(inline=True)
def stamp(ctx: Context, label: str) -> float:
    """Append ``[label, the worker's clock]`` to the key's list; return that clock (delayed ops'
    tests: when each ran, and in which order)."""
    now = time.time()
    ctx.state = [*(ctx.state or []), [label, now]]
    return now


@op(inline=True)
def record(ctx: Context) -> int:
    """Log the op id in the key's state: exactly-once is checked op by op, not by a sum."""
    applied = ctx.state or []
    applied.append(ctx.op_id)
    ctx.state = applied
    return len(applied)


@op
async def slow_record(ctx: Context, delay: float) -> int:
    """Read, wait (a slow API call), then write: loses updates unless ops are serial."""
    applied = list(ctx.state or [])
    await anyio.sleep(delay)
    ctx.state = [*applied, ctx.op_id]
    return len(ctx.state)


@op
async def slow_increment(ctx: Context, delay: float) -> int:
    value = ctx.state or 0
    await anyio.sleep(delay)
    ctx.state = value + 1
    return int(ctx.state)


@op(inline=True)
def fence(ctx: Context) -> int:
    return ctx.fence


@op(inline=True)
def crash(ctx: Context) -> None:
    """Kill the worker process outright, as a segfault or OOM kill would."""
    os._exit(17)


@op(inline=True)
def return_unserializable(ctx: Context) -> Any:
    return {1, 2, 3}


@op
async def leak_cancelled(ctx: Context) -> None:
    """Await a task that something else cancelled, and let its CancelledError out."""
    ctx.state = "never kept"
    waited = asyncio.ensure_future(asyncio.sleep(10))
    await asyncio.sleep(0)
    waited.cancel()
    await waited


@op(inline=True)
def raise_cancelled(ctx: Context) -> None:
    raise asyncio.CancelledError()


@multi_op(inline=True)
def write_elsewhere(ctx: MultiContext) -> None:
    for key in ctx.keys:
        ctx.states[key] = "written"
    ctx.states["not-one-of-its-keys"] = "lost"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


@op(inline=True)
def raise_unprintable(ctx: Context) -> None:
    ctx.state = "never kept"
    raise Unprintable()


@op
async def noted_slow_record(ctx: Context, delay: float, note_path: str) -> int:
    """``slow_record`` that first appends the running process's pid to ``note_path``, so a test
    can wait until the op is running (and see which processes ran it). It ends ``delay``
    seconds after it starts, however long the note takes: a process frozen once the note is
    written finds the op done when it resumes."""
    ends = anyio.current_time() + delay
    async with await anyio.open_file(note_path, "a") as note:
        await note.write(f"{os.getpid()}\n")
    applied = list(ctx.state or [])
    await anyio.sleep_until(ends)
    ctx.state = [*applied, ctx.op_id]
    return len(ctx.state)


@op
async def noted_slow_first_record(ctx: Context, delay: float, note_path: str) -> int:
    """``noted_slow_record`` whose first run only waits ``delay`` seconds; a run again (the
    note names an earlier one) does not, so a test that has it run twice waits once."""
    async with await anyio.open_file(note_path, "a+") as note:
        await note.seek(0)
        first = not await note.read()
        await note.write(f"{os.getpid()}\n")
    applied = list(ctx.state or [])
    await anyio.sleep(delay if first else 0)
    ctx.state = [*applied, ctx.op_id]
    return len(ctx.state)


@op
def noted_spin_record(ctx: Context, delay: float, note_path: str) -> int:
    """``noted_slow_record`` as a sync op (run in a worker thread), CPU-bound: its first run
    spins for ``delay`` seconds, a thread that cannot be cancelled; a run again (the note names
    an earlier one) does not."""
    with open(note_path, "a+") as note:
        note.seek(0)
        first = not note.read()
        note.write(f"{os.getpid()}\n")
    applied = list(ctx.state or [])
    deadline = time.monotonic() + (delay if first else 0)
    while time.monotonic() < deadline:
        pass
    ctx.state = [*applied, ctx.op_id]
    return len(ctx.state)


@multi_op
async def slow_move(ctx: MultiContext, delay: float) -> list[str]:
    """Read every key, wait, then write: each key's list gains this op id (isolation check)."""
    seen = {key: list(ctx.states[key] or []) for key in ctx.keys}
    await anyio.sleep(delay)
    for key in ctx.keys:
        ctx.states[key] = [*seen[key], ctx.op_id]
    return list(ctx.keys)


@op(inline=True)
def open_account(ctx: Context, amount: int) -> None:
    """A bank account for the cross-shard tests: a balance and the ids of the ops it saw."""
    ctx.state = {"balance": amount, "ops": []}


@multi_op
async def pay(ctx: MultiContext, amount: int, delay: float = 0, note_path: str = "") -> int:
    """The first key pays ``amount`` to each of the others; every key logs the op id, so
    exactly-once is checked op by op. ``note_path``: append the pid before waiting ``delay``
    (a test can then act while the op holds every key)."""
    if note_path:
        async with await anyio.open_file(note_path, "a") as note:
            await note.write(f"{os.getpid()}\n")
    if delay:
        await anyio.sleep(delay)
    return _pay(ctx, amount)


@multi_op(inline=True)
def pay_now(ctx: MultiContext, amount: int) -> int:
    """:func:`pay` as a sync op: when its keys are idle, a worker owning all its shards runs it
    with no task and commits it in the next pipeline (``CrossShard.start_now``)."""
    return _pay(ctx, amount)


@multi_op(inline=True)
def pay_while_taken_over(
    ctx: MultiContext, amount: int, url: str, epoch_key: str, lease_key: str, note_path: str
) -> int:
    """:func:`pay_now` that, the first time it runs, makes it look as if another worker took a
    participant shard over (its lease gone, its epoch moved on) after the keys were held: the
    commit that follows is fenced out. Every run appends the pid to ``note_path``."""
    first = not os.path.exists(note_path)
    with open(note_path, "a") as note:
        note.write(f"{os.getpid()}\n")
    if first:
        client = redis.Redis.from_url(url)
        client.delete(lease_key)
        client.incr(epoch_key)
        client.close()
    return _pay(ctx, amount)


@multi_op
async def pay_tagged(ctx: MultiContext, amount: int, tag: str, delay: float = 0) -> int:
    """:func:`pay` that logs ``tag`` (unique per submission) instead of the op id: the nemesis
    checks ops whose id the client generated (and a cancelled caller never learned)."""
    if delay:
        await anyio.sleep(delay)
    return _pay(ctx, amount, logged=tag)


@multi_op(inline=True)
def pay_now_tagged(ctx: MultiContext, amount: int, tag: str) -> int:
    """:func:`pay_tagged` as a sync op (see :func:`pay_now`)."""
    return _pay(ctx, amount, logged=tag)


@op
async def slow_append(ctx: Context, value: Any, delay: float) -> list[Any]:
    """:func:`append` that waits while it holds the key (a slow API call) before it writes."""
    items = list(ctx.state or [])
    await anyio.sleep(delay)
    ctx.state = [*items, value]
    return list(ctx.state)


def _pay(ctx: MultiContext, amount: int, logged: str | None = None) -> int:
    source, *targets = ctx.keys
    accounts = {key: ctx.states[key] or {"balance": 0, "ops": []} for key in ctx.keys}
    owed = amount * len(targets)
    if accounts[source]["balance"] < owed:
        raise InsufficientFunds(
            balance=accounts[source]["balance"], amount=owed, key=source, op_id=ctx.op_id
        )
    accounts[source]["balance"] -= owed
    for target in targets:
        accounts[target]["balance"] += amount
    for key, account in accounts.items():
        account["ops"].append(ctx.op_id if logged is None else logged)
        ctx.states[key] = account
    return int(accounts[source]["balance"])


@op
async def hold(ctx: Context, delay: float, note_path: str) -> None:
    """Keep the key busy for ``delay`` seconds, leaving its state alone; the pid goes to
    ``note_path`` first, so a test knows the key is held."""
    async with await anyio.open_file(note_path, "a") as note:
        await note.write(f"{os.getpid()}\n")
    await anyio.sleep(delay)


@op
async def gated_append(ctx: Context, value: Any, note_path: str, gate_path: str) -> list[Any]:
    """:func:`append` that notes its pid in ``note_path`` as it starts, then waits until
    ``gate_path`` exists: the test decides when it finishes."""
    items = list(ctx.state or [])
    async with await anyio.open_file(note_path, "a") as note:
        await note.write(f"{os.getpid()}\n")
    # (A plain check, no thread hop: a worker resumed from SIGSTOP finishes the op at once.)
    while not os.path.exists(gate_path):  # noqa: ASYNC240
        await anyio.sleep(0.01)
    ctx.state = [*items, value]
    return list(ctx.state)


@op
async def gated_hold(ctx: Context, gate_path: str, note_path: str | None = None) -> None:
    """Keep the key busy, its state untouched, until ``gate_path`` exists (the pid goes to
    ``note_path`` first, if given, so a test knows the key is held)."""
    if note_path is not None:
        async with await anyio.open_file(note_path, "a") as note:
            await note.write(f"{os.getpid()}\n")
    # (A plain check, no thread hop: a worker resumed from SIGSTOP finishes the op at once.)
    while not os.path.exists(gate_path):  # noqa: ASYNC240
        await anyio.sleep(0.01)


@op
async def hold_then_freeze(ctx: Context, freeze_path: str, gate_path: str, note_path: str) -> None:
    """Keep the key busy until ``freeze_path`` exists; then, in the first worker that ran the
    op only, block that worker's event loop until ``gate_path`` exists: a zombie, like one
    stopped by SIGSTOP, except that once resumed its own op finishes before any other wake-up
    is handled (after SIGCONT their order is left to chance). Another worker's run of the op
    ends at ``freeze_path``."""
    _note_pid(note_path)
    while not os.path.exists(freeze_path):  # noqa: ASYNC240
        await anyio.sleep(0.01)
    await _settle()
    _freeze_first_runner(note_path, gate_path)


@multi_op
async def pay_frozen(ctx: MultiContext, amount: int, gate_path: str, note_path: str) -> int:
    """:func:`pay`, whose first run blocks its worker's event loop until ``gate_path`` exists
    (see :func:`hold_then_freeze`); a later run, as the next owner's, pays at once."""
    _note_pid(note_path)
    await _settle()
    _freeze_first_runner(note_path, gate_path)
    return _pay(ctx, amount)


async def _settle() -> None:
    """Give the worker a moment before it freezes: a step it queued but had not sent yet would
    otherwise leave first once it resumes, and that step's refusal would end the runner before
    the op's own write goes out."""
    await anyio.sleep(0.05)


def _note_pid(note_path: str) -> None:
    with open(note_path, "a") as note:
        note.write(f"{os.getpid()}\n")


def _freeze_first_runner(note_path: str, gate_path: str) -> None:
    """In the process that noted its pid first, sleep without yielding until ``gate_path``
    exists: nothing else of the worker runs meanwhile."""
    with open(note_path) as note:
        first = int(note.readline())
    if first != os.getpid():
        return
    while not os.path.exists(gate_path):
        time.sleep(0.005)  # (blocking on purpose)


@op(inline=True)
def peek(ctx: Context) -> Any:
    """The key's state, as an op: it runs after every op appended before it."""
    return ctx.state


@multi_op(inline=True)
def fences(ctx: MultiContext) -> dict[str, int]:
    """Each key's fencing token, as the op saw it."""
    return dict(ctx.fences)


@op(inline=True)
def write_then_fail(ctx: Context, value: Any) -> None:
    """Writes ``value`` to the key's state, then raises: none of it may be kept."""
    ctx.state = value
    raise ValueError("failed after writing")


@op
async def slow_write_then_fail(ctx: Context, value: Any) -> None:
    """:func:`write_then_fail` as an async op (it runs in a task)."""
    ctx.state = value
    await anyio.lowlevel.checkpoint()
    raise ValueError("failed after writing")


@multi_op(inline=True)
def write_all_then_fail(ctx: MultiContext, value: Any) -> None:
    """Writes ``value`` to every key's state, then raises: none of it may be kept."""
    for key in ctx.keys:
        ctx.states[key] = value
    raise ValueError("failed after writing")


@op(inline=True)
def fail_deep(ctx: Context, depth: int, padding: int = 0) -> None:
    """Raise from ``depth`` frames down, with ``padding`` more characters of message."""
    if depth > 0:
        fail_deep.fn(ctx, depth - 1, padding)
        return
    raise RuntimeError(f"boom at the bottom of {ctx.key}" + "!" * padding)


@op
def gated_block(ctx: Context, gate_path: str, note_path: str) -> int:
    """A sync op (in a worker thread): notes the pid in ``note_path``, then blocks its thread
    (``time.sleep``, never awaiting) until ``gate_path`` exists; adds 1 to the key's count."""
    with open(note_path, "a") as note:
        note.write(f"{os.getpid()}\n")
    while not os.path.exists(gate_path):
        time.sleep(0.01)
    ctx.state = (ctx.state or 0) + 1
    return int(ctx.state)


@op
def blocking_fail(ctx: Context) -> None:
    """A sync op that raises in its thread after writing: nothing it wrote is kept."""
    ctx.state = "written"
    raise RuntimeError("boom in a thread")


@op(inline=True)
def stall_loop(ctx: Context, seconds: float) -> None:
    """A sync op declared inline that blocks anyway: the worker warns, naming it."""
    time.sleep(seconds)


@multi_op
def blocking_pay(ctx: MultiContext, amount: int) -> int:
    """:func:`pay_now` not declared inline: it runs in a thread, across shards too."""
    return _pay(ctx, amount)


def _spin(seconds: float) -> None:
    """Keep a core busy in Python for ``seconds`` (CPU work: no sleep, no I/O)."""
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        pass


@op
def cpu_spin(ctx: Context, seconds: float, note_path: str = "") -> int:
    """A plain sync op, CPU-bound for ``seconds`` (no declaration: it runs in a worker
    thread), once it has noted its pid in ``note_path`` (if any); adds 1 to the key's count."""
    if note_path:
        _note_pid(note_path)
    _spin(seconds)
    ctx.state = (ctx.state or 0) + 1
    return int(ctx.state)


@op(inline=True)
def cpu_spin_inline(ctx: Context, seconds: float) -> int:
    """:func:`cpu_spin` declared inline: it runs on the worker's event loop, holding it."""
    _spin(seconds)
    ctx.state = (ctx.state or 0) + 1
    return int(ctx.state)


def _where() -> str:
    """``"loop"`` when called on a running event loop's thread, else ``"thread"``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return "thread"
    return "loop"


@op
def where_plain(ctx: Context) -> str:
    """Where a sync op runs with no declaration."""
    return _where()


@op(inline=True)
def where_inline(ctx: Context) -> str:
    """Where a sync op declared inline runs."""
    return _where()


@op
def append_slowly(ctx: Context, value: Any, seconds: float) -> list[Any]:
    """A plain sync op (in a worker thread): read the key's list, block ``seconds``, then
    append ``value``; loses updates unless the ops on the key run one after another. The value
    ``"fail"`` is appended, then the op raises: nothing of it may be kept."""
    items = list(ctx.state or [])
    time.sleep(seconds)
    ctx.state = [*items, value]
    if value == "fail":
        raise ValueError("failed after appending")
    return list(ctx.state)


@op
def raise_cancelled_in_thread(ctx: Context) -> None:
    """:func:`raise_cancelled` as a plain sync op: in a worker thread, where no task is."""
    raise asyncio.CancelledError()


# -- timers an op sets ---------------------------------------------------------------------------


@op(inline=True)
def hold_seat(ctx: Context, holder: str, seconds: float) -> str:
    """Hold the seat for ``holder``, released by a timer unless paid first; the timer's id."""
    if ctx.state:
        raise ValueError(f"the seat is held by {ctx.state['holder']}")
    timer = ctx.after(seconds, release_seat(holder))
    ctx.state = {"holder": holder, "timer": timer}
    return timer


@op(inline=True)
def release_seat(ctx: Context, holder: str) -> bool:
    """The hold's timer: free the seat, unless someone else holds it or it was paid."""
    state = ctx.state
    if state and state["holder"] == holder and not state.get("paid"):
        ctx.state = None
        return True
    return False


@op(inline=True)
def pay_seat(ctx: Context, holder: str) -> str:
    """Pay for the held seat: its release is cancelled with this op's write."""
    state = ctx.state
    if not state or state["holder"] != holder:
        raise ValueError("the seat is not held by this holder")
    ctx.cancel(state["timer"])
    ctx.state = {"holder": holder, "paid": True}
    return str(state["timer"])


@op
def append_in_thread(ctx: Context, value: Any) -> list[Any]:
    """:func:`append`, as a sync op that runs in a worker thread."""
    items = ctx.state or []
    items.append(value)
    ctx.state = items
    return list(items)


@op(inline=True)
def append_later(
    ctx: Context, seconds: float, value: Any, fail: bool = False, threaded: bool = False
) -> str:
    """Append ``value`` to the key's list ``seconds`` after this op commits (a timer's op, run
    in a worker thread if ``threaded``); with ``fail``, raise after setting it (the timer must
    not exist)."""
    timer = ctx.after(seconds, (append_in_thread if threaded else append)(value))
    if fail:
        raise RuntimeError("failed after setting a timer")
    return timer


@op(inline=True)
def cancel_timer(ctx: Context, timer_id: str) -> None:
    ctx.cancel(timer_id)


@op
def append_later_in_thread(ctx: Context, seconds: float, value: Any) -> str:
    """:func:`append_later`, as a sync op that runs in a worker thread."""
    return ctx.after(seconds, append(value))


@op
def cancel_timer_in_thread(ctx: Context, timer_id: str) -> None:
    ctx.cancel(timer_id)


@op(inline=True)
def stamp_later(ctx: Context, seconds: float, label: str) -> str:
    """Set a timer running :func:`stamp` ``seconds`` after this op commits; its id (the
    nemesis's timer workload: when a timer an op set ran, against its due time)."""
    return ctx.after(seconds, stamp(label))
