"""The metrics `model.log` writes, as ART 0.5.18 names and derives them: history.jsonl rows,
the step metrics builder (`costs/*`, `time/step_*`, `data/step_*`, their cumulative `*/cum/*`
totals and `throughput/*`), `track_api_cost`, and the W&B run.

A row holds (for split "train", "val" or "test"): `{split}/reward`, `{split}/reward_std_dev`
(mean over groups of more than one trajectory of the population std of their rewards),
`{split}/reward_min` and `{split}/reward_max` (over the step's trajectories; art-mega's, for
the report's band), `time/step_actor_s` (train) or `time/step_eval_s` (val, test): the seconds
the `gather_trajectory_groups` calls that returned the groups took, unless the caller timed it,
`{split}/exception_rate` (exceptions / (trajectories + exceptions)), `{split}/<metric>`
(trajectory metrics, averaged over the trajectories that report them), `{split}/group_<metric>`
(group metrics, averaged over the groups with trajectories), `data/step_num_scenarios`,
`data/step_num_trajectories` (trajectories + exceptions), `data/step_num_groups_submitted`,
`data/step_num_groups_trainable` (train only: groups whose rewards differ), caller metrics (a
key whose first part is a section — `loss`, `time`, `data`, `costs`, `throughput`, `reward`,
`offpolicy`, `pipeline` — or a split is kept, any other is prefixed `{split}/`), the builder's
metrics, `training_step`, `time/wall_clock_sec` (seconds since the model was created), `step`
and `recorded_at`. NaN values are left out.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import inspect
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from art_mega.errors import HyperParameterError
from art_mega.metrics_costs import (
    PRICE_FIELDS,
    CostExtractor,
    TokenPricing,
    check_price,
    clean_name,
    response_cost,
)
from art_mega.trajectories import TrajectoryGroup

P = ParamSpec("P")
R = TypeVar("R")

SECTIONS = frozenset({"reward", "loss", "offpolicy", "pipeline", "throughput", "costs", "time", "data"})
"""ART's metric sections: a caller key starting with one of them (or a split) is not prefixed."""

SPLITS = frozenset({"train", "val", "test"})
"""The splits whose rows get the step data metrics (ART's METRIC_SPLITS)."""

CUMULATIVE_SECTIONS = ("costs", "time", "data")
"""The sections whose builder metrics get running totals (`time/step_trainer_s` ->
`time/cum/trainer_s`)."""

BUILDER_PREFIXES = ("costs/", "time/step_", "data/step_", "throughput/step_")
"""Keys summed per step by the builder (and so cumulated), wherever they are logged from."""

IDLE_TOTALS = {
    "throughput/step_trainer_idle_s": "throughput/cum/trainer_idle_s",
    "throughput/step_actor_idle_s": "throughput/cum/actor_idle_s",
}

STATE_FILE = "state.json"
"""The run folder's state file (ART's); the builder's totals live under `BUILDER_STATE_KEY`."""

BUILDER_STATE_KEY = "_metrics_builder_state"

_ACTIVE: contextvars.ContextVar[MetricsBuilder] = contextvars.ContextVar("art_mega_metrics_builder")


def is_cumulative(key: str) -> bool:
    """True for a running-total key such as `costs/cum/all` (its second part is `cum`)."""
    parts = key.split("/", 2)
    return len(parts) >= 2 and parts[1] == "cum"


def cumulative_key(key: str) -> str:
    """`time/step_trainer_s` -> `time/cum/trainer_s`, `costs/train/judge` -> `costs/cum/train/judge`."""
    section, rest = key.split("/", 1)
    return f"{section}/cum/{rest.removeprefix('step_')}"


def _number(where: str, name: str, value: Any) -> float:
    from art_mega.hyperparams import check, finite_problem

    if isinstance(value, float) and math.isinf(value):
        return value  # an overflowed quantity is logged as is, as model.log does
    check(where, name, value, finite_problem, "0.5")
    return float(value)


@dataclass
class _Pending:
    values: dict[str, float] = field(default_factory=dict)
    scenario_ids: set[str] = field(default_factory=set)


@dataclass
class _Shared:
    """What every builder of one model shares: the pending step per buffer scope, the totals."""

    pending: dict[str, _Pending] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    scenario_ids: set[str] = field(default_factory=set)
    extractors: dict[str, CostExtractor] = field(default_factory=dict)
    pricing: dict[str, TokenPricing] = field(default_factory=dict)


class MetricsBuilder:
    """ART's step metrics builder: sums metrics that live outside trajectories until the next
    `model.log` of its split flushes them into that row, with their running totals.

    `cost_context` names where costs go (`costs/<context>/<source>`: "train", "eval", ...);
    builders made by `for_cost_context` share this one's totals, pricing and pending steps. A
    model's builder is `model.metrics_builder()`; `model.log(split="train")` flushes the "train"
    scope, "val"/"test" the "eval" scope. Values are USD for costs and seconds for time.

    Raises (each method):
        HyperParameterError: an empty context, key or source; a key without a section
            ("time/...") or in a cumulative namespace ("*/cum/*"); a key that is an ancestor or
            a descendant of one already pending ("costs/a" and "costs/a/b"); a value that is
            not a number (NaN included).
    """

    def __init__(
        self, cost_context: str = "train", *, _shared: _Shared | None = None, _scope: str | None = None
    ):
        self.cost_context = clean_name("MetricsBuilder", "cost_context", cost_context, "train")
        self._scope = self.cost_context if _scope is None else _scope
        self._shared = _Shared() if _shared is None else _shared

    def for_cost_context(self, cost_context: str, *, buffer_scope: str | None = None) -> MetricsBuilder:
        """A builder for `cost_context` sharing this one's state (pending in `buffer_scope`,
        default the context)."""
        context = clean_name("metrics_builder", "cost_context", cost_context, "eval")
        scope = (
            context
            if buffer_scope is None
            else clean_name("for_cost_context", "buffer_scope", buffer_scope, "eval")
        )
        if (context, scope) == (self.cost_context, self._scope):
            return self
        return MetricsBuilder(context, _shared=self._shared, _scope=scope)

    def for_split(self, split: str) -> MetricsBuilder:
        """The builder a `model.log(split=...)` flushes: train -> "train", val/test -> "eval"."""
        context = {"train": "train", "val": "eval", "test": "eval"}.get(split, split)
        return self.for_cost_context(context, buffer_scope=context)

    def _pending(self) -> _Pending:
        return self._shared.pending.setdefault(self._scope, _Pending())

    def add_metric(self, key: str, value: float) -> None:
        """Add `value` to `key` (summed within the step), e.g. `time/step_actor_s`."""
        if not isinstance(key, str) or "/" not in key or not key.split("/", 1)[0] or key.endswith("/"):
            raise HyperParameterError(
                f"metrics_builder.add_metric(key={key!r}) must be 'section/name', e.g. 'time/step_actor_s'",
                "key",
                key,
            )
        if is_cumulative(key):
            raise HyperParameterError(
                f"metrics_builder.add_metric(key={key!r}) is in a cumulative namespace ('*/cum/*'), which "
                "the builder derives itself; log the per-step key, e.g. 'time/step_actor_s'",
                "key",
                key,
            )
        number = _number("metrics_builder.add_metric", key, value)
        pending = self._pending().values
        for other in pending:
            if other != key and (other.startswith(f"{key}/") or key.startswith(f"{other}/")):
                raise HyperParameterError(
                    f"metrics_builder.add_metric(key={key!r}) and the pending {other!r} would be both a "
                    "total and a part of it; log leaves only, e.g. 'costs/train/judge/a' and 'costs/train/judge/b'",
                    "key",
                    key,
                )
        pending[key] = pending.get(key, 0.0) + number

    def add_cost(self, path: str, usd: float) -> None:
        """Add `usd` to `costs/<path>` (e.g. path "train/judge/ruler")."""
        path = clean_name("metrics_builder.add_cost", "path", path, "train/judge").strip("/")
        self.add_metric(f"costs/{path}", usd)

    def add_response_cost(
        self,
        source: str,
        response: Any,
        *,
        provider: str,
        model_name: str,
        prompt_price_per_million: float | None = None,
        completion_price_per_million: float | None = None,
        cached_prompt_price_per_million: float | None = None,
        cache_creation_price_per_million: float | None = None,
        cache_read_price_per_million: float | None = None,
    ) -> float:
        """Price one API response (see `art_mega.metrics_costs.response_cost`) and add it to
        `costs/<cost_context>/<source>`; returns the USD added.

        Raises:
            HyperParameterError: see the class, and no pricing for `model_name` or usage that
                is not `provider`'s (named, with the fix).
        """
        where = "metrics_builder.add_response_cost"
        source = clean_name(where, "source", source, "judge/ruler").strip("/")
        provider = clean_name(where, "provider", provider, "openai").lower()
        model_name = clean_name(where, "model_name", model_name, "openai/gpt-4.1")
        prices = (
            prompt_price_per_million,
            completion_price_per_million,
            cached_prompt_price_per_million,
            cache_creation_price_per_million,
            cache_read_price_per_million,
        )
        overrides = {
            name: check_price(where, f"{name.removesuffix('_per_million')}_price_per_million", value)
            for name, value in zip(PRICE_FIELDS, prices)
        }
        usd = response_cost(
            response,
            provider=provider,
            model_name=model_name,
            extractors=self._shared.extractors,
            registered=self._shared.pricing,
            overrides=overrides,
        )
        self.add_cost(f"{self.cost_context}/{source}", usd)
        return usd

    def add_data(
        self,
        step_num_scenarios: int | None = None,
        step_actor_tokens: int | None = None,
        scenario_ids: list[str] | None = None,
    ) -> None:
        """`data/step_num_scenarios`, `data/step_actor_tokens`, and scenario ids (their distinct
        count over the run is `data/cum/num_unique_scenarios`)."""
        if step_num_scenarios is not None:
            self.add_metric("data/step_num_scenarios", step_num_scenarios)
        if step_actor_tokens is not None:
            self.add_metric("data/step_actor_tokens", step_actor_tokens)
        if scenario_ids is not None:
            self._pending().scenario_ids.update(str(s) for s in scenario_ids)

    def add_user_timing(
        self,
        step_wall_s: float | None = None,
        step_actor_s: float | None = None,
        step_eval_s: float | None = None,
    ) -> None:
        """Seconds: `time/step_wall_s`, `time/step_actor_s`, `time/step_eval_s`."""
        for name, value in (("wall", step_wall_s), ("actor", step_actor_s), ("eval", step_eval_s)):
            if value is not None:
                self.add_metric(f"time/step_{name}_s", value)

    def add_idle_times(
        self, step_trainer_idle_s: float | None = None, step_actor_idle_s: float | None = None
    ) -> None:
        """Seconds: `throughput/step_trainer_idle_s`, `throughput/step_actor_idle_s` (and their totals)."""
        for name, value in (("trainer", step_trainer_idle_s), ("actor", step_actor_idle_s)):
            if value is not None:
                self.add_metric(f"throughput/step_{name}_idle_s", value)

    @contextmanager
    def measure(self, key: str) -> Iterator[None]:
        """Add the seconds the `with` body takes (monotonic clock) to `key`, e.g. `time/step_actor_s`."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.add_metric(key, time.monotonic() - started)

    def register_cost_extractor(self, provider: str, extractor: CostExtractor) -> None:
        """Price `provider`'s responses with `extractor(response) -> USD | None` (None: by tokens)."""
        provider = clean_name("register_cost_extractor", "provider", provider, "my-provider").lower()
        if not callable(extractor):
            raise HyperParameterError(
                f"register_cost_extractor(extractor={extractor!r}) must be a function of the response "
                "returning its USD cost",
                "extractor",
                extractor,
            )
        self._shared.extractors[provider] = extractor

    def register_model_pricing(
        self,
        model_name: str,
        *,
        prompt_per_million: float,
        completion_per_million: float,
        cached_prompt_per_million: float | None = None,
        cache_creation_per_million: float | None = None,
        cache_read_per_million: float | None = None,
    ) -> None:
        """USD per million tokens for `model_name` (wins over the shipped and LiteLLM prices)."""
        where = "register_model_pricing"
        model_name = clean_name(where, "model_name", model_name, "anthropic/my-judge")
        from art_mega.hyperparams import check, nonnegative_problem

        check(where, "prompt_per_million", prompt_per_million, nonnegative_problem, "1.2")
        check(where, "completion_per_million", completion_per_million, nonnegative_problem, "4.8")
        self._shared.pricing[model_name] = TokenPricing(
            float(prompt_per_million),
            float(completion_per_million),
            check_price(where, "cached_prompt_per_million", cached_prompt_per_million),
            check_price(where, "cache_creation_per_million", cache_creation_per_million),
            check_price(where, "cache_read_per_million", cache_read_per_million),
        )

    def activate(self) -> contextvars.Token[MetricsBuilder]:
        """Make this the builder `track_api_cost`, `record_cost` and `record_latency` add to
        (in this context and the tasks it starts); reset with `token.var.reset(token)`."""
        return _ACTIVE.set(self)

    @contextmanager
    def activate_context(self) -> Iterator[MetricsBuilder]:
        """`with builder.activate_context():` — this builder is the active one inside."""
        token = self.activate()
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @staticmethod
    def get_active() -> MetricsBuilder:
        """The active builder. Raises LookupError when none is active (as ART's)."""
        return _ACTIVE.get()

    def pending_keys(self) -> frozenset[str]:
        """The keys this scope's pending step holds so far (e.g. `time/step_actor_s` a caller
        added with `add_user_timing`)."""
        return frozenset(self._pending().values)

    def flush_now(self) -> dict[str, float]:
        """This scope's pending step with its cost rollups, running totals and throughput,
        then cleared (see the module docstring); `flush` is the awaitable form."""
        pending = self._pending()
        result = dict(pending.values)
        result.update(_cost_rollups({k: v for k, v in result.items() if k.startswith("costs/")}))
        totals = self._shared.totals
        for key, value in list(result.items()):
            if key.split("/", 1)[0] in CUMULATIVE_SECTIONS:
                total = cumulative_key(key)
                totals[total] = totals.get(total, 0.0) + value
                result[total] = totals[total]
        if pending.scenario_ids:
            self._shared.scenario_ids |= pending.scenario_ids
            result["data/cum/num_unique_scenarios"] = float(len(self._shared.scenario_ids))
        for step_key, total in IDLE_TOTALS.items():
            if step_key in result:
                totals[total] = totals.get(total, 0.0) + result[step_key]
                result[total] = totals[total]
        for who in ("trainer", "actor"):
            if f"data/step_{who}_tokens" in result or f"time/step_{who}_s" in result:
                tokens, seconds = totals.get(f"data/cum/{who}_tokens"), totals.get(f"time/cum/{who}_s")
                if tokens is not None and seconds:
                    result[f"throughput/avg_{who}_tok_per_s"] = tokens / seconds
        pending.values.clear()
        pending.scenario_ids.clear()
        return result

    async def flush(self) -> dict[str, float]:
        """`flush_now`, as ART's awaitable `flush`."""
        return self.flush_now()

    def state_dict(self) -> dict[str, Any]:
        """The running totals and seen scenario ids (JSON), as ART persists them."""
        return {
            "cum_state": dict(self._shared.totals),
            "unique_scenario_ids": sorted(self._shared.scenario_ids),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`; pending steps are dropped.

        Raises:
            HyperParameterError: `state` is not a dict of `cum_state` numbers and `unique_scenario_ids`.
        """
        try:
            totals = {str(k): float(v) for k, v in dict(state.get("cum_state", {})).items()}
            ids = {str(v) for v in list(state.get("unique_scenario_ids", []))}
        except (AttributeError, TypeError, ValueError):
            raise HyperParameterError(
                f"metrics builder state {state!r} is not {{'cum_state': {{key: number}}, "
                "'unique_scenario_ids': [...]}}; delete it from state.json to start the totals again",
                "state",
                state,
            ) from None
        self._shared.totals = totals
        self._shared.scenario_ids = ids
        self._shared.pending.clear()


def _cost_rollups(costs: Mapping[str, float]) -> dict[str, float]:
    """Every parent of a cost leaf as the sum of its leaves, and `costs/all` (ART's rollups)."""
    if not costs:
        return {}
    parents = {"/".join(k.split("/")[:depth]) for k in costs for depth in range(2, len(k.split("/")))}
    rollups = {p: sum(v for k, v in costs.items() if k.startswith(f"{p}/")) for p in parents}
    tops = {"/".join(k.split("/")[:2]) for k in costs}
    rollups["costs/all"] = sum(rollups.get(top, costs.get(top, 0.0)) for top in tops)
    return rollups


def record_cost(source: str, usd: float) -> bool:
    """Add `usd` to `costs/<context>/<source>` of the active builder (context "train" or "eval":
    which `model.metrics_builder(...).activate_context()` the call runs in). Returns False, and
    records nothing, when no builder is active (ART's `track_api_cost` does the same).

    Raises:
        HyperParameterError: an empty source, or `usd` not a number.
    """
    try:
        builder = MetricsBuilder.get_active()
    except LookupError:
        return False
    source = clean_name("record_cost", "source", source, "judge/ruler").strip("/")
    builder.add_cost(f"{builder.cost_context}/{source}", usd)
    return True


def record_latency(name: str, seconds: float) -> bool:
    """Add `seconds` to `time/step_<name>_s` of the active builder (summed over the step; its
    total is `time/cum/<name>_s`). Returns False, and records nothing, when no builder is active.

    Raises:
        HyperParameterError: `name` is empty or holds '/', or `seconds` is not a number.
    """
    try:
        builder = MetricsBuilder.get_active()
    except LookupError:
        return False
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise HyperParameterError(
            f"record_latency(name={name!r}) must be a name without '/', e.g. 'judge_ruler'", "name", name
        )
    builder.add_metric(f"time/step_{name.strip()}_s", seconds)
    return True


def track_api_cost(
    *,
    source: str,
    provider: str,
    model_name: str,
    response_getter: Callable[[Any], Any] | None = None,
    prompt_price_per_million: float | None = None,
    completion_price_per_million: float | None = None,
    cached_prompt_price_per_million: float | None = None,
    cache_creation_price_per_million: float | None = None,
    cache_read_price_per_million: float | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """ART's decorator: after each call of the (sync or async) function, price what it returned
    (or `response_getter(result)`) and add it to `costs/<context>/<source>` of the active builder
    (nothing when none is active). Prices given here override the model's known pricing.

    Raises:
        HyperParameterError: (at decoration) an empty source, provider or model name, or a price
            that is not a finite number >= 0; (after a call) what `add_response_cost` raises.
    """
    where = "track_api_cost"
    source = clean_name(where, "source", source, "llm_judge/correctness").strip("/")
    provider = clean_name(where, "provider", provider, "openai").lower()
    model_name = clean_name(where, "model_name", model_name, "openai/gpt-4.1")
    prices = {
        "prompt_price_per_million": prompt_price_per_million,
        "completion_price_per_million": completion_price_per_million,
        "cached_prompt_price_per_million": cached_prompt_price_per_million,
        "cache_creation_price_per_million": cache_creation_price_per_million,
        "cache_read_price_per_million": cache_read_price_per_million,
    }
    for name, value in prices.items():
        check_price(where, name, value)

    def record(result: Any) -> None:
        try:
            builder = MetricsBuilder.get_active()
        except LookupError:
            return
        response = result if response_getter is None else response_getter(result)
        builder.add_response_cost(source, response, provider=provider, model_name=model_name, **prices)

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def call_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                result = await function(*args, **kwargs)
                record(result)
                return result

            return call_async  # type: ignore[return-value]

        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            result = function(*args, **kwargs)
            record(result)
            return result

        return call

    return decorate


def _is_builder_key(key: str) -> bool:
    return key.startswith(BUILDER_PREFIXES)


def _route(metrics: Mapping[str, Any], builder: MetricsBuilder) -> dict[str, float]:
    """Costs and builder-managed keys into `builder` (summed), the rest returned as floats.

    Raises:
        HyperParameterError: a legacy `costs_*` key (ART refuses it too).
    """
    rest: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith("costs_"):
            raise HyperParameterError(
                f"metric {key!r} uses the old 'costs_' form; log costs as 'costs/<context>/<source>', "
                "e.g. 'costs/train/judge/ruler'",
                key,
                value,
            )
        if key.startswith("costs/"):
            builder.add_cost(key.removeprefix("costs/"), float(value))
        elif _is_builder_key(key):
            builder.add_metric(key, float(value))
        else:
            rest[key] = float(value)
    return rest


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _pstd(values: list[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def step_data_metrics(groups: Iterable[TrajectoryGroup], trainable: bool) -> dict[str, float]:
    """ART's `data/step_num_scenarios` and `data/step_num_groups_submitted` (the groups),
    `data/step_num_trajectories` (trajectories + exceptions) and, when `trainable`,
    `data/step_num_groups_trainable` (groups of more than one trajectory whose rewards differ)."""
    groups = list(groups)
    metrics = {
        "data/step_num_scenarios": float(len(groups)),
        "data/step_num_trajectories": float(sum(len(g.trajectories) + len(g.exceptions) for g in groups)),
        "data/step_num_groups_submitted": float(len(groups)),
    }
    if trainable:
        metrics["data/step_num_groups_trainable"] = float(
            sum(1 for g in groups if len({t.reward for t in g.trajectories}) > 1)
        )
    return metrics


def scenario_ids(groups: Iterable[TrajectoryGroup]) -> list[str]:
    """Each group's `metadata["scenario_id"]` (else its first trajectory's that has one), in
    order, without repeats (ART's source of `data/cum/num_unique_scenarios`)."""
    seen: list[str] = []
    for group in groups:
        for metadata in (group.metadata, *(t.metadata for t in group.trajectories)):
            if metadata.get("scenario_id") is not None:
                if str(metadata["scenario_id"]) not in seen:
                    seen.append(str(metadata["scenario_id"]))
                break
    return seen


TRAIN_RENAMES = {
    "loss/policy": "loss/train",
    "loss/sft": "loss/train",
    "data/groups": "data/step_num_groups_submitted",
}
"""art-mega's trainer names -> ART's, for the same quantity (rank and backend metrics)."""

TRAINER_TIME_PARTS = ("time/prepare_s", "time/train_s", "time/publish_s")
"""The parts of one backend call whose sum is ART's `time/step_trainer_s`."""


def art_train_metrics(metrics: Mapping[str, float], *, kl_loss: bool) -> dict[str, float]:
    """A step's metrics with ART's names: `loss/train` (the step's loss), `loss/kl_div` (the
    KL loss term's mean KL to the reference, only when `kl_loss`, i.e. kl_beta > 0: without that
    term nothing is measured), `data/step_num_groups_submitted`, `data/step_trainer_tokens` (the
    trained tokens), `time/step_trainer_s` (prepare + train + publish seconds, the parts
    present); `loss/entropy`, `loss/grad_norm`, `loss/learning_rate`, `loss/kl_policy_ref`,
    `data/step_num_gradient_steps` are ART's already, and art-mega's other keys stay.
    Applying it twice gives the same dict."""
    out = {TRAIN_RENAMES.get(key, key): value for key, value in metrics.items()}
    kl = out.pop("loss/kl", None)
    if kl_loss and kl is not None:
        out["loss/kl_div"] = kl
    if "data/trained_tokens" in out:
        out["data/step_trainer_tokens"] = out["data/trained_tokens"]
    parts = [out[key] for key in TRAINER_TIME_PARTS if key in out]
    if parts:
        out["time/step_trainer_s"] = sum(parts)
    return out


def gather_seconds(groups: Iterable[TrajectoryGroup]) -> float | None:
    """Seconds the `gather_trajectory_groups` calls that returned `groups` took, each call
    counted once (groups of one call share its time); None when no group came from one."""
    calls = {g._gathered[0]: g._gathered[1] for g in groups if g._gathered is not None}
    return sum(calls.values()) if calls else None


def history_row(
    groups: Iterable[TrajectoryGroup] | None,
    split: str = "train",
    step: int = 0,
    metrics: Mapping[str, float] | None = None,
    *,
    builder: MetricsBuilder | None = None,
    automatic: Mapping[str, float] | None = None,
    wall_clock_sec: float | None = None,
) -> dict[str, Any]:
    """One history.jsonl row for `groups` (None: metrics only) at policy `step`, named as the
    module docstring says; `builder`'s pending metrics of the split are flushed into it (a
    fresh builder when None). `automatic`: backend metrics (`time/step_wall_s`) that a caller
    metric of the same key replaces. Returns {} when there is nothing to log (no groups, no
    metrics, nothing pending).

    Raises:
        HyperParameterError: a legacy `costs_*` key, or a builder refusal (see MetricsBuilder).
    """
    builder = (builder or MetricsBuilder()).for_split(split)
    metrics = dict(metrics or {})
    automatic = dict(automatic or {})
    if groups is not None:
        groups = list(groups)
        timed = f"time/step_{'actor' if split == 'train' else 'eval'}_s"
        seconds = gather_seconds(groups)
        if seconds is not None and timed not in builder.pending_keys():
            automatic.setdefault(timed, seconds)
    _route({k: v for k, v in automatic.items() if k not in metrics}, builder)
    values: dict[str, float] = {}
    if groups is not None:
        if split in SPLITS:
            defaults = step_data_metrics(groups, trainable=split == "train")
            _route({k: v for k, v in defaults.items() if k not in metrics}, builder)
            if scenario_ids(groups):
                builder.add_data(scenario_ids=scenario_ids(groups))
        trajectories = [t for g in groups for t in g.trajectories]
        exceptions = sum(len(g.exceptions) for g in groups)
        values["reward"] = _mean([t.reward for t in trajectories])
        values["exception_rate"] = _mean([0.0] * len(trajectories) + [1.0] * exceptions)
        per_trajectory: dict[str, list[float]] = {}
        for t in trajectories:
            for name, value in _route(t.metrics, builder).items():
                per_trajectory.setdefault(name, []).append(value)
        per_group: dict[str, list[float]] = {}
        for g in groups:
            for name, value in _route(g.metrics, builder).items():
                if g.trajectories:
                    per_group.setdefault(name, []).append(value)
        values.update({name: _mean(v) for name, v in per_trajectory.items()})
        values.update({f"group_{name}": _mean(v) for name, v in per_group.items()})
        spreads = [_pstd([t.reward for t in g.trajectories]) for g in groups if len(g.trajectories) > 1]
        values["reward_std_dev"] = _mean(spreads)
        rewards = [t.reward for t in trajectories if math.isfinite(t.reward)]
        if rewards:
            values["reward_min"], values["reward_max"] = min(rewards), max(rewards)
    values.update(_route(metrics, builder))
    values.update(builder.flush_now())
    values = {k: v for k, v in values.items() if not math.isnan(v)}
    if not values and groups is None:
        return {}
    row: dict[str, Any] = {_prefixed(k, split): v for k, v in values.items()}
    row["training_step"] = step
    if wall_clock_sec is not None:
        row["time/wall_clock_sec"] = wall_clock_sec
    row["step"] = step
    row["recorded_at"] = datetime.datetime.now(datetime.UTC).isoformat()
    return row


def _prefixed(key: str, split: str) -> str:
    if split not in SPLITS:
        return f"{split}/{key}"
    head = key.split("/", 1)[0]
    return key if "/" in key and (head in SECTIONS or head in SPLITS) else f"{split}/{key}"


LAUNCH_RESTARTS: list[dict[str, Any]] = []
"""This controller process's restarts after a lost host (`launch.controller.run_with_restarts`
appends {"restart": n, "max_restarts": N, "cause": sentence}); `record_restarts` writes them
into a run's history."""
_RECORDED: set[tuple[str, int]] = set()


def record_restarts(run_dir: str | Path, step: int) -> None:
    """Append one history.jsonl row per restart of this process not yet written to `run_dir`:
    {"step": step (the LATEST the rerun resumes from), "launch/restart": n,
    "launch/max_restarts": N, "launch/restart_cause": sentence, "recorded_at": ISO time}."""
    for restart in LAUNCH_RESTARTS:
        key = (str(run_dir), int(restart["restart"]))
        if key in _RECORDED:
            continue
        _RECORDED.add(key)
        append_history(
            Path(run_dir) / "history.jsonl",
            {
                "step": step,
                "launch/restart": restart["restart"],
                "launch/max_restarts": restart["max_restarts"],
                "launch/restart_cause": restart["cause"],
                "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(),
            },
        )


def append_history(path: Path, row: Mapping[str, Any]) -> None:
    """Append one JSON line to `path` (created with its folder), flushed and fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_history(path: Path) -> list[dict[str, Any]]:
    """All rows of a history.jsonl (empty when the file does not exist).

    Raises:
        UserError: the path is not a readable text file, or a line is not a JSON object with an
            integer "step" (names the file and line).
    """
    from art_mega.errors import UserError

    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{path} cannot be read as a text file ({type(exc).__name__}); pass a run directory"
        ) from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(
                f"{path} line {number} is not valid JSON; history.jsonl holds one JSON object per line"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path} line {number} is not a JSON object with an integer 'step'")
        rows.append(row)
    return rows


def read_state(run_dir: Path) -> dict[str, Any]:
    """The run folder's state.json ({} when absent).

    Raises:
        UserError: the file is not a JSON object (names it).
    """
    from art_mega.errors import UserError

    path = run_dir / STATE_FILE
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        state = None
    if not isinstance(state, dict):
        raise UserError(f"{path} is not a JSON object; fix or delete it (it holds the run's metric totals)")
    return state


def write_state(run_dir: Path, state: Mapping[str, Any]) -> None:
    """Replace the run folder's state.json with `state` (written whole, then renamed into place)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = run_dir / f".{STATE_FILE}.tmp"
    staging.write_text(json.dumps(state, indent=2))
    staging.replace(run_dir / STATE_FILE)


WANDB_SECTIONS = (
    "reward",
    "loss",
    "throughput",
    "costs",
    "time",
    "data",
    "train",
    "val",
    "test",
    "discarded",
)
"""The key families ART plots against `training_step` on W&B."""


class WandbRun:
    """The model's W&B run, as ART opens it: project and entity from the model, run id = the
    model's name (shown as `run_name` when set, else the name), `resume="allow"` (a restarted
    program continues the same run), every metric family plotted against `training_step`.
    `WANDB_MODE=offline` writes it locally.

    Raises:
        UserError: wandb is not installed (names the extra).
    """

    def __init__(
        self,
        project: str,
        name: str,
        entity: str | None,
        config: Mapping[str, Any] | None,
        display_name: str | None = None,
    ) -> None:
        from art_mega.errors import UserError

        try:
            import wandb
        except ImportError:
            raise UserError(
                f"model {name!r} reports to W&B (WANDB_API_KEY is set or report_metrics=['wandb']) but wandb "
                "is not installed; pip install 'art-mega[wandb]', or pass report_metrics=[]"
            ) from None
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=display_name or name,
            id=name,
            config=dict(config or {}),
            resume="allow",
            reinit="create_new",
        )
        self.run.define_metric("training_step")
        self.run.define_metric("time/wall_clock_sec")
        for family in WANDB_SECTIONS:
            self.run.define_metric(f"{family}/*", step_metric="training_step")

    def log(self, row: Mapping[str, Any]) -> None:
        """Log one history row (without `step` and `recorded_at`: W&B keeps its own step, and
        `training_step` is the x axis, so a late val row for an earlier step plots in place)."""
        self.run.log({k: v for k, v in row.items() if k not in ("step", "recorded_at")})

    def finish(self) -> None:
        self.run.finish()
