"""ASGI middleware: X-Request-Id and last-resort 500s, API key on /v1/* (and the tokenizer's
routes), request body size limit."""

from __future__ import annotations

import hmac
import logging
import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, internal_error

log = logging.getLogger("redjax.api")

_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
GUARDED_PATHS = ("/tokenize", "/detokenize")  # outside /v1, as vLLM serves them, but the key guards them too


class RequestIdMiddleware:
    """Every response carries X-Request-Id (the client's when sane, else a new one).

    Outermost of ours, so it also turns an unhandled exception into an OpenAI-style 500 that still
    carries the id (Starlette's own 500 page would be sent outside this middleware).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _SANE_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s (request id %s)", scope["method"], scope["path"], request_id)
            if started:
                raise
            await internal_error().response()(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """/v1/*, /tokenize and /detokenize need `Authorization: Bearer <api_key>`; compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path == "/v1" or path.startswith("/v1/") or path in GUARDED_PATHS:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
                error = ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body above max_bytes: at once from Content-Length, else while it is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body is larger than {self.max_bytes} bytes", code="request_too_large")
