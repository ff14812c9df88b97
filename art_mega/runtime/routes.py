"""The agent's HTTP routes on plain Starlette: signature check, pydantic body in, pydantic reply out.

Every route verifies the request's HMAC signature over the raw body first (see `auth`); a
refused request gets 401 `{"detail": reason}` and runs nothing. The body is then parsed into the
route's pydantic model (422 `{"detail": [errors]}` when it is not one), the handler runs, and its
pydantic reply is the JSON answer. A handler raises `RouteError` for another status
(`{"detail": ...}`, the shape FastAPI uses and `AgentClient` reads).

Why not FastAPI: the agent starts on every host of every launch, and importing FastAPI cost
~0.6 s of CPU per agent here (half the agent's start-up); its dependency and validation layers
also cost ~0.6 ms per request (benchmarks/RESULTS.md). The routes need none of its features.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from art_mega.runtime.auth import AuthError, Verifier
from art_mega.runtime.protocol import API_PREFIX

H = TypeVar("H", bound=Callable[..., Awaitable[Any]])


class RouteError(Exception):
    """Answer `status` with `{"detail": detail}` (e.g. 404 for an unknown worker)."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(str(detail))
        self.status = status
        self.detail = detail


def json_reply(model: BaseModel) -> Response:
    """A pydantic model as a 200 JSON response."""
    return Response(content=model.model_dump_json(), media_type="application/json")


def _detail(status: int, detail: Any) -> Response:
    return Response(json.dumps({"detail": detail}, default=str), status, media_type="application/json")


def body_error(exc: ValidationError) -> RouteError:
    """The 422 for a body that is not the route's model, with pydantic's errors (loc under "body")."""
    errors = [{**e, "loc": ["body", *e["loc"]]} for e in exc.errors(include_url=False, include_context=False)]
    return RouteError(422, errors)


class SignedRouter:
    """The agent's routes, each behind the signature check of `verifier`.

    `post(path, body_model)` / `get(path)` register a handler that takes the parsed body (or
    nothing) and returns a pydantic model; `raw(path, endpoint, methods)` registers a Starlette
    endpoint that calls `verified_body` itself (the hot routes, which parse by hand). Paths are
    relative to `API_PREFIX`. `app(lifespan)` builds the Starlette application.
    """

    def __init__(self, verifier: Verifier, on_verified: Callable[[], None] | None = None) -> None:
        self.verifier = verifier
        self.on_verified = on_verified
        """Called after every verified request (the agent renews its controller lease)."""
        self.routes: list[Route] = []

    async def verified_body(self, request: Request) -> bytes:
        """The request's raw body once its signature is verified.

        Raises:
            RouteError: 401 naming why the signature was refused.
        """
        body = await request.body()
        try:
            self.verifier.verify(request.method, request.url.path, dict(request.headers), body)
        except AuthError as exc:
            raise RouteError(401, str(exc)) from None
        if self.on_verified is not None:
            self.on_verified()
        return body

    def raw(
        self, path: str, endpoint: Callable[[Request], Awaitable[Response]], methods: Sequence[str]
    ) -> None:
        """Register `endpoint` as is (it must call `verified_body`); `RouteError` is answered."""

        async def guarded(request: Request) -> Response:
            try:
                return await endpoint(request)
            except RouteError as exc:
                return _detail(exc.status, exc.detail)

        self.routes.append(Route(API_PREFIX + path, guarded, methods=list(methods)))

    def _add(self, method: str, path: str, body_model: type[BaseModel] | None, handler: H) -> H:
        async def endpoint(request: Request) -> Response:
            raw = await self.verified_body(request)
            if body_model is None:
                return json_reply(await handler())
            try:
                parsed = body_model.model_validate_json(raw)
            except ValidationError as exc:
                raise body_error(exc) from None
            return json_reply(await handler(parsed))

        self.raw(path, endpoint, [method])
        return handler

    def post(self, path: str, body_model: type[BaseModel] | None = None) -> Callable[[H], H]:
        """Decorator: `POST path` runs the handler with the body parsed as `body_model` (None:
        the handler takes no argument and the body is ignored once its signature is checked)."""
        return lambda handler: self._add("POST", path, body_model, handler)

    def get(self, path: str) -> Callable[[H], H]:
        """Decorator: `GET path` runs the handler with no argument."""
        return lambda handler: self._add("GET", path, None, handler)

    def app(self, lifespan: Callable[[Any], AbstractAsyncContextManager[None]] | None = None) -> Starlette:
        """The Starlette application serving every registered route."""
        return Starlette(routes=self.routes, lifespan=lifespan)
