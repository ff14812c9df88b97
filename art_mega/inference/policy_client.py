"""The OpenAI client rollouts use: each request goes to a replica that is up, moves to another
when its replica refuses the connection, each choice is tagged with the policy step that served
it, and a failed request names its replica.
"""

from __future__ import annotations

import contextvars
from typing import Any

from art_mega.errors import ReplicaRequestError
from art_mega.inference.fleet import affinity_key
from art_mega.inference.replies import checked_reply
from art_mega.inference.router import PolicyRouter, ReplicaEndpoint
from art_mega.trainer.behaviour import tag_request_sampling
from art_mega.trajectories import POLICY_STEP_FIELD

AFFINITY_HEADER = "x-art-mega-affinity"
"""The request header that carries a request's affinity key from `policy_client` to
`FailoverTransport` (which removes it before the request leaves)."""
_SERVED_BY = contextvars.ContextVar[dict[str, ReplicaEndpoint] | None]("art_mega_served_by", default=None)
"""Where `FailoverTransport` last sent the current request (key "replica"), for `policy_client`."""
MAX_CONNECTIONS, MAX_KEEPALIVE = 1000, 100
"""The openai SDK's own connection limits (`openai._constants.DEFAULT_CONNECTION_LIMITS`)."""


def served_step(router: PolicyRouter, served_model: str) -> int | None:
    """The step in a reply's `model` field (`<name>@<step>`, as vLLM names the adapter that
    answered); None for the base model or another name."""
    prefix = f"{router.model_name}@"
    if served_model.startswith(prefix) and served_model[len(prefix) :].isdigit():
        return int(served_model[len(prefix) :])
    return None


def tag_choices(router: PolicyRouter, reply: Any) -> Any:
    """Set `policy_step` (see `art_mega.trajectories.POLICY_STEP_FIELD`) on every choice of a
    (non-streamed) completion reply that its server did not tag (art-mega's replicas tag every
    choice: `vllm_plugin/art_mega_vllm_serve.py`), from the reply's own `model` field: the
    server's word on which adapter produced it, not the router's guess (both read the same
    adapter name, so they never disagree). Where the reply has the prompt's token ids
    (`return_token_ids`), each choice without them also keeps them as `prompt_token_ids`:
    training then trains the choice after exactly the prompt vLLM tokenized (`trainer.prepare.tokenize`).
    Returns `reply`."""
    step = served_step(router, str(getattr(reply, "model", "")))
    prompt = getattr(reply, "prompt_token_ids", None)
    for choice in getattr(reply, "choices", None) or ():
        extra = getattr(choice, "model_extra", None) or {}
        if POLICY_STEP_FIELD not in extra:
            setattr(choice, POLICY_STEP_FIELD, step)
        if prompt is not None and extra.get("prompt_token_ids") is None:
            choice.prompt_token_ids = list(prompt)
    return reply


def openai_httpx() -> Any:
    """The httpx module the installed openai SDK sends with (`httpx`, or `httpx2` in openai 3.x):
    the module of its default client's base class."""
    import importlib

    import openai

    return importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])


class FailoverTransport:
    """An httpx transport (`httpx.AsyncBaseTransport`'s interface) that sends each request of
    `policy_client` to the replica its URL names, and, when that replica refuses the connection
    or resets it before any byte of the response (`httpx.ConnectError`, `ReadError`,
    `WriteError`: the request reached no server process, e.g. the replica was killed; a reset
    means the request's bytes met a socket no process reads), marks it down at once and sends
    the same request to another replica that is up (`PolicyRouter.fail_over`: the affinity key,
    from the `AFFINITY_HEADER`, moves with it; the move is logged). A connection the replica
    closed without an answer (`httpx.RemoteProtocolError`: it had read the request and died
    while working on it, or closed a keep-alive connection as it was reused) is not sent again:
    the request fails and names the replica (`ReplicaRequestError`), as before. With no other
    replica up, the error is raised as it came. `inner` (default: an `httpx.AsyncHTTPTransport`
    with the openai SDK's connection limits) sends the requests. httpx here is the openai SDK's
    (`openai_httpx`).
    """

    def __init__(self, router: PolicyRouter, inner: Any = None) -> None:
        httpx = openai_httpx()
        self.router = router
        self.inner = inner or httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE)
        )

    async def handle_async_request(self, request: Any) -> Any:
        httpx = openai_httpx()
        key = request.headers.pop(AFFINITY_HEADER, None)
        while True:
            replica = self.router.replica_at(str(request.url))
            served_by = _SERVED_BY.get()
            if served_by is not None and replica is not None:
                served_by["replica"] = replica
            try:
                return await self.inner.handle_async_request(request)
            except (httpx.ConnectError, httpx.ReadError, httpx.WriteError) as exc:
                if replica is None or not [r for r in self.router.up() if r.name != replica.name]:
                    raise
                route = self.router.fail_over(replica.name, f"{type(exc).__name__}: {exc}", key)
                where = httpx.URL(route.url)
                request.url = request.url.copy_with(scheme=where.scheme, host=where.host, port=where.port)
                request.headers["host"] = where.netloc.decode()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> FailoverTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def policy_client(router: PolicyRouter, training_defaults: bool = True, **kwargs: Any) -> Any:
    """An `openai.AsyncOpenAI` over `router`'s replicas (`kwargs` go to its constructor; an
    `http_client` given there replaces the `FailoverTransport`, and with it the failover).

    `chat.completions.create` and `completions.create` pick a replica per request
    (`router.route(inference.fleet.affinity_key(options))`: the replica already holding the
    request's prompt prefix, else the least-loaded one that is up), count it in flight
    there until it is answered, send it elsewhere when its replica refuses the connection
    (`FailoverTransport`), tag each choice of a
    non-streamed reply with its policy step (`tag_choices`) once it reads as a completion
    (`inference.replies.checked_reply`), and turn an `openai.APIError` into
    `ReplicaRequestError` naming the replica. With `training_defaults`, chat completions
    ask for `logprobs=True` and `extra_body={"return_token_ids": True}` unless the caller says
    otherwise (training then never re-tokenizes sampled text).

    Raises (from `create`): `NoReplicaUpError` when every replica is down, `ReplicaRequestError`,
    `CompletionReplyError` when a replica answers without choices, or a choice without its
    message (chat) or text (completions).
    """
    import openai

    if "http_client" not in kwargs:
        kwargs["http_client"] = openai.DefaultAsyncHttpxClient(transport=FailoverTransport(router))  # type: ignore[arg-type]
    client = openai.AsyncOpenAI(base_url=f"{router.replicas[0].url}/v1", **{"api_key": "art-mega", **kwargs})

    def routed(pick: Any, chat: bool) -> Any:
        async def create(*args: Any, **options: Any) -> Any:
            if chat and training_defaults:
                options.setdefault("logprobs", True)
                extra = dict(options.get("extra_body") or {})
                extra.setdefault("return_token_ids", True)
                options["extra_body"] = extra
            key = affinity_key(options)
            route = router.route(key)
            if key is not None:
                options["extra_headers"] = {**(options.get("extra_headers") or {}), AFFINITY_HEADER: key}
            target = pick(client.with_options(base_url=route.base_url))
            served_by = {"replica": router.endpoint(route.replica)}
            token = _SERVED_BY.set(served_by)
            try:
                with router.load.request(route.replica):
                    reply = await target.create(*args, **options)
            except openai.APIError as exc:
                where = served_by["replica"]  # where the request went last (it may have moved)
                raise ReplicaRequestError(where.name, where.url, route.model, exc) from exc
            finally:
                _SERVED_BY.reset(token)
            if options.get("stream"):
                return reply
            where = served_by["replica"]
            server = f"replica {where.name} ({where.url})"
            reply = tag_choices(router, checked_reply(reply, server, str(options.get("model")), chat))
            return tag_request_sampling(reply, options) if chat else reply

        return create

    client.chat.completions.create = routed(lambda c: c.chat.completions, chat=True)  # type: ignore[method-assign]
    client.completions.create = routed(lambda c: c.completions, chat=False)  # type: ignore[method-assign]
    return client
