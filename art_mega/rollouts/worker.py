"""A rollout worker process: runs the user's async rollout functions for its agent.

It speaks newline-delimited JSON over an inherited socket (`--fd`), runs each request as an
asyncio task, and answers with the wire-encoded result or a `RemoteFailure` (a result `wire`
refuses is a user-kind failure naming the key path, never a serializer traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import traceback
from typing import Any

from art_mega.errors import UserError
from art_mega.rollouts import wire
from art_mega.rollouts.installed import InstalledAsyncCallable
from art_mega.rollouts.protocol import STREAM_LIMIT, CallableRef, RemoteFailure

MAX_CACHED_REFS = 1024
"""Distinct raw callable references whose validated `CallableRef` a worker keeps."""


class _ValueRefused(Exception):
    """A rollout's arguments or result that `wire` cannot carry: the controller raises a
    `RolloutValueError` naming the rollout, this host and the key path."""


def failure_from(exc: BaseException) -> RemoteFailure:
    """Describe an exception for the controller; `UserError` keeps its one sentence, and so does
    a value `wire` refused (`exc_type` "WireError", no traceback: the fault is in the value)."""
    if isinstance(exc, _ValueRefused):
        return RemoteFailure(kind="user", message=str(exc), exc_type=wire.WireError.__name__)
    if isinstance(exc, UserError):
        return RemoteFailure(kind="user", message=str(exc), exc_type=type(exc).__name__)
    return RemoteFailure(
        kind="error",
        message=f"{type(exc).__name__}: {exc}",
        exc_type=type(exc).__name__,
        traceback="".join(traceback.format_exception(exc)),
    )


class _Worker:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._cache: dict[CallableRef, Any] = {}
        self._refs: dict[tuple[tuple[Any, Any], ...], CallableRef] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _ref(self, raw: Any) -> CallableRef:
        """`CallableRef.model_validate(raw)`, cached by the raw (key, value) pairs."""
        try:
            key = tuple(raw.items())
            ref = self._refs.get(key)
        except (AttributeError, TypeError):  # not a dict, or unhashable values: let pydantic say why
            return CallableRef.model_validate(raw)
        if ref is None:
            ref = CallableRef.model_validate(raw)
            if len(self._refs) < MAX_CACHED_REFS:
                self._refs[key] = ref
        return ref

    def _load(self, ref: CallableRef) -> Any:
        fn = self._cache.get(ref)
        if fn is None:
            fn = InstalledAsyncCallable.from_ref(ref).load()
            self._cache[ref] = fn
        return fn

    def _send(self, message: dict[str, Any]) -> None:
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def _run(self, request_id: int, message: dict[str, Any]) -> None:
        try:
            fn = self._load(self._ref(message["callable"]))
            try:
                args = wire.decode(message.get("args", []), "args")
                kwargs = wire.decode(message.get("kwargs", {}), "kwargs")
            except wire.WireError as exc:
                raise _ValueRefused(f"could not rebuild its arguments on this host: {exc}") from None
            result = await fn(*args, **kwargs)
            try:
                encoded = wire.encode(result)
            except wire.WireError as exc:
                raise _ValueRefused(f"returned a value that cannot travel: {exc}") from None
            reply = {"id": request_id, "ok": True, "result": encoded}
        except Exception as exc:
            reply = {"id": request_id, "ok": False, "failure": failure_from(exc).model_dump()}
        self._send(reply)
        await self._writer.drain()

    def hello(self, refs: list[CallableRef]) -> dict[str, Any]:
        for ref in refs:
            try:
                self._load(ref)
            except Exception as exc:
                return {"op": "hello", "pid": os.getpid(), "failure": failure_from(exc).model_dump()}
        return {"op": "hello", "pid": os.getpid()}

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while True:
            line = await reader.readline()
            if not line:
                return
            message = json.loads(line)
            if message.get("op") == "hello":
                refs = [CallableRef.model_validate(r) for r in message.get("callables", [])]
                self._send(self.hello(refs))
                await self._writer.drain()
                continue
            task = asyncio.create_task(self._run(int(message["id"]), message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def _main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_connection(sock=sock, limit=STREAM_LIMIT)
    await _Worker(writer).serve(reader)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="art-mega rollout worker")
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    extra = [p for p in os.environ.get("ART_MEGA_SYS_PATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    asyncio.run(_main(args.fd))


if __name__ == "__main__":
    main()
