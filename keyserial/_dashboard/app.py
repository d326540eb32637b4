"""The dashboard's web app: one page (``static/``) and the JSON API it polls.

Every ``/api/`` request needs the dashboard's token (``Authorization: Bearer <token>``): the
views show keys' states and the actions replay, drop and pause. A token in a header is
something a page of another site cannot send, and the page itself never puts the data it
shows into HTML (``textContent`` only), behind a Content-Security-Policy that forbids inline
script: a key or an error message that holds markup shows as text.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib.resources import files
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._backend.backend import Backend
from ..errors import BackendUnavailable, KeyserialError
from .views import ActionRefused, Dashboard

_STATIC = files("keyserial._dashboard") / "static"
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

View = Callable[[Dashboard, Request], Awaitable[dict[str, Any]]]


def create_app(redis: str, namespace: str, token: str, *, max_backlog: int) -> Starlette:
    """The dashboard of ``namespace`` on ``redis``; its API answers only to ``token``."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        backend = await Backend.connect(redis)
        app.state.dashboard = Dashboard(backend, namespace, max_backlog)
        try:
            yield
        finally:
            await backend.aclose()

    def api(view: View) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _json({"error": "this needs the dashboard's token"}, 401)
            try:
                return _json(await view(request.app.state.dashboard, request))
            except BackendUnavailable as exc:
                return _json({"error": str(exc)}, 503)
            except (ActionRefused, KeyserialError) as exc:
                return _json({"error": str(exc)}, 409)

        return endpoint

    routes = [
        Route("/", _page),
        Route("/favicon.ico", _no_icon),
        Mount("/static", StaticFiles(directory=str(_STATIC)), name="static"),
        Route("/api/overview", api(_overview)),
        Route("/api/keys/{key:path}/pause", api(_pause), methods=["POST"]),
        Route("/api/keys/{key:path}/resume", api(_resume), methods=["POST"]),
        Route("/api/keys/{key:path}", api(_key)),
        Route("/api/dead-letters/{shard:int}/{letter}/replay", api(_replay), methods=["POST"]),
        Route("/api/dead-letters/{shard:int}/{letter}/drop", api(_drop), methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(_SecurityHeaders)
    return app


async def _page(request: Request) -> Response:
    return FileResponse(str(_STATIC / "index.html"), media_type="text/html")


async def _no_icon(request: Request) -> Response:
    return Response(status_code=204)


async def _overview(dashboard: Dashboard, request: Request) -> dict[str, Any]:
    return await dashboard.overview()


async def _key(dashboard: Dashboard, request: Request) -> dict[str, Any]:
    return await dashboard.key(request.path_params["key"])


async def _pause(dashboard: Dashboard, request: Request) -> dict[str, Any]:
    return await dashboard.pause(request.path_params["key"], pausing=True)


async def _resume(dashboard: Dashboard, request: Request) -> dict[str, Any]:
    return await dashboard.pause(request.path_params["key"], pausing=False)


async def _replay(dashboard: Dashboard, request: Request) -> dict[str, Any]:
    new_ids = request.query_params.get("new_id") == "1"
    params = request.path_params
    return await dashboard.replay(params["shard"], params["letter"], new_ids=new_ids)


async def _drop(dashboard: Dashboard, request: Request) -> dict[str, Any]:
    return await dashboard.drop(request.path_params["shard"], request.path_params["letter"])


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return JSONResponse(body, status_code=status)


class _SecurityHeaders:
    """Adds :data:`_HEADERS` to every response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] += [
                    (name.lower().encode(), value.encode()) for name, value in _HEADERS.items()
                ]
            await send(message)

        await self.app(scope, receive, send_with_headers)
