"""ART's `art.utils.limit_concurrency`: at most `n` concurrent calls of an async function."""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from art_mega.errors import HyperParameterError
from art_mega.hyperparams import check, whole_problem

F = TypeVar("F", bound=Callable[..., Any])


def limit_concurrency(n: int, derive_key: Callable[..., str] | None = None) -> Callable[[F], F]:
    """A decorator for an async function: at most `n` of its calls run at once per key.

    `derive_key(*args, **kwargs)` names the key of a call (None: one key for every call), so
    e.g. each opponent's calls are limited apart. The limit holds within one event loop (a
    semaphore per loop and key, as a semaphore belongs to one loop; ART keeps one per key).

    Raises:
        HyperParameterError: `n` is not a whole number >= 1, `derive_key` is not callable or
            None, or the decorated function is not a coroutine function.
    """
    check("limit_concurrency", "n", n, whole_problem(1), "4")
    if derive_key is not None and not callable(derive_key):
        raise HyperParameterError(
            f"limit_concurrency(derive_key={derive_key!r}) must be a function of the call's arguments or None",
            "derive_key",
            derive_key,
        )
    semaphores: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, asyncio.Semaphore]] = (
        weakref.WeakKeyDictionary()
    )

    def decorator(func: F) -> F:
        if not inspect.iscoroutinefunction(func):
            raise HyperParameterError(
                f"limit_concurrency decorates async functions; {getattr(func, '__name__', func)!r} is not one",
                "func",
                func,
            )

        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = derive_key(*args, **kwargs) if derive_key is not None else "default"
            per_key = semaphores.setdefault(asyncio.get_running_loop(), {})
            semaphore = per_key.setdefault(key, asyncio.Semaphore(n))
            async with semaphore:
                return await func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorator
