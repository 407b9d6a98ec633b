"""What stands between the port and the model: an API key on every /v1 route, and a bound on a
request body's size. Both are plain ASGI middleware, so they answer before FastAPI reads or
validates anything, with the OpenAI error body clients already parse."""

from __future__ import annotations

import hmac
import json

from selfspec.server.protocol import APIError

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


async def _answer(send, error: APIError, headers: tuple = ()) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequireKey:
    """Every path under /v1 needs ``Authorization: Bearer <key>``, compared in constant time;
    /health and /metrics stay open (for probes and scrapers on the host)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key):
            return await self.app(scope, receive, send)
        message = (
            "no API key: send the header 'Authorization: Bearer <key>'"
            if not header
            else "the API key is not this server's"
        )
        error = APIError(401, message, code="invalid_api_key")
        await _answer(send, error, ((b"www-authenticate", b"Bearer"),))


class LimitBody:
    """A request body over ``limit`` bytes gets 413, whether it declares its length or streams
    it in chunks (read here first, up to the limit, then handed on: FastAPI would turn an error
    raised while it reads the body into a 400)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _too_large(self, send) -> None:
        message = f"the request body is over this server's limit of {self.limit} bytes"
        await _answer(send, APIError(413, message))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.limit:
                return await self._too_large(send)
            return await self.app(scope, receive, send)  # the server stops at the length
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
