"""``keyserial dashboard``: serve the web dashboard of a namespace (``keyserial._dashboard``).

It binds to 127.0.0.1 unless told otherwise, and its API answers only to a token: the one given
(``--token`` or ``$KEYSERIAL_DASHBOARD_TOKEN``), else a new one, printed in the URL to open.
It needs the ``dashboard`` extra (Starlette and uvicorn): ``pip install 'keyserial[dashboard]'``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket

import anyio

from .._backend.backend import Backend
from .._operator.namespace import layout_in_use
from .._settings import Settings
from ..errors import ConfigError, redact
from .arguments import Subcommands, chosen_server, connection_options, port

COMMANDS = ("dashboard",)
TOKEN_VARIABLE = "KEYSERIAL_DASHBOARD_TOKEN"


def add_commands(commands: Subcommands) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        parents=[connection_options()],
        help="serve a web dashboard: shards, workers, dead letters, keys (needs a token)",
    )
    dashboard.add_argument(
        "--port", type=port, default=8600, help="(default: %(default)s; 0: any free port)"
    )
    dashboard.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to bind (default: %(default)s; anything else exposes it to the network)",
    )
    dashboard.add_argument(
        "--token",
        default=None,
        help=f"what the API asks for (default: ${TOKEN_VARIABLE}, else a new one, printed)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .._dashboard.app import create_app
    except ImportError as exc:
        raise ConfigError(
            f"keyserial dashboard needs the dashboard extra ({exc.name} is missing):"
            " pip install 'keyserial[dashboard]'"
        ) from None
    settings = Settings.resolve(namespace=args.namespace)
    url = chosen_server(args.redis)[0]
    anyio.run(_check_namespace, url, settings.namespace)
    token = args.token or os.environ.get(TOKEN_VARIABLE) or secrets.token_urlsafe(24)
    listener = _bind(args.host, args.port)
    bound = listener.getsockname()[1]
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"keyserial dashboard of namespace {settings.namespace!r} on {redact(url)}:"
        f" http://{shown_host}:{bound}/#token={token}",
        flush=True,
    )
    app = create_app(url, settings.namespace, token, max_backlog=settings.max_backlog)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[listener])
    return 0


async def _check_namespace(url: str, namespace: str) -> None:
    """Fail at start, not on the first page: Redis down, or a namespace nothing has used."""
    backend = await Backend.connect(url)
    try:
        await layout_in_use(backend, namespace)
    finally:
        await backend.aclose()


def _bind(host: str, port_number: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port_number))
    except OSError as exc:
        listener.close()
        raise ConfigError(f"cannot listen on {host}:{port_number}: {exc.strerror}") from None
    listener.listen(128)
    return listener
