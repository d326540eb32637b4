"""One keyserial client per process, created on first use.

Created lazily, not at import: a gunicorn or uWSGI worker process is forked from its master
before it serves a request, and a client does not survive a fork. Every thread of the process
shares the one client.
"""

import atexit
import threading

from django.conf import settings

import keyserial

_lock = threading.Lock()
_clients: list[keyserial.SyncClient] = []


def keyserial_client() -> keyserial.SyncClient:
    with _lock:
        if not _clients:
            client = keyserial.connect_sync(
                settings.KEYSERIAL_URL,
                shards=settings.KEYSERIAL_SHARDS,
                namespace=settings.KEYSERIAL_NAMESPACE,
            )
            atexit.register(client.close)
            _clients.append(client)
        return _clients[0]


def close_client() -> None:
    """Close this process's client (the next use creates a new one)."""
    with _lock:
        while _clients:
            _clients.pop().close()
