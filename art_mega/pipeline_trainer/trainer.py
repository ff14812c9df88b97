"""ART's `PipelineTrainer`: rollouts for the next steps are generated while a step trains.

Three stages run concurrently on one event loop: `num_rollout_workers` rollout workers draw
scenarios and put their groups on a queue; the training stage takes `min_batch_size` to
`max_batch_size` groups off it and calls `backend.train(..., allow_stale=True)`; an eval stage
runs `eval_fn` on the steps it is told. A worker starts a rollout only while the served policy
is at most `max_steps_off_policy` steps behind the step being trained, and the training stage
drops a group sampled more than `max_steps_off_policy` steps before the step it trains from
(counted in `discarded_stale_groups`). Every trajectory records the served step when its
rollout started and ended (`initial_policy_version` / `final_policy_version`); its choices
carry the step whose adapter answered (`policy_step`). The served step advances only once every
replica has loaded the new adapter (`MegatronBackend.train` publishes before it returns), and a
stale sample is importance-corrected by the loss against the logprobs it was sampled with.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Generic

from art_mega.errors import HyperParameterError, UserError
from art_mega.pipeline_trainer.types import ConfigT, EvalFn, RolloutFn, ScenarioT, SingleRolloutFn
from art_mega.trajectories import Trajectory, TrajectoryGroup

PIPELINE_STATE_KEY = "_pipeline_trainer"
"""The key of the trainer's resumable state in the model's state.json (ART's)."""

log = logging.getLogger(__name__)
WHERE = "PipelineTrainer"


def _number_problem(value: Any, minimum: float, *, whole: bool, strict: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        return True
    return value <= minimum if strict else value < minimum


def _check(
    name: str,
    value: Any,
    minimum: float,
    *,
    whole: bool = True,
    strict: bool = False,
    none: bool = False,
    where: str = WHERE,
) -> None:
    """Refuse (`HyperParameterError`) `value` of `where`'s `name` unless it is a number (an
    int when `whole`) at least `minimum` (above it when `strict`), or None when `none`."""
    if none and value is None:
        return
    if _number_problem(value, minimum, whole=whole, strict=strict):
        kind = "a whole number" if whole else "a number"
        bound = f"above {minimum}" if strict else f"at least {minimum}"
        also = " or None" if none else ""
        raise HyperParameterError(
            f"{where}({name}={value!r}) must be {kind} {bound}{also}; pass such a value", name, value
        )


def _refuse(name: str, value: Any, why: str) -> None:
    raise HyperParameterError(f"{WHERE}({name}={value!r}) is not supported: {why}", name, value)


def kl_options(coef: float, lag: int | None, step: int) -> dict[str, Any]:
    """ART 0.5.23's pipeline KL penalty (`art/pipeline_trainer/trainer.py`) as `backend.train`
    keywords for the step trained from committed step `step`: none when `coef` is 0; else the
    penalty against the sampling logprobs (`kl_penalty_source="sample"`) with the base model
    as reference (`lag` None; ART: step 0, whose LoRA B is 0) or committed step max(0, step - lag)."""
    if coef <= 0:
        return {}
    options: dict[str, Any] = {"kl_penalty_coef": coef, "kl_penalty_source": "sample"}
    if lag is not None:
        options["kl_penalty_reference_step"] = max(0, step - lag)
    return options


def make_group_rollout_fn(
    single_rollout_fn: SingleRolloutFn[ScenarioT, ConfigT], n: int = 4
) -> RolloutFn[ScenarioT, ConfigT]:
    """A `RolloutFn` running `single_rollout_fn(model, scenario, config)` `n` times at once; a
    rollout that raises becomes an exception record of the group (ART's).

    Raises:
        HyperParameterError: `n` is not a whole number of at least 1 (ART returns an empty
            group for n <= 0, which training could only skip).
    """
    _check("n", n, 1, where="make_group_rollout_fn")

    async def group_rollout(model: Any, scenario: ScenarioT, config: ConfigT) -> TrajectoryGroup:
        results = await asyncio.gather(
            *(single_rollout_fn(model, scenario, config) for _ in range(n)), return_exceptions=True
        )
        return TrajectoryGroup(results)

    return group_rollout


async def _scenario_stream(scenarios: AsyncIterator[Any] | Iterable[Any]) -> AsyncIterator[Any]:
    if isinstance(scenarios, AsyncIterator):
        async for scenario in scenarios:
            yield scenario
    else:
        for scenario in scenarios:
            yield scenario


def served_mode_problem(backend: Any) -> str | None:
    """Why `backend` cannot run a pipeline (a replica shares its GPUs with the trainer and
    sleeps while a step trains), or None. A backend without a started runtime (not registered
    yet, or not a `MegatronBackend`) has no problem yet."""
    runtime = getattr(backend, "_runtime", None)
    topology = getattr(runtime, "topology", None)
    shared = [r.process_name for r in getattr(topology, "replicas", ()) if r.shared_gpus]
    if not shared:
        return None
    return (
        f"PipelineTrainer runs only in dedicated mode, but replicas {shared} share their GPUs with "
        "the trainer and pause inference while a step trains; give the trainer and the replicas "
        "their own GPUs (TrainableModel _internal_config trainer_gpu_ids and inference_gpu_ids, "
        "or InferenceSpec.shared_gpus=False)"
    )


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
    """Rollouts, training and eval as a pipeline (ART's constructor; see the module docstring).

    Args:
        model: a registered `TrainableModel`; backend: its backend (`MegatronBackend` or
            `LocalBackend`, dedicated mode).
        rollout_fn: `(model, scenario, config) -> TrajectoryGroup`; scenarios: an iterable or
            async iterator of scenario dicts, consumed once; config: passed through.
        eval_fn: `(model, step, config)` -> trajectories/groups (logged as "val") or a dict
            split -> them; run at the start (`eval_at_start`) and every `eval_every_n_steps`
            (0: never after the start).
        num_rollout_workers: rollouts in flight at once (>= 1).
        min_batch_size / max_batch_size: groups per step (max None: 10 * min).
        max_steps_off_policy: how many steps a group's sampling policy may trail the policy
            the step trains from (>= 0; 0 = on-policy: no rollout overlaps a step).
        queue_maxsize: finished groups waiting for training (None: max(1,
            max_steps_off_policy * max_batch_size)).
        learning_rate, loss_fn ("cispo" or "ppo"), normalize_advantages,
            grad_accumulation_sequences, optimizer_save_interval, packed_sequence_length:
            passed to `backend.train`.
        kl_penalty_coef, kl_penalty_step_lag: ART 0.5.23's KL penalty against the sampling
            logprobs, reference the base model or the committed step `lag` steps back (`kl_options`).
        num_rollout_workers / min_batch_size None: ART's defaults 16 / 4. ART 0.5.23's
            `pipeline`, `autotune`, `rollout_executor` and `limit_mean_steps_off_policy` are
            refused unless None; `score_reference_*` (ART's throughput score) are accepted with
            a logged line.
        max_steps: steps this call trains (None: until the scenarios run out).
        discard_queue_multiplier: training stops (model collapse) once
            `discard_queue_multiplier * min_batch_size` groups with no reward variance piled up
            between two steps.
        log_interval_seconds: seconds between status lines; status_ewa_alpha: the weight of
            the newest step in the status line's mean step time (0 < alpha <= 1);
            total_scenarios: shown as the status line's denominator.
        resume: continue from the scenario offset and eval bookkeeping kept in state.json.

    Raises:
        HyperParameterError: a value out of range, or an ART option art-mega does not
            implement at anything but its do-nothing value (`loss_fn_config`, `adam_params`,
            `save_checkpoint=False`, `checkpoint_retention_strategy`,
            `checkpoint_retention_interval`), one sentence each.
        UserError: the backend shares GPUs between trainer and replicas (`served_mode_problem`).
    """

    def __init__(
        self,
        model: Any,
        backend: Any,
        rollout_fn: RolloutFn[ScenarioT, ConfigT],
        scenarios: AsyncIterator[ScenarioT] | Iterable[ScenarioT],
        config: ConfigT,
        eval_fn: EvalFn[ConfigT] | None = None,
        *,
        num_rollout_workers: int | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        queue_maxsize: int | None = None,
        pipeline: Any = None,
        autotune: Any = None,
        learning_rate: float = 1e-5,
        loss_fn: str = "cispo",
        loss_fn_config: dict | None = None,
        normalize_advantages: bool = True,
        grad_accumulation_sequences: int | None = None,
        adam_params: object | None = None,
        kl_penalty_coef: float = 0.0,
        kl_penalty_step_lag: int | None = None,
        max_steps: int | None = None,
        discard_queue_multiplier: int = 100,
        max_steps_off_policy: int = 4,
        limit_mean_steps_off_policy: float | None = None,
        score_reference_groups_per_step: float | None = None,
        score_reference_rollouts_per_group: float | None = None,
        log_interval_seconds: float = 60.0,
        status_ewa_alpha: float = 0.2,
        total_scenarios: int | None = None,
        eval_every_n_steps: int = 20,
        eval_at_start: bool = True,
        save_checkpoint: bool = True,
        optimizer_save_interval: int = 5,
        checkpoint_retention_strategy: Any = None,
        checkpoint_retention_interval: int = 1,
        resume: bool = True,
        rollout_executor: Any = None,
        packed_sequence_length: int | None = None,
    ) -> None:
        num_rollout_workers = 16 if num_rollout_workers is None else num_rollout_workers  # ART's defaults
        min_batch_size = 4 if min_batch_size is None else min_batch_size
        for name, value, instead in (
            (
                "pipeline",
                pipeline,
                "pass num_rollout_workers=, min_batch_size=, max_batch_size=, queue_maxsize= directly",
            ),
            (
                "autotune",
                autotune,
                "art-mega has no pipeline autotuner; set num_rollout_workers= and the batch sizes",
            ),
            (
                "rollout_executor",
                rollout_executor,
                "the pipeline runs its rollouts in this process; leave it out",
            ),
            (
                "limit_mean_steps_off_policy",
                limit_mean_steps_off_policy,
                "art-mega bounds staleness per group with max_steps_off_policy; use that",
            ),
        ):
            if value is not None:
                _refuse(name, value, instead)
        _check("grad_accumulation_sequences", grad_accumulation_sequences, 1, none=True)
        _check("kl_penalty_coef", kl_penalty_coef, 0, whole=False)
        _check("kl_penalty_step_lag", kl_penalty_step_lag, 1, none=True)
        _check("optimizer_save_interval", optimizer_save_interval, 1)
        for name, value in (
            ("score_reference_groups_per_step", score_reference_groups_per_step),
            ("score_reference_rollouts_per_group", score_reference_rollouts_per_group),
        ):
            _check(name, value, 0, whole=False, strict=True, none=True)
            if value is not None:
                log.info(
                    "%s(%s=%r): it scales ART's pipeline throughput score; art-mega's status line "
                    "shows groups and steps per second instead",
                    WHERE,
                    name,
                    value,
                )
        _check("num_rollout_workers", num_rollout_workers, 1)
        _check("min_batch_size", min_batch_size, 1)
        _check("max_batch_size", max_batch_size, min_batch_size, none=True)
        _check("max_steps_off_policy", max_steps_off_policy, 0)
        _check("queue_maxsize", queue_maxsize, 1, none=True)
        _check("max_steps", max_steps, 0, none=True)
        _check("discard_queue_multiplier", discard_queue_multiplier, 1)
        _check("log_interval_seconds", log_interval_seconds, 0, whole=False, strict=True)
        _check("status_ewa_alpha", status_ewa_alpha, 0, whole=False, strict=True)
        if status_ewa_alpha > 1:
            raise HyperParameterError(
                f"{WHERE}(status_ewa_alpha={status_ewa_alpha!r}) must be at most 1; pass a weight in (0, 1]",
                "status_ewa_alpha",
                status_ewa_alpha,
            )
        _check("total_scenarios", total_scenarios, 1, none=True)
        _check("eval_every_n_steps", eval_every_n_steps, 0)
        for name, value in (
            ("eval_at_start", eval_at_start),
            ("normalize_advantages", normalize_advantages),
            ("resume", resume),
        ):
            if not isinstance(value, bool):
                raise HyperParameterError(f"{WHERE}({name}={value!r}) must be True or False", name, value)
        if loss_fn not in ("cispo", "ppo"):
            raise HyperParameterError(
                f"{WHERE}(loss_fn={loss_fn!r}) must be 'cispo' or 'ppo' (as ART's dedicated LocalBackend)",
                "loss_fn",
                loss_fn,
            )
        if loss_fn_config is not None:
            _refuse(
                "loss_fn_config",
                loss_fn_config,
                "ART's dedicated LocalBackend requires None too; leave it out",
            )
        if adam_params is not None:
            _refuse(
                "adam_params", adam_params, "ART's dedicated LocalBackend requires None too; leave it out"
            )
        if save_checkpoint is not True:
            _refuse(
                "save_checkpoint",
                save_checkpoint,
                "art-mega commits a checkpoint every step (the replicas load the step's adapter from it); leave it True",
            )
        if checkpoint_retention_strategy is not None:
            _refuse(
                "checkpoint_retention_strategy",
                checkpoint_retention_strategy,
                "art-mega has no retention strategies; prune with model.delete_checkpoints() after training",
            )
        if checkpoint_retention_interval != 1:
            _refuse(
                "checkpoint_retention_interval",
                checkpoint_retention_interval,
                "it paces checkpoint_retention_strategy, which art-mega does not implement; leave it at 1",
            )
        problem = served_mode_problem(backend)
        if problem is not None:
            raise UserError(problem)
        self.model = model
        self.backend = backend
        self.rollout_fn = rollout_fn
        self.config = config
        self.eval_fn = eval_fn
        self.num_rollout_workers = num_rollout_workers
        self.min_batch_size = min_batch_size
        self.max_batch_size = 10 * min_batch_size if max_batch_size is None else max_batch_size
        self.max_steps_off_policy = max_steps_off_policy
        self.queue_maxsize = (
            max(1, max_steps_off_policy * self.max_batch_size) if queue_maxsize is None else queue_maxsize
        )
        self.learning_rate = learning_rate
        self.loss_fn = loss_fn
        self.normalize_advantages = normalize_advantages
        self.grad_accumulation_sequences = grad_accumulation_sequences
        self.kl_penalty_coef = float(kl_penalty_coef)
        self.kl_penalty_step_lag = kl_penalty_step_lag
        self.optimizer_save_interval = optimizer_save_interval
        self.packed_sequence_length = packed_sequence_length
        self.max_steps = max_steps
        self.discard_queue_multiplier = discard_queue_multiplier
        self.log_interval_seconds = float(log_interval_seconds)
        self.status_ewa_alpha = float(status_ewa_alpha)
        self.total_scenarios = total_scenarios
        self.eval_every_n_steps = eval_every_n_steps
        self.eval_at_start = eval_at_start
        self.resume = resume
        self._scenarios = _scenario_stream(scenarios)
        self._scenario_lock = asyncio.Lock()
        self._policy_updated = asyncio.Condition()
        self._queue: asyncio.Queue[TrajectoryGroup | None] | None = None
        self._evals: asyncio.Queue[int | None] | None = None
        self._zero_variance: list[TrajectoryGroup] = []
        self._ewa_step_s: float | None = None
        self.done = False
        self.policy_version = 0
        """The step of the policy the workers roll out with (the served step)."""
        self.next_training_step = 0
        """The step being trained (its number once committed); equals `policy_version` between steps."""
        self.scenario_offset = 0
        self.discarded_stale_groups = 0
        self.last_eval_step = 0
        self.completed_eval_steps: set[int] = set()
        self.collapsed = False
        """True when training stopped because too many groups had no reward variance."""

    # ----------------------------------------------------------------- the pipeline

    async def train(self, *, handle_signals: bool = True) -> None:
        """Run the stages until `max_steps` steps trained, the scenarios ran out (the groups
        already queued are trained first), `request_stop()`, or a model collapse. With
        `handle_signals`, SIGINT/SIGTERM request a stop (finishing the current step) and the
        previous handlers come back at the end.

        Raises:
            UserError: shared mode (see the constructor); and whatever `backend.train` raises,
                as itself.
            RuntimeError: every rollout of a group raised (naming the first exception).
            ExceptionGroup: several stages failed at once (ART raises the group always).
        """
        problem = served_mode_problem(self.backend)
        if problem is not None:
            raise UserError(problem)
        start_step = await self.model.get_step()
        saved = (self.model.read_state() or {}).get(PIPELINE_STATE_KEY, {}) if self.resume else {}
        self.policy_version = self.next_training_step = start_step
        self.last_eval_step = int(saved.get("last_eval_step", start_step))
        self.completed_eval_steps = {int(s) for s in saved.get("completed_eval_steps", [])}
        for _ in range(int(saved.get("scenario_offset", 0))):
            if await self._next_scenario() is None:
                break
        self._queue = asyncio.Queue(maxsize=self.queue_maxsize)
        self._evals = asyncio.Queue()
        if self.eval_fn is not None and self.eval_at_start:
            self._evals.put_nowait(start_step)
            self.last_eval_step = start_step
        loop = asyncio.get_running_loop()
        installed = []
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous = signal.getsignal(sig)
                loop.add_signal_handler(sig, self.request_stop)
                installed.append((sig, previous))
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._rollout_stage(), name="rollout_stage")
                tasks.create_task(self._training_stage(), name="training_stage")
                tasks.create_task(self._eval_stage(), name="eval_stage")
                tasks.create_task(self._status_loop(), name="status_loop")
        except ExceptionGroup as group:
            # one stage failed and the others were cancelled: raise its own exception (a
            # UserError from backend.train stays one sentence, exit code 2)
            failures = _leaves(group)
            if len(failures) == 1:
                raise failures[0] from None
            raise
        finally:
            for sig, previous in installed:
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous)

    def request_stop(self) -> None:
        """Stop cleanly: no new rollouts or steps; the step in progress finishes."""
        if self.done:
            return
        self.done = True
        loop = asyncio.get_running_loop()
        loop.create_task(self._notify())
        if self._queue is not None and not self._queue.full():
            self._queue.put_nowait(None)
        if self._evals is not None:
            self._evals.put_nowait(None)

    async def _notify(self) -> None:
        async with self._policy_updated:
            self._policy_updated.notify_all()

    def _served_step(self) -> int:
        """The step the replicas serve now (the router's word; `policy_version` where the
        backend has no router or nothing was published yet)."""
        router_of = getattr(self.backend, "policy_router", None)
        step = router_of(self.model).served_step if router_of is not None else None
        return self.policy_version if step is None else step

    async def _next_scenario(self) -> Any:
        async with self._scenario_lock:
            try:
                scenario = await anext(self._scenarios)
            except StopAsyncIteration:
                return None
            self.scenario_offset += 1
            return scenario

    async def _rollout_stage(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            for i in range(self.num_rollout_workers):
                tasks.create_task(self._rollout_worker(i))
        if not self.done:
            await self._put(None)

    async def _rollout_worker(self, worker: int) -> None:
        while not self.done:
            scenario = await self._next_scenario()
            if scenario is None:
                return
            async with self._policy_updated:
                while (
                    not self.done
                    and self.policy_version < self.next_training_step - self.max_steps_off_policy
                ):
                    await self._policy_updated.wait()
            if self.done:
                return
            initial = self._served_step()
            token = self.model.activate_metrics_context("train")
            started = time.monotonic()
            try:
                group = await self.rollout_fn(self.model, scenario, self.config)
            except Exception as exc:  # ART's worker reports a failed rollout and goes on
                print(
                    f"{WHERE} worker {worker}: rollout failed ({type(exc).__name__}): {exc}{_scenario_context(scenario)}"
                )
                continue
            finally:
                token.var.reset(token)
            if not isinstance(group, TrajectoryGroup):
                print(
                    f"{WHERE} worker {worker}: rollout_fn returned {type(group).__name__}, not a TrajectoryGroup; dropped"
                )
                continue
            final = self._served_step()
            for trajectory in group.trajectories:
                if trajectory.initial_policy_version is None:
                    trajectory.initial_policy_version = initial
                if trajectory.final_policy_version is None:
                    trajectory.final_policy_version = final
            _copy_scenario_metadata(group, scenario)
            group.metadata["pipeline_rollout_s"] = time.monotonic() - started
            await self._put(group)

    async def _put(self, item: TrajectoryGroup | None) -> None:
        assert self._queue is not None
        while not self.done:
            try:
                await asyncio.wait_for(self._queue.put(item), timeout=1.0)
                return
            except TimeoutError:
                continue

    def _art_train_options(self, step: int) -> dict[str, Any]:
        """ART 0.5.23's keywords `backend.train` gets for the step trained from committed step
        `step`: `grad_accumulation_sequences` when set, `optimizer_save_interval` when not ART's
        default, and the KL penalty (`kl_options`)."""
        options = kl_options(self.kl_penalty_coef, self.kl_penalty_step_lag, step)
        if self.grad_accumulation_sequences is not None:
            options["grad_accumulation_sequences"] = self.grad_accumulation_sequences
        if self.optimizer_save_interval != 5:
            options["optimizer_save_interval"] = self.optimizer_save_interval
        return options

    async def _training_stage(self) -> None:
        step = self.next_training_step
        stop_at = None if self.max_steps is None else step + self.max_steps
        while not self.done and (stop_at is None or step < stop_at):
            step_started = time.monotonic()
            batch, stale, ended = await self._collect_batch(step)
            idle_s = time.monotonic() - step_started
            self.discarded_stale_groups += stale
            if not batch:
                break
            async with self._policy_updated:
                self.next_training_step = step + 1
                self._policy_updated.notify_all()
            versions = [v for v in map(_initial_version, batch) if v is not None]
            rollout_s = sum(float(g.metadata.pop("pipeline_rollout_s", 0.0)) for g in batch)
            train_started = time.monotonic()
            result = await self.backend.train(
                self.model,
                batch,
                learning_rate=self.learning_rate,
                loss_fn=self.loss_fn,
                normalize_advantages=self.normalize_advantages,
                packed_sequence_length=self.packed_sequence_length,
                allow_stale=True,
                **self._art_train_options(step),
            )
            trainer_s = time.monotonic() - train_started
            step = result.step
            async with self._policy_updated:
                self.policy_version = self.next_training_step = step
                self._policy_updated.notify_all()
            step_s = time.monotonic() - step_started
            a = self.status_ewa_alpha
            self._ewa_step_s = step_s if self._ewa_step_s is None else a * step_s + (1 - a) * self._ewa_step_s
            metrics = {
                "discarded_stale_groups": float(self.discarded_stale_groups),
                "steps_off_policy": sum(step - v for v in versions) / len(versions) if versions else 0.0,
                "offpolicy/stale_group_fraction": sum(v < step - 1 for v in versions) / len(batch),
                "offpolicy/mean_staleness": sum(step - 1 - v for v in versions) / len(versions)
                if versions
                else 0.0,
                "time/step_wall_s": step_s,
                "time/step_trainer_s": trainer_s,
                "time/step_actor_s": rollout_s,
                "throughput/step_trainer_idle_s": idle_s,
                **result.metrics,
            }
            await self.model.log(batch, split="train", step=step, metrics=metrics)
            if self._zero_variance:
                await self.model.log(self._zero_variance[:50], split="discarded", step=step)
                self._zero_variance.clear()
            if (
                self.eval_fn is not None
                and self.eval_every_n_steps
                and step - self.last_eval_step >= self.eval_every_n_steps
            ):
                assert self._evals is not None
                self._evals.put_nowait(step)
                self.last_eval_step = step
            self._persist(step)
            if ended:
                break
        self.done = True
        self._persist(step)
        await self._notify()
        if self._evals is not None:
            self._evals.put_nowait(None)

    async def _collect_batch(self, step: int) -> tuple[list[TrajectoryGroup], int, bool]:
        """(groups to train, stale groups dropped, the scenarios ended) for training from `step`:
        waits for `min_batch_size` usable groups, then takes what is queued up to `max_batch_size`.
        An empty batch means stop (scenarios ended, a stop request, or a model collapse)."""
        assert self._queue is not None
        batch: list[TrajectoryGroup] = []
        stale = 0
        oldest = step - self.max_steps_off_policy
        while len(batch) < self.max_batch_size:
            if len(batch) < self.min_batch_size:
                item = await self._queue.get()
            elif self._queue.empty():
                break
            else:
                item = self._queue.get_nowait()
            if item is None:
                return batch, stale, True
            if not item.trajectories and item.exceptions:
                first = item.exceptions[0]
                raise RuntimeError(
                    f"all {len(item.exceptions)} rollouts of a group failed; the first raised {first.type}: {first.message}"
                )
            version = _initial_version(item)
            if version is not None and version < oldest:
                stale += 1
                continue
            rewards = [t.reward for t in item.trajectories]
            if len(rewards) <= 1 or max(rewards) - min(rewards) <= 1e-12:
                self._zero_variance.append(item)
                if len(self._zero_variance) >= self.discard_queue_multiplier * self.min_batch_size:
                    self.collapsed = True
                    print(
                        f"{WHERE}: model collapse: {len(self._zero_variance)} groups had no reward variance; training "
                        "stopped (lower the learning rate, make rewards vary, or raise discard_queue_multiplier)"
                    )
                    return [], stale, True
                continue
            batch.append(item)
        return batch, stale, False

    async def _eval_stage(self) -> None:
        if self.eval_fn is None:
            return
        assert self._evals is not None
        while True:
            step = await self._evals.get()
            if step is None:
                return
            started = time.monotonic()
            token = self.model.activate_metrics_context("eval")
            try:
                result = await self.eval_fn(self.model, step, self.config)
            except Exception as exc:  # ART reports a failed eval and trains on
                print(f"{WHERE}: eval failed at step {step}: {type(exc).__name__}: {exc}")
                continue
            finally:
                token.var.reset(token)
            splits = result if isinstance(result, dict) else {"val": result}
            timing: dict[str, float] | None = {"time/step_eval_s": time.monotonic() - started}
            for split, items in splits.items():
                groups = [i for i in items if isinstance(i, TrajectoryGroup)]
                loose = [i for i in items if isinstance(i, Trajectory)]
                if loose:
                    groups.append(TrajectoryGroup(loose))
                if groups:
                    await self.model.log(groups, split=split, step=step, metrics=timing)
                    timing = None
            self.completed_eval_steps.add(step)
            self._persist(self.next_training_step)

    async def _status_loop(self) -> None:
        last = time.monotonic()
        while not self.done:
            await asyncio.sleep(min(1.0, self.log_interval_seconds))
            if time.monotonic() - last >= self.log_interval_seconds:
                last = time.monotonic()
                print(self.status_line())

    def status_line(self) -> str:
        """One line: served and training step, queued groups, drops, mean step time, scenarios."""
        queued = 0 if self._queue is None else self._queue.qsize()
        mean = "-" if self._ewa_step_s is None else f"{self._ewa_step_s:.1f}s"
        total = "" if self.total_scenarios is None else f"/{self.total_scenarios}"
        return (
            f"[pipeline] policy {self.policy_version} training {self.next_training_step} | queued {queued} | "
            f"stale dropped {self.discarded_stale_groups} | no-variance {len(self._zero_variance)} | "
            f"step {mean} | scenarios {self.scenario_offset}{total}"
        )

    def _persist(self, step: int) -> None:
        self.model.merge_state(
            {
                PIPELINE_STATE_KEY: {
                    "scenario_offset": self.scenario_offset,
                    "training_step": step,
                    "last_eval_step": self.last_eval_step,
                    "completed_eval_steps": sorted(self.completed_eval_steps),
                }
            }
        )


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions of a (nested) exception group, cancellations left out."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found += _leaves(exc)
        elif not isinstance(exc, asyncio.CancelledError):
            found.append(exc)
    return found


def _initial_version(group: TrajectoryGroup) -> int | None:
    """The oldest policy step that started one of the group's rollouts (None: not recorded)."""
    versions = [t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None]
    return min(versions) if versions else None


def _copy_scenario_metadata(group: TrajectoryGroup, scenario: Any) -> None:
    """ART's: the scalar values of `scenario["metadata"]` go into the group's metadata, as
    `scenario_id` or `scenario_<key>`."""
    metadata = scenario.get("metadata") if isinstance(scenario, dict) else None
    if not isinstance(metadata, dict):
        return
    for key, value in metadata.items():
        if isinstance(key, str) and (value is None or isinstance(value, str | int | float | bool)):
            group.metadata[key if key == "scenario_id" else f"scenario_{key}"] = value


def _scenario_context(scenario: Any) -> str:
    metadata = scenario.get("metadata") if isinstance(scenario, dict) else None
    if not isinstance(metadata, dict):
        return ""
    fields = " ".join(
        f"{k}={metadata[k]!r}" for k in ("scenario_id", "epoch", "scenario_index") if k in metadata
    )
    return f" [{fields}]" if fields else ""
