"""Checks of training hyper-parameters, shared by `backend.train`, `TrainConfig`, `SFTConfig` and
`iterate_dataset`: a value out of range or of the wrong type is refused, never replaced by a default.

Each `*_problem` function returns None for a good value, else the words that follow the value in
the refusal ("must be a finite number greater than 0, not a str"); `check` raises
`HyperParameterError` naming where, the parameter, the value and the fix, and `pydantic_check`
raises the `ValueError` a pydantic validator turns into a `ValidationError`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from art_mega.errors import HyperParameterError

Problem = Callable[[Any], "str | None"]


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: the trainer computes in float32 (bfloat16 has the same range), so a
larger value becomes inf there (Adam: "value cannot be converted to type float without overflow")."""

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "average", "geometric_average")
"""ART's `importance_sampling_level`s (`art/loss.py`): the ratio per token, per sequence (GSPO),
their mean, or their geometric mean."""

LOSS_FNS = ("ppo", "cispo")
"""ART's `loss_fn`s: PPO's clipped surrogate, or CISPO (the clipped ratio as a weight on the
REINFORCE term; ART's default)."""

FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: a positive value below it is a subnormal or 0 to the trainer."""


def _not_a_number(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"a {type(value).__name__}"
    if not math.isfinite(float(value)):
        return "not finite"
    if abs(float(value)) > FLOAT32_MAX:
        return f"above {FLOAT32_MAX:.4g}, the largest float32 the trainer computes in"
    return None


def positive_problem(value: Any) -> str | None:
    """None when `value` is a real number, finite and > 0 (bool and str are not numbers), that
    float32 holds: from `FLOAT32_TINY` to `FLOAT32_MAX`."""
    why = _not_a_number(value)
    if why is None and float(value) <= 0:
        why = "not above 0"
    elif why is None and float(value) < FLOAT32_TINY:
        why = f"below {FLOAT32_TINY:.4g}, which the trainer's float32 rounds towards 0"
    return None if why is None else f"must be a finite number greater than 0 ({why})"


def nonnegative_problem(value: Any) -> str | None:
    """None when `value` is a real number, finite, >= 0 and at most `FLOAT32_MAX`."""
    why = _not_a_number(value)
    if why is None and float(value) < 0:
        why = "negative"
    return None if why is None else f"must be a finite number of at least 0 ({why})"


def fraction_problem(value: Any) -> str | None:
    """None when `value` is a real number in [0, 1]."""
    why = _not_a_number(value)
    if why is None and not 0 <= float(value) <= 1:
        why = "outside [0, 1]"
    return None if why is None else f"must be a number from 0 to 1 ({why})"


def finite_problem(value: Any) -> str | None:
    """None when `value` is a real number, finite and within float32 (any sign)."""
    why = _not_a_number(value)
    return None if why is None else f"must be a finite number ({why})"


def between_problem(low: float, high: float) -> Problem:
    """A check that `value` is a real number in [`low`, `high`]."""

    def problem(value: Any) -> str | None:
        why = _not_a_number(value)
        if why is None and not low <= float(value) <= high:
            why = f"outside [{low:g}, {high:g}]"
        return None if why is None else f"must be a number from {low:g} to {high:g} ({why})"

    return problem


def one_of_problem(*choices: str) -> Problem:
    """A check that `value` is one of the strings `choices`."""

    def problem(value: Any) -> str | None:
        if isinstance(value, str) and value in choices:
            return None
        return f"must be one of {', '.join(repr(c) for c in choices)}"

    return problem


def whole_problem(minimum: int) -> Problem:
    """A check that `value` is an integer (numpy's too; not a bool, not a float) >= `minimum`."""

    def problem(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            why = f"a {type(value).__name__}"
        elif int(value) < minimum:
            why = f"below {minimum}"
        else:
            return None
        return f"must be a whole number of at least {minimum} ({why})"

    return problem


def bool_problem(value: Any) -> str | None:
    """None when `value` is True or False (a string such as "false" is not)."""
    return None if isinstance(value, bool) else f"must be True or False (a {type(value).__name__})"


def json_finite_problem(value: Any) -> str | None:
    """None unless `value` (a request's options: dicts, lists and tuples of values) holds a float
    NaN or infinity somewhere, which JSON, and so a request to a server, cannot carry."""
    if isinstance(value, float) and not math.isfinite(value):
        return "holds a NaN or infinity, which a JSON request cannot carry"
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return next((why for why in map(json_finite_problem, value) if why is not None), None)
    return None


def optional(problem: Problem) -> Problem:
    """`problem`, with None allowed (the option is off)."""
    return lambda value: None if value is None else problem(value)


def check(where: str, name: str, value: Any, problem: Problem, example: str) -> Any:
    """Return `value` when `problem(value)` is None.

    Raises:
        HyperParameterError: "`where`(`name`=`value`) `problem`; pass e.g. `name`=`example`".
    """
    why = problem(value)
    if why is not None:
        raise HyperParameterError(f"{where}({name}={value!r}) {why}; pass e.g. {name}={example}", name, value)
    return value


def pydantic_check(value: Any, problem: Problem, example: str) -> Any:
    """Return `value` when `problem(value)` is None; for pydantic `mode="before"` validators.

    Raises:
        ValueError: "`value` `problem`, e.g. `example`" (pydantic names the model and field).
    """
    why = problem(value)
    if why is not None:
        raise ValueError(f"{value!r} {why}; use e.g. {example}")
    return value
