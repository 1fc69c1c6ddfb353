"""What every request must pass before a route sees it: ``RequestGuard``, an ASGI middleware.

In order: the Host header (bound to loopback, a browser page reaches the server only through
DNS rebinding, which names a foreign host), the API key (every route but the open ones), the
content type (a browser sends a cross-origin ``text/plain`` or form POST without a CORS
preflight, so the JSON routes take JSON only) and the declared body size (refused before a
byte of the body is read). The body is then counted as it arrives, for clients that declare no
length. Every answer carries ``X-Request-Id``: the client's, or one made here.
"""

from __future__ import annotations

import hmac
import re
import uuid

from starlette.datastructures import Headers

from actorlm.api import protocol as p
from actorlm.api.options import ServerOptions
from actorlm.api.responses import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/openapi.json"})
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyTooLarge(p.ApiError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes "
                              f"(--max-request-body-bytes)")


class RequestGuard:
    def __init__(self, app, options: ServerOptions):
        self.app, self.options = app, options
        self._keys = [key.encode() for key in options.api_keys]
        self._host_names = options.host_names() if options.checks_host else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id")
        from_client = request_id is not None and _REQUEST_ID.fullmatch(request_id) is not None
        if not from_client:
            request_id = uuid.uuid4().hex
        send = _echo_request_id(send, request_id)
        refusal = self._refusal(scope, headers)
        if refusal is None and headers.get("x-request-id") is not None and not from_client:
            refusal = p.ApiError(400, "X-Request-Id: expected 1 to 128 printable ASCII "
                                      "characters without spaces", "X-Request-Id")
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_from_client"] = request_id, from_client
        await self.app(scope, self._counting(receive), send)

    def _refusal(self, scope, headers: Headers) -> p.ApiError | None:
        host = headers.get("host")
        if self._host_names is not None and host is not None \
                and _host_name(host) not in self._host_names:
            return p.ApiError(400, "the Host header names a host this server does not serve "
                                   "(--allowed-hosts)")
        if self._keys and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS" \
                and not self._authorized(scope):
            return p.ApiError(401, "a valid API key is required: Authorization: Bearer KEY",
                              headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] in _BODY_METHODS:
            media_type = headers.get("content-type")
            if media_type is not None and not _is_json(media_type):
                return p.ApiError(415, f"expected Content-Type application/json, "
                                       f"got {media_type[:100]!r}")
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.options.max_request_body_bytes:
                return BodyTooLarge(self.options.max_request_body_bytes)
        return None

    def _authorized(self, scope) -> bool:
        token = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = token.partition(b" ")
        token = token.strip()
        # every key is compared, in constant time, whatever the earlier ones gave
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(token, key)
        return scheme.lower() == b"bearer" and matched

    def _counting(self, receive):
        limit = self.options.max_request_body_bytes
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # raised into the route's body read: answered 413
                    raise BodyTooLarge(limit)
            return message

        return counting_receive


def _echo_request_id(send, request_id: str):
    value = request_id.encode()

    async def send_with_id(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"x-request-id", value)]}
        await send(message)

    return send_with_id


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` gives ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_json(media_type: str) -> bool:
    kind = media_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))
