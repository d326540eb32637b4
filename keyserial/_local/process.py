"""Child processes that die with their parent: ``keyserial dev``'s server and worker, so that
a ``dev`` killed with -9 leaves no server behind to hold its port (Linux's parent-death signal;
elsewhere nothing: ``dev``'s own shutdown stops them)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

#: ``prctl`` option: the signal the calling process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child get SIGKILL when this
    process dies; None where the system has no such signal."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            os._exit(70)  # (cannot promise it: better no child than an orphan)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(70)

    return arm
