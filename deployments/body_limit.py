"""A request-body size limit that also holds for chunked uploads (no Content-Length).

Pure ASGI: the declared length is checked before anything is read, and the bytes actually
received are counted, so a chunked body is cut off at the limit instead of buffered whole.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException as StarletteHTTPException

from .http_errors import HTTPError
from .openai_protocol import error_body


class BodyTooLarge(HTTPError, StarletteHTTPException):
    """Raised from ``receive`` inside the app, so the app's handler answers 413 (HTTPError's status).

    Also a Starlette ``HTTPException``: FastAPI turns any other error raised while it reads a
    body into a generic 400, but lets these through to the handlers.
    """

    def __init__(self, limit: int):
        message = f"request body exceeds the limit of {limit} bytes"
        HTTPError.__init__(self, 413, message, code="body_too_large")
        self.status_code, self.detail, self.headers = 413, message, None


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, f"request body of {int(declared)} bytes exceeds the limit of "
                                            f"{self.limit} bytes")
        received = 0
        started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:  # read outside the app's handlers (e.g. by a middleware)
            if not started:
                await self._refuse(send, str(exc))

    @staticmethod
    async def _refuse(send, message: str) -> None:
        body = json.dumps(error_body(413, message)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
