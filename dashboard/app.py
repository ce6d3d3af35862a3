"""create_dashboard(config): the Starlette app, standalone or mounted under a prefix (e.g. /dashboard).

Routes (relative to where it is mounted):
  GET  /               the page (redirects to login when a key is needed and missing)
  GET  /login, POST /login, POST /logout
  GET  /api/snapshot   the current snapshot as JSON
  GET  /api/stream     the snapshot every refresh interval, as server-sent events
  GET  /metrics        Prometheus text
  GET  /static/...     the page's script and styles (nothing is loaded from elsewhere)

Links are built from the request's root_path, so the same app works at / and under a Mount.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dashboard.auth import Gate, submitted_key, unauthorized
from dashboard.config import DashboardConfig
from dashboard.fleet import RedisClients
from dashboard.metrics import metrics_route
from dashboard.snapshot import SnapshotSource

HERE = Path(__file__).parent
LOGIN_FAILURE_DELAY_S = 0.5  # slows guessing without blocking other requests
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; style-src 'self'; script-src 'self'; img-src 'self' data:; "
     b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class SecurityHeaders:
    """Adds a strict content security policy (everything is same-origin) to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)


class DashboardPages:
    """The page, login and data endpoints of one dashboard app."""

    def __init__(self, config: DashboardConfig, source: SnapshotSource, gate: Gate) -> None:
        self._config = config
        self._source = source
        self._gate = gate
        self._templates = Jinja2Templates(directory=HERE / "templates")

    async def index(self, request: Request) -> Response:
        if not self._gate.allows(request):
            return RedirectResponse(_base(request) + "/login", status_code=303)
        snapshot = await self._source.snapshot()
        return self._render(request, "index.html", {"snapshot": snapshot, "refresh_s": self._config.refresh_s})

    async def login(self, request: Request) -> Response:
        if not self._gate.enabled:
            return RedirectResponse(_base(request) + "/", status_code=303)
        if request.method == "GET":
            return self._render(request, "login.html", {"failed": False})
        if not self._gate.key_matches(await submitted_key(request)):
            await asyncio.sleep(LOGIN_FAILURE_DELAY_S)
            return self._render(request, "login.html", {"failed": True}, status_code=401)
        response = RedirectResponse(_base(request) + "/", status_code=303)
        self._gate.set_session(response, request)
        return response

    async def logout(self, request: Request) -> Response:
        response = RedirectResponse(_base(request) + "/login", status_code=303)
        self._gate.clear_session(response)
        return response

    async def snapshot(self, request: Request) -> Response:
        if not self._gate.allows(request):
            return unauthorized()
        return JSONResponse(await self._source.snapshot(), headers={"Cache-Control": "no-store"})

    async def stream(self, request: Request) -> Response:
        if not self._gate.allows(request):
            return unauthorized()
        return EventSourceResponse(
            self._snapshots(),
            ping=15,
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def _snapshots(self) -> AsyncIterator[dict[str, Any]]:
        yield {"retry": 1000, "comment": "reconnect after a second when the connection drops"}
        while True:
            snapshot = await self._source.snapshot()
            yield {"event": "snapshot", "data": json.dumps(snapshot, separators=(",", ":"))}
            await asyncio.sleep(self._config.refresh_s)

    def _render(self, request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> Response:
        context = {"base": _base(request), "login_enabled": self._gate.enabled, **context}
        return self._templates.TemplateResponse(
            request, name, context, status_code=status_code, headers={"Cache-Control": "no-store"}
        )


def create_dashboard(config: DashboardConfig) -> Starlette:
    """The dashboard app; serve it alone or `Mount("/dashboard", create_dashboard(config))`."""
    clients = RedisClients(config.redis_url)
    pages = DashboardPages(config, SnapshotSource(config, clients), Gate(config.api_key))
    routes = [
        Route("/", pages.index, methods=["GET"], name="index"),
        Route("/login", pages.login, methods=["GET", "POST"], name="login"),
        Route("/logout", pages.logout, methods=["POST"], name="logout"),
        Route("/api/snapshot", pages.snapshot, methods=["GET"], name="snapshot"),
        Route("/api/stream", pages.stream, methods=["GET"], name="stream"),
        metrics_route(config, clients),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)])


def _base(request: Request) -> str:
    """The path this app is mounted at ("" standalone, "/dashboard" in the API)."""
    return request.scope.get("root_path", "").rstrip("/")
