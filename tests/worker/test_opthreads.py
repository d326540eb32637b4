"""The threads sync ops run in: daemon threads (a process exits without waiting for an op it
abandoned: tests/operator/test_cli.py's second-signal test checks that on a worker), at most
``max_threads`` at once, an idle one reused, a call's result or error handed back."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from keyserial._worker.opthreads import DaemonThreadPool


def test_a_call_s_result_and_error_come_back_through_its_future() -> None:
    pool = DaemonThreadPool(2, "test-op")
    assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(timeout=5) == 5
    with pytest.raises(KeyError, match="missing"):
        pool.submit({}.__getitem__, "missing").result(timeout=5)


def test_calls_that_overlap_get_threads_up_to_the_most_and_then_wait() -> None:
    pool = DaemonThreadPool(2, "test-op")
    release = threading.Event()
    names: list[str] = []

    def hold() -> None:
        names.append(threading.current_thread().name)
        release.wait(10)

    held = [pool.submit(hold) for _ in range(3)]
    deadline = time.monotonic() + 5
    while len(names) < 2:
        assert time.monotonic() < deadline, "two calls did not start side by side"
        time.sleep(0.01)
    assert not held[2].running(), "a third thread started past the most"
    release.set()
    for future in held:
        future.result(timeout=5)
    assert pool.threads == 2
    assert sorted(set(names)) == ["test-op_0", "test-op_1"]


def test_an_idle_thread_takes_the_next_call() -> None:
    pool = DaemonThreadPool(4, "test-op")
    for _ in range(5):
        pool.submit(time.sleep, 0).result(timeout=5)
        deadline = time.monotonic() + 5
        while pool._idle._value == 0:  # (the thread counts itself idle after the result)
            assert time.monotonic() < deadline
            time.sleep(0.001)
    assert pool.threads == 1


def test_its_threads_are_daemons_and_the_process_exits_without_waiting_for_them() -> None:
    program = (
        "import threading, time\n"
        "from keyserial._worker.opthreads import DaemonThreadPool\n"
        "pool = DaemonThreadPool(1, 'test-op')\n"
        "started = threading.Event()\n"
        "pool.submit(lambda: (started.set(), time.sleep(30)))\n"
        "started.wait(10)\n"
        "assert all(t.daemon for t in threading.enumerate() if t.name.startswith('test-op'))\n"
    )
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", program], check=True, timeout=20)
    assert time.monotonic() - began < 10, "the process waited for its thread's call (30 s)"
