"""Every failure as an OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging

from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger("redjax.api")

# OpenAI's error `type` for each status this API answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """A failure the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_data(self) -> str:
        """The error as one server-sent event payload (a stream that already answered 200)."""
        return json.dumps(self.body())


def redis_unavailable() -> ApiError:
    return ApiError(503, "the request queue (Redis) is unavailable; retry later", code="queue_unavailable")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
    error = ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=dict(exc.headers or {}))
    return error.response()


async def _redis_error(request: Request, exc: Exception) -> Response:
    log.warning("redis error on %s: %s", request.url.path, type(exc).__name__)
    return redis_unavailable().response()


EXCEPTION_HANDLERS = {ApiError: _api_error, HTTPException: _http_error, RedisError: _redis_error}


def internal_error() -> ApiError:
    return ApiError(500, "internal server error", code="internal_error")
