"""ART's `art.retry` (`art.utils.retry`): retry a sync or async function with exponential backoff."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from art_mega.errors import HyperParameterError
from art_mega.hyperparams import check, nonnegative_problem, whole_problem

F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger(__name__)


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] | type[BaseException] = (Exception,),
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> Callable[[F], F]:
    """A decorator that calls the function up to `max_attempts` times, as ART's does.

    A call that raises one of `exceptions` (a tuple of exception classes, or one class: ART's
    `except exceptions` takes either, and its 2048 notebook passes `exceptions=(requests.ReadTimeout)`,
    which is the class itself) is retried after `delay` seconds, the wait growing by
    `backoff_factor` after each retry; the last attempt's exception is raised as is. Before each
    retry `on_retry(exception, attempt)` is called (attempt counts from 1), or a warning logged.
    Coroutine functions are awaited and wait with `asyncio.sleep`; others with `time.sleep`.

    Raises:
        HyperParameterError: `max_attempts` not a whole number >= 1, `delay` or
            `backoff_factor` not a finite number >= 0, `exceptions` neither an exception class
            nor a tuple of them, or `on_retry` not callable (when the decorator is made, not when it runs).
    """
    check("retry", "max_attempts", max_attempts, whole_problem(1), "3")
    check("retry", "delay", delay, nonnegative_problem, "0.25")
    check("retry", "backoff_factor", backoff_factor, nonnegative_problem, "2.0")
    if isinstance(exceptions, type) and issubclass(exceptions, BaseException):
        exceptions = (exceptions,)
    if not isinstance(exceptions, tuple) or not all(
        isinstance(e, type) and issubclass(e, BaseException) for e in exceptions
    ):
        raise HyperParameterError(
            f"retry(exceptions={exceptions!r}) must be an exception class or a tuple of them, "
            "e.g. exceptions=(TimeoutError, ValueError)",
            "exceptions",
            exceptions,
        )
    if on_retry is not None and not callable(on_retry):
        raise HyperParameterError(
            f"retry(on_retry={on_retry!r}) must be a function (exception, attempt) or None",
            "on_retry",
            on_retry,
        )

    def before_retry(func: Callable[..., Any], exc: BaseException, attempt: int) -> float:
        if on_retry is not None:
            on_retry(exc, attempt)
        else:
            logger.warning("Retry %d/%d for %s after error: %s", attempt, max_attempts, func.__name__, exc)
        return float(delay) * float(backoff_factor) ** (attempt - 1)

    def decorator(func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await func(*args, **kwargs)
                    except exceptions as exc:
                        if attempt == max_attempts:
                            raise
                        await asyncio.sleep(before_retry(func, exc, attempt))
                raise AssertionError("unreachable: the last attempt returns or raises")

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(1, max_attempts + 1):
                try:
                    return func(*args, **kwargs)
                except exceptions as exc:
                    if attempt == max_attempts:
                        raise
                    time.sleep(before_retry(func, exc, attempt))
            raise AssertionError("unreachable: the last attempt returns or raises")

        return sync_wrapper  # type: ignore[return-value]

    return decorator
