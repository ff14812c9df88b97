"""ART's `auto_trajectory` / `capture_auto_trajectory` and ART 0.5.23's names for them
(`trajectory`, `current_trajectory`, `trajectory_group`, `no_capture`): build a rollout's
trajectory from the chat completions its code makes, without the code building one. Each
captured completion is also kept as `Trajectory.exchanges.chat_completions` (request, reply).

While `capture_auto_trajectory(coroutine)` runs, every chat completion answered over httpx or
httpx2 (the OpenAI SDK's transports, so `model.openai_client()` and any `openai.AsyncOpenAI`) in its task
appends the request's new messages and the first sampled `Choice` to the trajectory: to its main
conversation when the request continues it (same messages so far, same tools), else to the
`additional_histories` entry it continues, else to a new one (ART's rule). the Response classes are
hooked once, at the first capture (not at import); outside a capture the hook only checks a context variable.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Awaitable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from art_mega.errors import CompletionReplyError, UserError
from art_mega.inference.replies import is_chat_completions_path, reply_problem
from art_mega.trajectories import History, PydanticException, Trajectory, TrajectoryGroup


class _Capture:
    """One `capture_auto_trajectory` call: its trajectory, the streamed replies it saw and the
    answered (2xx) replies it could not read as a chat completion."""

    def __init__(self) -> None:
        self.trajectory = Trajectory()
        self.streamed = 0
        self.unreadable: list[CompletionReplyError] = []

    def add(self, request_body: bytes, response_body: bytes, status: int, url: str) -> None:
        """Record one finished httpx exchange (`status`, to `url`) if it is a chat completion
        (a POST body with a messages list to a path ending in /chat/completions; else nothing,
        as ART skips what it cannot read); an answered one that does not read as a chat
        completion is noted in `unreadable`."""
        from openai.types.chat.chat_completion import ChatCompletion, Choice
        from pydantic import ValidationError

        try:
            request = json.loads(request_body)
        except (ValueError, TypeError):
            return
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            return  # not a chat completion request
        if not is_chat_completions_path(urlsplit(url).path):
            return  # another API with a messages list (Anthropic's /v1/messages, Ollama's /api/chat)
        if request.get("stream"):
            self.streamed += 1
            return
        if not 200 <= status < 300:
            return  # an error reply: the SDK raises it to the rollout
        try:
            data = json.loads(response_body)
        except ValueError:
            data = response_body.decode(errors="replace")
        # construct: the SDK's own unvalidated build, whose fields reply_problem checks
        problem = reply_problem(ChatCompletion.construct(**data) if isinstance(data, dict) else data)
        if problem is None:
            try:
                choice = Choice.model_validate(data["choices"][0])
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                problem = f"choices[0] that is not an OpenAI Choice ({where}: {first['msg']})"
        if problem is not None:
            self.unreadable.append(CompletionReplyError(f"server {url}", str(request.get("model")), problem))
            return
        from art_mega.trajectories import ChatCompletionsExchange

        response = ChatCompletion.construct(**data)
        response.choices = [Choice.model_validate(c) for c in data.get("choices") or []]
        self.trajectory.exchanges.chat_completions.append(
            ChatCompletionsExchange(request=request, response=response)
        )
        messages, tools = request["messages"], request.get("tools")
        history: Trajectory | History = self.trajectory
        seen = history.messages()
        if not (
            seen == messages[: len(seen)] and (history.tools == tools or (not seen and history.tools is None))
        ):
            for history in self.trajectory.additional_histories:
                seen = history.messages()
                if seen == messages[: len(seen)] and history.tools == tools:
                    break
            else:
                history = History(messages_and_choices=[], tools=tools)
                self.trajectory.additional_histories.append(history)
        history.messages_and_choices.extend(messages[len(history.messages_and_choices) :])
        history.messages_and_choices.append(choice)
        history.tools = tools


_CURRENT: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("auto_trajectory", default=None)
_HOOKED = False


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory the enclosing `capture_auto_trajectory` is building (to set its reward or
    metrics from inside the rollout); None outside one.

    Raises:
        RuntimeError: `required=True` outside `capture_auto_trajectory(...)`.
    """
    capture = _CURRENT.get()
    if capture is None and required:
        raise RuntimeError(
            "No auto trajectory in context: auto_trajectory(required=True) must run inside "
            "art.capture_auto_trajectory(...)"
        )
    return None if capture is None else capture.trajectory


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Await `coroutine` and return the trajectory of the chat completions it made (its return
    value is discarded, as in ART), finished (`metrics["duration"]`).

    Raises:
        UserError: the coroutine streamed a chat completion (`stream=True`), which art-mega does
            not rebuild into a Choice; request it without streaming.
        CompletionReplyError: a chat completion was answered (2xx) with a body that is not one
            (no choices, a choice without its message, ...): its turn would be missing.
        What the coroutine raises.
    """
    _hook_httpx()
    capture = _Capture()
    token = _CURRENT.set(capture)
    try:
        await coroutine
    finally:
        _CURRENT.reset(token)
        capture.trajectory.finish()
    if capture.streamed:
        raise UserError(
            f"capture_auto_trajectory saw {capture.streamed} streamed chat completion(s) (stream=True), "
            "which it does not capture; call chat.completions.create without stream=True inside it"
        )
    if capture.unreadable:
        raise capture.unreadable[0]
    return capture.trajectory


async def trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """ART 0.5.23's `art.trajectory(coroutine)`: `capture_auto_trajectory` of a raw coroutine.

    Raises:
        TypeError: `coroutine` is a Task, Future or other awaitable (ART's check: a task would
            run outside the capture's context); and what `capture_auto_trajectory` raises.
    """
    if isinstance(coroutine, asyncio.Future) or not isinstance(coroutine, Coroutine):
        raise TypeError(
            f"art.trajectory() takes a raw coroutine (e.g. art.trajectory(rollout(model, scenario))), "
            f"not a {type(coroutine).__name__}"
        )
    return await capture_auto_trajectory(coroutine)


def current_trajectory(*, require: bool = False) -> Trajectory | None:
    """ART 0.5.23's `art.current_trajectory(require=)`: `auto_trajectory(required=require)`."""
    return auto_trajectory(required=require)


@contextmanager
def no_capture() -> Iterator[None]:
    """ART 0.5.23's `with art.no_capture():` completions made inside are not recorded by the
    enclosing capture (a capture started inside records its own)."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


async def trajectory_group(
    trajectories: Iterable[Trajectory | BaseException | Awaitable[Trajectory]],
    *,
    exceptions: Iterable[BaseException | PydanticException] = (),
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    logs: list[str] | None = None,
    return_exceptions: bool = False,
) -> TrajectoryGroup:
    """ART 0.5.23's `await art.trajectory_group(items, ...)`: a `TrajectoryGroup` of the given
    trajectories and of the awaitables' results (run concurrently, outside any enclosing
    capture; the same awaitable listed twice runs once), in input order.

    Raises:
        The first exception an awaitable raised, unless `return_exceptions=True` (then it is
        one of the group's `exceptions`, as an exception given in `trajectories` is); a
        BaseException that is not an Exception (cancellation, KeyboardInterrupt) always.
    """
    with no_capture():
        items, exceptions = list(trajectories), list(exceptions)
        for item in [*items, *exceptions]:
            if isinstance(item, BaseException) and not isinstance(item, Exception):
                raise item
        tasks: dict[int, asyncio.Future[Any]] = {}
        for item in items:
            if not isinstance(item, (Trajectory, BaseException)) and id(item) not in tasks:
                tasks[id(item)] = asyncio.ensure_future(item)
        if tasks:
            await asyncio.wait(tasks.values())
        results: list[Any] = []
        for item in items:
            if isinstance(item, (Trajectory, BaseException)):
                results.append(item)
                continue
            error = tasks[id(item)].exception()
            if error is not None and (not return_exceptions or not isinstance(error, Exception)):
                raise error
            results.append(error if error is not None else tasks[id(item)].result())
    return TrajectoryGroup(results, exceptions=exceptions, metadata=metadata, metrics=metrics, logs=logs)


def _hook_httpx() -> None:
    """Hook the Response class of httpx and of httpx2 (the OpenAI SDK's transport since 3.x),
    whichever are installed, once per process (see `_hook_response`)."""
    global _HOOKED
    if _HOOKED:
        return
    import importlib

    for name in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        _hook_response(module.Response)
    _HOOKED = True


def _hook_response(response: Any) -> None:
    """Wrap `response`'s byte iterators (to keep the body read so far while a capture runs) and
    close/aclose (to hand the finished exchange to the capture)."""
    iter_bytes, aiter_bytes = response.iter_bytes, response.aiter_bytes
    close, aclose = response.close, response.aclose

    def kept(self: Any, chunk: bytes) -> None:
        if _CURRENT.get() is not None:
            self.__dict__["_art_mega_body"] = self.__dict__.get("_art_mega_body", b"") + chunk

    def hooked_iter_bytes(self: Any, chunk_size: int | None = None) -> Any:
        for chunk in iter_bytes(self, chunk_size):
            kept(self, chunk)
            yield chunk

    async def hooked_aiter_bytes(self: Any, chunk_size: int | None = None) -> Any:
        async for chunk in aiter_bytes(self, chunk_size):
            kept(self, chunk)
            yield chunk

    def handed(self: Any) -> None:
        capture = _CURRENT.get()
        body = self.__dict__.pop("_art_mega_body", b"")
        if capture is not None and body:
            capture.add(self.request.content, body, self.status_code, str(self.request.url))

    def hooked_close(self: Any) -> None:
        close(self)
        handed(self)

    async def hooked_aclose(self: Any) -> None:
        await aclose(self)
        handed(self)

    response.iter_bytes = hooked_iter_bytes
    response.aiter_bytes = hooked_aiter_bytes
    response.close = hooked_close
    response.aclose = hooked_aclose
