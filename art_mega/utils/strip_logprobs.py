"""ART's `art.utils.strip_logprobs` (the official 2048 notebook imports it): a copy of nested
data without its logprobs, to keep what a program stores small."""

from __future__ import annotations

import copy
import logging
from typing import Any

log = logging.getLogger(__name__)


def strip_logprobs(obj: Any) -> Any:
    """A deep copy of `obj` with every dict key "logprobs" left out and every object attribute
    `logprobs` set to None (an OpenAI `Choice`'s), recursing through dicts, lists, tuples and
    objects' `__dict__`, as ART's does (`art/utils/strip_logprobs.py`). An object that cannot be
    deep-copied is returned unchanged with one logged warning, as in ART.
    """
    try:
        copied = copy.deepcopy(obj)
    except Exception as exc:  # noqa: BLE001 - ART's behaviour: warn and return the original
        log.warning(
            "strip_logprobs could not deep-copy %s (%s); returning it unchanged", type(obj).__name__, exc
        )
        return obj
    return _strip(copied)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "logprobs"}
    if isinstance(obj, (list, tuple)):
        items = [_strip(v) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    if hasattr(obj, "__dict__"):
        for key, value in list(vars(obj).items()):
            object.__setattr__(obj, key, None if key == "logprobs" else _strip(value))
        return obj
    return obj
