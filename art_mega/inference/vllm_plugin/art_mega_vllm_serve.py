"""art-mega's ASGI middleware for a replica's vLLM OpenAI server: every completion it serves is
trainable, whoever asked for it, and names resolve to the served policy.

Loaded by vLLM's own `--middleware art_mega_vllm_serve.TrainableCompletions` (added to every
replica's argv by `art_mega.inference.replica.vllm_argv`; this directory is on the replica's
PYTHONPATH). It runs inside vLLM's interpreter, which has vllm but not art_mega, so it imports
only the standard library at module level and vLLM's request models inside functions.

For each `POST /v1/chat/completions` and `POST /v1/completions` (streamed or not) it:

1. **Resolves the model name** (vLLM's served names are `--served-model-name NAME [BASE]`, the
   adapters `NAME@<step>`): a request without `model`, or for NAME itself, goes to the highest
   step `NAME@<step>` this replica has loaded (the base model while it has none); `NAME@<step>`
   and BASE (the base model's own name, e.g. "Qwen/Qwen2.5-7B-Instruct") as they are. Any other
   name is answered 404 in vLLM's error shape, naming the model asked for and every name served.
   Why the highest loaded step: the adapter publisher (`art_mega.inference.adapters`) loads a
   step on every replica before it advances the served step and unloads only older steps, so
   once a publication returns, every replica's highest loaded step is the served step (exact
   whenever the publisher has finished, with no extra call to forget after a restart: a
   restarted replica gets the window back, oldest first, before it takes traffic again). While a
   publication runs, a replica that already loaded the new step serves it under NAME; the
   choice's `policy_step` says so.
2. **Asks vLLM for what training needs** unless the request already did: `return_token_ids`
   (the prompt's and each choice's token ids) and logprobs of the sampled tokens (chat:
   `logprobs=True`; completions: `logprobs=0`), as ART's server does (its request defaults are
   `logprobs=True, top_logprobs=0, return_token_ids=True`). A client that did not ask still gets
   the response shape it expects: these are OpenAI's own `logprobs` and extra fields, which the
   openai SDK's pydantic types, LiteLLM and LangChain keep or ignore.
3. **Tags every choice** of the reply (each event's choices when streamed) with
   `policy_step` (`POLICY_STEP_FIELD`: the step of the adapter that served it, null for the base
   model; absent for an adapter that is not NAME@<step>), `art_mega_sampling` (`SAMPLING_FIELD`:
   `sampling_record`'s effective sampling settings) and, for chat, the reply's
   `prompt_token_ids` (vLLM puts them on the reply; training reads them from the choice).

Requests this module cannot read (not JSON, not an object) pass through untouched, and vLLM
answers them as it would. Field names here must equal art_mega's
(`art_mega.trajectories.POLICY_STEP_FIELD`, `SAMPLING_FIELD`; tests/inference/test_units.py
checks).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

POLICY_STEP_FIELD = "policy_step"
SAMPLING_FIELD = "art_mega_sampling"
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
"""The paths this middleware changes, and which of vLLM's request models each takes."""
_TRANSFER_ARGS = ("kv_transfer_params", "ec_transfer_params")
"""`SamplingParams.extra_args` keys vLLM itself sets (disaggregated serving), not a request's
logits processor arguments."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def adapter_step(name: str, served: str) -> int | None:
    """The step of adapter `name` when it is `<served>@<step>` (a non-negative integer), else None."""
    prefix = f"{served}@"
    tail = name[len(prefix) :] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def resolve_model(asked: Any, base_names: list[str], adapters: list[str]) -> tuple[str, dict[str, Any]] | None:
    """(the model name vLLM gets, the choice tags it implies) for a request's `model` field
    `asked`, or None when this replica serves no such name.

    `base_names` are vLLM's served names (the first is art-mega's NAME), `adapters` the loaded
    LoRA names. The tags hold `policy_step` except for an adapter that is not NAME@<step>."""
    served = base_names[0]
    steps = {step: name for name in adapters if (step := adapter_step(name, served)) is not None}
    if asked is None or asked == served:
        if not steps:
            return served, {POLICY_STEP_FIELD: None}
        latest = max(steps)
        return steps[latest], {POLICY_STEP_FIELD: latest}
    if not isinstance(asked, str):
        return None
    if asked in base_names:
        return asked, {POLICY_STEP_FIELD: None}
    if asked in adapters:
        step = adapter_step(asked, served)
        return asked, {} if step is None else {POLICY_STEP_FIELD: step}
    return None


def not_served(asked: Any, base_names: list[str], adapters: list[str]) -> str:
    """The 404 sentence for a request of model `asked` that this replica does not serve."""
    served = base_names[0]
    steps = sorted(step for name in adapters if (step := adapter_step(name, served)) is not None)
    latest = f"now `{served}@{steps[-1]}`" if steps else "now the base model"
    names = [f"`{served}` (the latest step, {latest})"]
    names += [f"`{served}@{step}`" for step in steps]
    names += [f"`{name}`" for name in adapters if adapter_step(name, served) is None]
    names += [f"`{name}` (the base model)" for name in base_names[1:]]
    return f"The model `{asked}` does not exist on this replica; it serves {', '.join(names)}."


def training_defaults(kind: str, request: dict[str, Any]) -> None:
    """Ask vLLM, in `request` (a chat or completions body, changed in place), for the prompt and
    completion token ids and the sampled tokens' logprobs, where the request did not already.
    An explicit `logprobs: false` (chat) is turned on too: every served choice is trainable."""
    request["return_token_ids"] = True
    if kind == "chat":
        if not request.get("logprobs"):
            request["logprobs"] = True
    elif request.get("logprobs") is None:
        request["logprobs"] = 0


def sampling_record(kind: str, request: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any] | None:
    """The sampling settings vLLM draws `request`'s tokens with: vLLM's own
    `to_sampling_params` of the request (request values, else the server's `defaults`,
    `default_sampling_params`: the model's generation config unless `--generation-config vllm`,
    else OpenAI's defaults; temperature 0 makes it greedy: top_p 1, top_k 0, min_p 0), as

        {"temperature": float, "top_p": float, "top_k": int (0 or -1: off),
         "min_p": float, "constrained": bool, "processed": bool}

    `constrained`: something masks the logits (structured outputs: a JSON schema or object, a
    regex, a choice, a grammar, a structural tag, or `tool_choice` "required" or a named
    function). `processed`: something else changes the distribution (repetition, presence or
    frequency penalties, `logit_bias`, `bad_words`, `allowed_token_ids`, `min_tokens` > 0, a
    thinking token budget, or `vllm_xargs` for logits processors). None when vLLM's request
    model refuses the request (vLLM then answers it with its own 400).
    """
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model  # type: ignore[assignment]
    try:
        parsed = Model.model_validate(request)
        limit = parsed.max_tokens if kind == "completion" else parsed.max_completion_tokens or parsed.max_tokens
        params = parsed.to_sampling_params(max(limit or 1, parsed.min_tokens or 0, 1), defaults)
    except Exception:  # vLLM refuses the request itself, with its own message
        return None
    tool_choice = request.get("tool_choice") if request.get("tools") else None
    processors = {k: v for k, v in (params.extra_args or {}).items() if k not in _TRANSFER_ARGS}
    return {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "min_p": float(params.min_p),
        "constrained": params.structured_outputs is not None
        or tool_choice == "required"
        or isinstance(tool_choice, dict),
        "processed": params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or bool(params.logit_bias)
        or bool(params.bad_words)
        or bool(params.allowed_token_ids)
        or (params.min_tokens or 0) > 0
        or params.thinking_token_budget is not None
        or bool(processors),
    }


def tag_reply(reply: Any, tags: dict[str, Any]) -> None:
    """Set `tags` on every choice of `reply` (a decoded completion or stream chunk, changed in
    place), and the reply's `prompt_token_ids` on each chat choice that lacks them."""
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
        return
    prompt = reply.get("prompt_token_ids")
    for choice in reply["choices"]:
        if isinstance(choice, dict):
            choice.update(tags)
            if prompt is not None and choice.get("prompt_token_ids") is None:
                choice["prompt_token_ids"] = prompt


def _dumps(value: Any) -> bytes:
    # as Starlette's JSONResponse renders vLLM's replies
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def tag_events(data: bytes, tags: dict[str, Any]) -> bytes:
    """Server-sent events `data` (whole events, each ending in a blank line) with `tags` set on
    every choice of each `data: {...}` event (`tag_reply`); other lines as they were."""
    lines = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            try:
                event = json.loads(line[6:])
            except ValueError:
                event = None
            if isinstance(event, dict):
                tag_reply(event, tags)
                line = b"data: " + _dumps(event)
        lines.append(line)
    return b"\n".join(lines)


class TrainableCompletions:
    """The ASGI middleware (see the module docstring); vLLM constructs it with its app."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay(b"", receive, message), send)
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            await self.app(scope, _replay(body, receive), send)
            return
        state = scope["app"].state
        models = state.openai_serving_models
        base_names = [path.name for path in models.base_model_paths]
        adapters = list(models.lora_requests)
        resolved = resolve_model(request.get("model"), base_names, adapters)
        if resolved is None:
            await _not_found(send, not_served(request.get("model"), base_names, adapters))
            return
        request["model"], tags = resolved
        training_defaults(kind, request)
        serving = getattr(state, "openai_serving_chat" if kind == "chat" else "openai_serving_completion", None)
        sampling = sampling_record(kind, request, dict(getattr(serving, "default_sampling_params", None) or {}))
        if sampling is not None:
            tags[SAMPLING_FIELD] = sampling
        body = json.dumps(request, ensure_ascii=False).encode()  # a NaN stays for vLLM to refuse
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), _TaggingSend(send, tags))


def _replay(body: bytes, receive: Receive, first: Message | None = None) -> Receive:
    """A `receive` that gives `first` (default: `body` as the whole request) once, then the
    client's own `receive`: vLLM listens there for the client's disconnect while it generates
    (`with_cancellation`), which must come only when the client does go away."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first if first is not None else {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _not_found(send: Send, message: str) -> None:
    body = _dumps({"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 404, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _TaggingSend:
    """The `send` of one request: a 200 JSON reply is held whole and tagged (`tag_reply`), a
    stream's events are tagged as they complete (`tag_events`); anything else passes as is."""

    def __init__(self, send: Send, tags: dict[str, Any]) -> None:
        self.send, self.tags = send, tags
        self.mode = "pass"
        self.start: Message | None = None
        self.held = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            kind = dict(message.get("headers", [])).get(b"content-type", b"")
            if message.get("status") == 200 and kind.startswith(b"application/json"):
                self.mode, self.start = "json", message
                return
            if message.get("status") == 200 and kind.startswith(b"text/event-stream"):
                self.mode = "events"
            await self.send(message)
            return
        if message["type"] != "http.response.body" or self.mode == "pass":
            await self.send(message)
            return
        self.held += message.get("body", b"")
        more = message.get("more_body", False)
        if self.mode == "events":
            done, _, self.held = self.held.rpartition(b"\n\n") if more else (self.held, b"", b"")
            if done or not more:
                body = tag_events(done + (b"\n\n" if more else b""), self.tags)
                await self.send({"type": "http.response.body", "body": body, "more_body": more})
            return
        if more:
            return
        try:
            reply = json.loads(self.held)
            tag_reply(reply, self.tags)
            body = _dumps(reply)
        except ValueError:
            body = self.held
        assert self.start is not None
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        await self.send({**self.start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
