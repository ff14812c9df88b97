"""Rollout functions the integration tests run on real worker processes."""

import asyncio
import os
import socket

from art_mega import Trajectory


async def echo(value):
    return value


async def where() -> dict:
    return {"pid": os.getpid(), "hostname": socket.gethostname()}


async def answer(text: str, reward: float) -> Trajectory:
    return Trajectory(
        messages_and_choices=[{"role": "assistant", "content": text}],
        reward=reward,
        metadata={"pid": os.getpid()},
    )


async def fail(message: str):
    raise ValueError(message)


async def sleep(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds
