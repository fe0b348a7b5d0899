"""Bearer-token check in front of every route but ``/health`` (OpenAI's 401 shape on failure).

The key is a parameter of the app factory; the command line resolves it from
``--api-key`` or ``FLARE_API_KEY``. A pure ASGI middleware, so it also guards
unknown paths and never buffers a streamed response. The scheme is matched
case-insensitively (``bearer`` is ``Bearer``), the key exactly.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from helios.server.errors import unauthorized

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("an API key must be a non-empty string (pass None for no authentication)")
        self._app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        error = self._refusal(dict(scope["headers"]).get(b"authorization"))
        if error is None:
            await self._app(scope, receive, send)
        else:
            await error.response()(scope, receive, send)

    def _refusal(self, header: bytes | None):
        if header is None:
            return unauthorized("Missing API key: send the header 'Authorization: Bearer <key>'.")
        scheme, _, key = header.strip().partition(b" ")
        if scheme.lower() != b"bearer":  # auth schemes are case-insensitive (RFC 9110, section 11.1)
            return unauthorized("The Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'.")
        # Constant-time comparison: response timing must not reveal how much of a guess was right.
        if not hmac.compare_digest(key.lstrip(b" "), self._key):
            return unauthorized("Incorrect API key provided in the Authorization header.")
        return None
