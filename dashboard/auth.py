"""Access to the dashboard and /metrics when an API key is configured.

Two ways in: `Authorization: Bearer <key>` (scrapers, scripts) or the session cookie set by the
login form. The cookie holds HMAC-SHA256(key, purpose), never the key, so a leaked cookie does
not reveal the key, and changing the key logs everyone out. Comparisons run in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

SESSION_COOKIE = "redjax_session"
SESSION_MAX_AGE_S = 7 * 24 * 3600
_PURPOSE = b"redjax dashboard session v1"
MAX_FORM_BYTES = 4096


def session_token(api_key: str) -> str:
    """The cookie value for `api_key`: derived from it, useless for recovering it."""
    return hmac.new(api_key.encode(), _PURPOSE, hashlib.sha256).hexdigest()


class Gate:
    """Decides whether a request may see data. Open when no key is configured."""

    def __init__(self, api_key: str | None) -> None:
        self._key = api_key.encode() if api_key else None
        self._token = session_token(api_key).encode() if api_key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def key_matches(self, candidate: str) -> bool:
        return self._key is not None and hmac.compare_digest(candidate.encode(), self._key)

    def allows(self, request: Request) -> bool:
        if self._key is None or self._token is None:
            return True
        scheme, _, credential = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), self._key):
            return True
        cookie = request.cookies.get(SESSION_COOKIE, "")
        return hmac.compare_digest(cookie.encode(), self._token)

    def set_session(self, response: Response, request: Request) -> None:
        if self._token is None:
            return
        response.set_cookie(
            SESSION_COOKIE,
            self._token.decode(),
            max_age=SESSION_MAX_AGE_S,
            path="/",  # also covers the API's top-level /metrics when mounted in it
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    @staticmethod
    def clear_session(response: Response) -> None:
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")


def unauthorized() -> Response:
    return JSONResponse(
        {"error": {"message": "An API key is required: log in, or send Authorization: Bearer <key>.", "type": "unauthorized"}},
        status_code=401,
        headers={"WWW-Authenticate": 'Bearer realm="redjax"', "Cache-Control": "no-store"},
    )


async def submitted_key(request: Request) -> str:
    """The `api_key` field of a urlencoded login form (bounded in size; empty when absent)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return ""
    values = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True).get("api_key", [""])
    return values[0]
