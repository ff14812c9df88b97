"""Rollouts for tests/integration/test_distributed_api.py and tests/unit/distributed/test_distributed_api.py:
where a call ran, and what a typed `TrainableModel[Policy]` looks like on the worker."""

import os

from pydantic import BaseModel

from art_mega import TrainableModel


class Policy(BaseModel):
    bonus_word: str = "yes"
    max_completion_tokens: int = 6


async def where() -> dict:
    """The pid of the worker process that ran the call."""
    return {"pid": os.getpid()}


async def policy_of(model: TrainableModel[Policy]) -> list:
    """The config's class name and a field as the worker sees them, and the model itself back."""
    return [type(model.config).__name__, model.config.bonus_word, model]


class Greeter:
    async def greet(self) -> str:
        return "hello"
