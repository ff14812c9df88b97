"""The agent's HTTP routes on plain Starlette: signature check, capped body, pydantic in and out.

Every route first verifies the request's signed headers (see `auth`): an unsigned, stale,
replayed request, or one signed for another agent or incarnation, gets 401 `{"detail": reason}`
before a byte of its body is read, and the connection is closed (uvicorn would otherwise drain
the body). Every route has a body cap (`DEFAULT_MAX_BODY_BYTES` unless it says otherwise, none
for GET): a larger declared body gets 413 unread, a larger chunked one 413 once the cap is
passed. The body is then held to its signed sha256, parsed into the route's pydantic model (422
`{"detail": [errors]}` when it is not one), the handler runs, and its pydantic reply is the JSON
answer. A handler raises `RouteError` for another status (`{"detail": ...}`, the shape FastAPI
uses and `AgentClient` reads).

Why not FastAPI: the agent starts on every host of every launch, and importing FastAPI cost
~0.6 s of CPU per agent here (half the agent's start-up); its dependency and validation layers
also cost ~0.6 ms per request (benchmarks/RESULTS.md). The routes need none of its features.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from art_mega.agent.auth import AuthError, Verifier

if TYPE_CHECKING:
    # Starlette is imported where it is used: every service's protocol module imports `Route`
    # from here, and the processes that only read those bodies (the controller, rollout workers,
    # trainer ranks) need no web framework.
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route as StarletteRoute

H = TypeVar("H", bound=Callable[..., Awaitable[Any]])
Req = TypeVar("Req", bound=BaseModel)
Resp = TypeVar("Resp", bound=BaseModel)

API_PREFIX = "/v1"
"""Every agent route's path starts with this (a `Route`'s path is relative to it)."""
DEFAULT_MAX_BODY_BYTES = 1 << 20
"""Body cap of a route that names none (1 MiB: every control body is far smaller)."""
MAX_HEAD_BYTES = 64 << 10
"""Cap on a request's line and headers (bytes received before the headers end): a signed
request's headers are under 1 KiB; httptools alone buffers any amount."""


@dataclass(frozen=True)
class Route(Generic[Req, Resp]):
    """One agent route as both ends see it: the server serves it (`SignedRouter.serve`), the
    client calls it (`AgentClient.call`), so path, body and reply types cannot drift apart.

    `path` is relative to `API_PREFIX` (e.g. "/etcd/start"); `request` is the body's model (None:
    the handler takes no argument and the body is ignored once its signature is checked; a GET
    never has one); `response` the reply's model; `max_body_bytes` the POST body cap (a larger body
    is refused with 413; a GET's cap is always 0, as it takes no body).
    """

    method: Literal["POST", "GET"]
    path: str
    request: type[Req] | None
    response: type[Resp]
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.method == "GET" and self.request is not None:
            raise ValueError(f"route GET {self.path}: a GET takes no body; set request=None")


def capped_head_protocol() -> type | str:
    """The uvicorn HTTP protocol for the agent: httptools' with the request line and headers
    held to `MAX_HEAD_BYTES` (431 and the connection closed past it, before any route or
    signature check runs), or "h11" when httptools is not installed (h11 caps them at 16 KiB)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class CappedHeadProtocol(HttpToolsProtocol):
        _in_head = True
        _head_bytes = 0

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                message = (
                    f"the request line and headers take at most {MAX_HEAD_BYTES} bytes; "
                    f"this request sent {self._head_bytes} without ending them"
                ).encode()
                self.transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"content-length: "
                    + str(len(message)).encode()
                    + b"\r\nconnection: close\r\n\r\n"
                    + message
                )
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0  # the next request on this connection

    return CappedHeadProtocol


class RouteError(Exception):
    """Answer `status` with `{"detail": detail}` (e.g. 404 for an unknown worker).

    `close`: also close the connection (the request body was not read to its end).
    """

    def __init__(self, status: int, detail: Any, close: bool = False) -> None:
        super().__init__(str(detail))
        self.status = status
        self.detail = detail
        self.close = close


def json_reply(model: BaseModel) -> Response:
    """A pydantic model as a 200 JSON response."""
    from starlette.responses import Response

    return Response(content=model.model_dump_json(), media_type="application/json")


def _detail(status: int, detail: Any, close: bool = False) -> Response:
    from starlette.responses import Response

    headers = {"connection": "close"} if close else None
    return Response(
        json.dumps({"detail": detail}, default=str), status, headers=headers, media_type="application/json"
    )


def body_error(exc: ValidationError) -> RouteError:
    """The 422 for a body that is not the route's model, with pydantic's errors (loc under "body")."""
    errors = [{**e, "loc": ["body", *e["loc"]]} for e in exc.errors(include_url=False, include_context=False)]
    return RouteError(422, errors)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, read only while it stays within `max_bytes`.

    Raises:
        RouteError: 400 for a malformed Content-Length or a client that disconnected before the
            body ended; 413 (closing the connection) when the declared length, or the bytes
            received so far, pass `max_bytes`.
    """
    from starlette.requests import ClientDisconnect

    where = f"{request.method} {request.url.path}"
    declared = request.headers.get("content-length")
    if declared is not None and not (declared.isascii() and declared.isdigit()):
        raise RouteError(400, f"{where}: Content-Length {declared!r} is not a byte count", close=True)
    if declared is not None and int(declared) > max_bytes:
        raise RouteError(
            413, f"{where} takes at most {max_bytes} bytes of body; this one has {declared}", close=True
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RouteError(
                    413, f"{where} takes at most {max_bytes} bytes of body; this one has more", close=True
                )
            chunks.append(chunk)
    except ClientDisconnect:  # the sender left mid-body (or its Content-Length lied): nothing runs
        raise RouteError(
            400, f"{where}: the client disconnected after {size} bytes of body", close=True
        ) from None
    return b"".join(chunks)


Endpoint = Callable[["Request", bytes], Awaitable["Response"]]


class SignedRouter:
    """The agent's routes, each behind the signature check of `verifier` and a body cap.

    `serve(route)` registers a handler that takes the parsed body (or nothing) and returns a
    pydantic model; `raw(route, endpoint)` registers a Starlette endpoint that gets the request
    and its verified body (the hot routes, which parse by hand). A `Route`'s path is relative to
    `API_PREFIX`. `app(lifespan)` builds the Starlette application.
    """

    def __init__(self, verifier: Verifier, on_verified: Callable[[], None] | None = None) -> None:
        self.verifier = verifier
        self.on_verified = on_verified
        """Called after every verified request (the agent renews its controller lease)."""
        self.routes: list[StarletteRoute] = []

    async def _verified_body(self, request: Request, max_body_bytes: int, unbound: bool) -> bytes:
        """Check the signed headers, then read the capped body and hold it to its signed hash.

        Raises:
            RouteError: 401 naming why the signature was refused; 400/413 from `read_body`.
        """
        try:
            body_hash = self.verifier.verify_headers(
                request.method, request.url.path, request.headers, unbound
            )
        except AuthError as exc:
            raise RouteError(401, str(exc), close=True) from None
        body = await read_body(request, max_body_bytes)
        try:
            self.verifier.check_body(body_hash, body)
        except AuthError as exc:
            raise RouteError(401, str(exc)) from None
        if self.on_verified is not None and not unbound:  # the identity route changes nothing
            self.on_verified()
        return body

    def raw(self, route: Route[Any, Any], endpoint: Endpoint, unbound: bool = False) -> None:
        """Serve `route` with `endpoint(request, body)`, called with the verified body only (it
        parses the body itself: the hot routes); `RouteError` is answered. `unbound=True` (the
        identity route only) also accepts a request signed for no agent (see `auth`)."""
        max_body_bytes = route.max_body_bytes if route.method == "POST" else 0

        async def guarded(request: Request) -> Response:
            try:
                return await endpoint(request, await self._verified_body(request, max_body_bytes, unbound))
            except RouteError as exc:
                return _detail(exc.status, exc.detail, exc.close)

        from starlette.routing import Route as StarletteRoute

        self.routes.append(StarletteRoute(API_PREFIX + route.path, guarded, methods=[route.method]))

    def serve(self, route: Route[Any, Any]) -> Callable[[H], H]:
        """Decorator: serve `route` with the handler, which takes the body parsed as
        `route.request` (no argument when it is None: the body is then ignored once its
        signature is checked) and returns a `route.response`; a body over
        `route.max_body_bytes` is refused with 413, one that is not a `route.request` with 422."""

        def add(handler: H) -> H:
            body_model = route.request

            async def endpoint(request: Request, raw: bytes) -> Response:
                if body_model is None:
                    return json_reply(await handler())
                try:
                    parsed = body_model.model_validate_json(raw)
                except ValidationError as exc:
                    raise body_error(exc) from None
                return json_reply(await handler(parsed))

            self.raw(route, endpoint)
            return handler

        return add

    def app(self, lifespan: Callable[[Any], AbstractAsyncContextManager[None]] | None = None) -> Starlette:
        """The Starlette application serving every registered route."""
        from starlette.applications import Starlette

        return Starlette(routes=self.routes, lifespan=lifespan)
