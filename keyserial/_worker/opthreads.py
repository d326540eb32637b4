"""The threads a worker runs sync ops in: at most a fixed number, started on demand, reused, and
daemon threads, so that a process never waits for an op it has abandoned.

The standard ``ThreadPoolExecutor`` joins its threads when the interpreter exits. A thread
cannot be stopped, so a worker stopped at once (a second Ctrl-C) while a sync op spins in one
would wait for that op to end before its process exits, although its outcome is dropped: only
the event loop commits, and it has stopped. Daemon threads end with the process instead, as the
op would on a crash; its entry was not committed, so the next owner runs it.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

#: A job for a thread: the future to settle, and the call that settles it.
_Job = tuple["Future[Any]", Callable[[], Any]]


class DaemonThreadPool(Executor):
    """Runs each submitted call in one of at most ``max_threads`` daemon threads: an idle one if
    there is one, else a new one while fewer than ``max_threads`` run; else the call waits for
    a thread to finish its call."""

    def __init__(self, max_threads: int, name_prefix: str) -> None:
        self._max_threads = max_threads
        self._name_prefix = name_prefix
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        #: One permit per thread waiting for a job: a submit that takes one starts no thread.
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._started = 0

    @property
    def threads(self) -> int:
        """How many threads this pool has started (each lives as long as the process)."""
        return self._started

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, functools.partial(fn, *args, **kwargs)))
        if not self._idle.acquire(blocking=False):
            self._start_thread()
        return future

    def _start_thread(self) -> None:
        with self._lock:
            if self._started >= self._max_threads:
                return  # (the job waits for a thread to finish its call)
            self._started += 1
            name = f"{self._name_prefix}_{self._started - 1}"
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        """In a pool thread: run jobs one after another, forever (until the process ends)."""
        while True:
            future, call = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, call  # (no reference kept to a result while idle)
            self._idle.release()
