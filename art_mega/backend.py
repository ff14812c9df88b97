"""MegatronBackend: the runtime, the Megatron trainer ranks and the vLLM replicas behind ART's API.

`MegatronBackend()` owns a local single-host runtime (one agent on loopback, one trainer rank,
one vLLM replica); `MegatronBackend(runtime=runtime)` uses a multi-host one whose topology names
the trainer and the inference replicas. One training step (`train`) reads top to bottom:
advantages -> tokenize -> pack per DP rank -> write the batch -> one job on every rank ->
checkpoint committed -> adapter published to every replica as `<name>@<step>` -> metrics.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import operator
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_mega.errors import UserError
from art_mega.hyperparams import fraction_problem
from art_mega.trainer import checkpoint
from art_mega.trainer.behaviour import BehaviourMonitor
from art_mega.trainer.protocol import (
    TRAINER_STOP,
    EngineConfig,
    ExportJob,
    GRPOLossConfig,
    LoraConfig,
    OptimizerConfig,
    RLJob,
    SFTJob,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """What one `backend.train` did: the new policy step and its metrics (loss/, data/, time/)."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalTrainResult(TrainResult):
    """ART's LocalTrainResult: a `TrainResult` with the new step's checkpoint directory, and ART
    0.5.23's `checkpoint_ready` (an awaitable for a checkpoint still being written; always None
    here: art-mega's step returns once its checkpoint is committed)."""

    checkpoint_path: str | None = None
    checkpoint_ready: Any = field(default=None, repr=False, compare=False)


def default_vllm_python() -> str:
    """$ART_MEGA_VLLM_PYTHON, else this interpreter when vLLM imports here, else `.venv-vllm`
    beside this environment (scripts/install.sh makes it)."""
    if os.environ.get("ART_MEGA_VLLM_PYTHON"):
        return os.environ["ART_MEGA_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    sibling = Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"
    if sibling.exists():
        return str(sibling)
    raise UserError(
        "no vLLM environment: set ART_MEGA_VLLM_PYTHON, pass InferenceSpec(python=...), or run "
        "ART_MEGA_WITH_VLLM=1 bash scripts/install.sh"
    )


TOKENIZER_NICE = 10
"""How much lower than the controller's the priority of the first step's tokenizer load is
(Linux nice, per thread): while the replicas and ranks start beside it on a small machine."""


async def in_lowered_thread(fn: Callable[..., Any], *args: Any, nice: int) -> Any:
    """`fn(*args)` in a new daemon thread whose scheduling priority is `nice` steps lower than
    the caller's (Linux: a thread's own nice value, which only threads it starts inherit;
    elsewhere, or when it cannot be changed, the same priority); its result, or its exception
    raised here.
    Cancelling the wait leaves the thread to end on its own."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

    def run() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except (AttributeError, OSError):
            pass
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except StopIteration as exc:  # a Future cannot hold it (as in asyncio.to_thread)
            outcome = (None, RuntimeError(f"{getattr(fn, '__name__', fn)!r} raised StopIteration"))
            outcome[1].__cause__ = exc
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=run, name=f"art-mega-{getattr(fn, '__name__', 'work')}", daemon=True).start()
    return await done


def replica_python(topology: Any, vllm_python: str | None) -> str:
    """The interpreter every replica of `topology` (a `CompiledTopology`) runs under: each
    `InferenceSpec`'s `python`, else `vllm_python`, else `default_vllm_python()`.

    The backend starts and restarts all replicas from one `ReplicaLaunch`, so the specs must
    agree on it.

    Raises:
        UserError: two inference specs resolve to different interpreters (names both specs and
            interpreters), or no vLLM environment is found.
    """
    chosen: dict[str, str] = {}
    for spec in topology.inference:
        chosen.setdefault(spec.python or vllm_python or default_vllm_python(), spec.name)
    if len(chosen) > 1:
        (first, a), (second, b) = list(chosen.items())[:2]
        raise UserError(
            f"InferenceSpec {a!r} runs vLLM under {first!r} but InferenceSpec {b!r} under {second!r}; "
            "the backend runs every replica under one interpreter, so give the specs the same python"
        )
    return next(iter(chosen), None) or vllm_python or default_vllm_python()


def remote_trainer_hosts(topology: Any) -> dict[str, list[int]]:
    """With a host-local artifact_root: each trainer host other than the controller's -> the DP
    ranks whose batch files its ranks read (sorted); empty with a shared root."""
    cluster = topology.cluster
    if cluster.shared_artifact_root:
        return {}
    needs: dict[str, set[int]] = {}
    for r in topology.trainer_ranks:
        if r.host_id != cluster.controller_host_id:
            needs.setdefault(r.host_id, set()).add(r.dp_rank)
    return {host: sorted(ranks) for host, ranks in needs.items()}


async def check_runtime_idle(runtime: Any) -> None:
    """Refuse to start trainer ranks or replicas on agents that already run some.

    An agent runs one set of trainer ranks, and replica names are the topology's: a second
    backend on the same runtime would fail half-way or stop the first one's processes. One
    signed health call per host, in parallel.

    Raises:
        RuntimeBusyError: names the first such host and its running children.
    """
    from art_mega.errors import RuntimeBusyError

    health = await runtime.health()
    for host, reply in health.items():
        busy = tuple(
            c.child_id for c in reply.children if c.role in ("trainer", "inference") and c.returncode is None
        )
        if busy:
            raise RuntimeBusyError(
                f"host {host} already runs {', '.join(busy)} of another registration on this runtime; "
                "close the backend that started them (await backend.close()) before registering again",
                host,
                busy,
            )


DEFAULT_LEARNING_RATE = 5e-6
"""`backend.train`'s learning rate when neither `learning_rate` nor `config` gives one."""

GRPO_OPTIONS = (
    "learning_rate",
    "loss_fn",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "kl_beta",
    "tis_cap",
    "scale_rewards",
    "normalize_advantages",
    "advantage_balance",
    "kl_penalty_coef",
    "truncated_importance_sampling",
    "precalculate_logprobs",
    "mask_prob_ratio",
    "max_negative_advantage_importance_sampling_weight",
    "kimi_k2_tau",
    "num_trajectories_learning_rate_multiplier_power",
    "kl_ref_adapter_path",
    "kl_penalty_reference_step",
    "kl_penalty_source",
    "optimizer_save_interval",
    "final_training_step",
    "config",
    "allow_stale",
    "drop_nonfinite_rewards",
    "allow_training_without_logprobs",
    "grad_accumulation_sequences",
    "packed_sequence_length",
    "logprob_calculation_chunk_size",
)
"""The keywords `MegatronBackend.train` takes (ART's `LocalBackend.train` names mean what they
mean there; `kl_beta`, `tis_cap`, `allow_stale` and `drop_nonfinite_rewards` are art-mega's)."""


@dataclass(frozen=True)
class RefusedOption:
    """An ART `train` option art-mega does not implement: accepted only at `off` (where ART does
    nothing either), else refused with `why` (what it does in ART and what to do instead)."""

    off: tuple[Any, ...]
    why: str

    def is_off(self, value: Any) -> bool:
        return any(value is o or (type(value) is type(o) and value == o) for o in self.off)


_NO_MOE = "art-mega neither records nor replays MoE routing, so remove it"
ART_OPTION_HINTS: dict[str, RefusedOption] = {
    "loss_fn_config": RefusedOption(
        (None,), "ART's LocalBackend refuses it too; choose the objective with loss_fn='cispo' or 'ppo'"
    ),
    "adam_params": RefusedOption((None,), "ART's LocalBackend refuses it too; remove it"),
    "scale_learning_rate_by_reward_std_dev": RefusedOption(
        (False,),
        "ART 0.5.18 takes it but no longer applies it (its LocalBackend ignores it); scale "
        "learning_rate yourself",
    ),
    "plot_tensors": RefusedOption((False,), "art-mega does not plot the packed tensors, so remove it"),
    "save_checkpoint": RefusedOption(
        (True,),
        "every art-mega step commits its checkpoint (the served adapter is read from it), so remove it",
    ),
    "verbose": RefusedOption((False,), "art-mega reports each step in its metrics and logs, so remove it"),
    "kl_penalty_step_lag": RefusedOption(
        (None,),
        "art-mega does not keep a lagged KL reference; pass kl_penalty_reference_step=<a committed step> instead",
    ),
    "moe_routing_replay_bundle": RefusedOption((None,), _NO_MOE),
    "moe_routing_replay_path": RefusedOption((None,), _NO_MOE),
    "moe_routing_replay_strict": RefusedOption((False,), _NO_MOE),
    "ppo": RefusedOption(
        (),
        "backend.train takes ART's loss_fn='ppo' or 'cispo' (ppo is the dev.TrainConfig key of model.train(_config=...))",
    ),
}
"""ART `train` options art-mega does not implement, with the value at which each does nothing."""


def check_grpo_options(
    *,
    learning_rate: Any,
    importance_sampling_level: Any,
    epsilon: Any,
    epsilon_high: Any,
    kl_beta: Any,
    tis_cap: Any,
    scale_rewards: Any,
    config: Any,
    allow_stale: Any,
    drop_nonfinite_rewards: Any,
    unknown: Mapping[str, Any],
    allow_training_without_logprobs: Any = False,
    loss_fn: Any = "cispo",
    normalize_advantages: Any = True,
    advantage_balance: Any = 0.0,
    kl_penalty_coef: Any = 0.0,
    truncated_importance_sampling: Any = None,
    precalculate_logprobs: Any = False,
    mask_prob_ratio: Any = False,
    max_negative_advantage_importance_sampling_weight: Any = None,
    kimi_k2_tau: Any = None,
    num_trajectories_learning_rate_multiplier_power: Any = 0.0,
    kl_ref_adapter_path: Any = None,
    logprob_calculation_chunk_size: Any = None,
    kl_penalty_source: Any = "current_learner",
) -> tuple[float, dict[str, Any]]:
    """Check `backend.train`'s options before anything runs; returns (learning rate, the
    `GRPOLossConfig` fields of the job).

    learning_rate: finite > 0; loss_fn: "cispo" (ART's default) or "ppo"; epsilon,
    epsilon_high: None (ART's default for loss_fn: cispo 1.0 and 4.0, ppo 0.2 and epsilon) or
    finite >= 0; importance_sampling_level: token, sequence, average or geometric_average;
    kl_beta, kl_penalty_coef, kimi_k2_tau (or None): finite >= 0; tis_cap,
    truncated_importance_sampling, max_negative_advantage_importance_sampling_weight: None or
    finite > 0 (not tis_cap and truncated_importance_sampling together); advantage_balance:
    in [-1, 1]; num_trajectories_learning_rate_multiplier_power: finite; the flags: bools;
    kl_ref_adapter_path: None or a PEFT adapter folder (or a checkpoint folder holding one in
    `adapter/`) on this host, used as the reference when kl_penalty_coef or kl_beta is > 0;
    logprob_calculation_chunk_size: None (whole rows) or a whole number >= 1 (ART's memory knob:
    the trainer's logprobs over chunks of that many positions, `logprobs.token_logprobs`).
    config: None or a `TrainConfig`, whose learning_rate replaces `learning_rate` (a
    `learning_rate` other than the default must agree with it), whose beta is `kl_beta` and
    whose kl_penalty_coef is `kl_penalty_coef` unless those are non-zero (then they must agree),
    and whose kl_penalty_source is `kl_penalty_source` unless that is not ART's default.
    kl_penalty_source: ART 0.5.23's "current_learner" (the penalty's KL is new - ref) or
    "sample" (sampling logprobs - ref, `loss.grpo_loss`). `unknown` holds the other keywords: an ART option of `ART_OPTION_HINTS` at its off value
    passes, any other is refused.

    Raises:
        HyperParameterError: the first option out of range or of the wrong type, an ART option
            art-mega does not implement (with what to do instead), or an unknown keyword.
    """
    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import (
        IMPORTANCE_SAMPLING_LEVELS,
        LOSS_FNS,
        between_problem,
        bool_problem,
        check,
        finite_problem,
        nonnegative_problem,
        one_of_problem,
        optional,
        positive_problem,
        whole_problem,
    )
    from art_mega.model import TrainConfig

    where = "backend.train"
    for name, value in unknown.items():
        refused = ART_OPTION_HINTS.get(name)
        if refused is None:
            raise HyperParameterError(
                f"{where} got an unknown keyword {name}={value!r}; use one of {', '.join(GRPO_OPTIONS)}",
                name,
                value,
            )
        if not refused.is_off(value):
            raise HyperParameterError(f"{where} got ART's {name}={value!r}; {refused.why}", name, value)
    if config is not None:
        if not isinstance(config, TrainConfig):
            raise HyperParameterError(
                f"{where}(config={config!r}) must be an art_mega.TrainConfig; pass e.g. "
                "config=art.TrainConfig(learning_rate=5e-6)",
                "config",
                config,
            )
        if learning_rate != DEFAULT_LEARNING_RATE and learning_rate != config.learning_rate:
            raise HyperParameterError(
                f"{where}(learning_rate={learning_rate!r}) disagrees with config.learning_rate="
                f"{config.learning_rate!r}; set one of them",
                "learning_rate",
                learning_rate,
            )
        learning_rate = config.learning_rate
        for name, mine, theirs in (
            ("kl_beta", kl_beta, "beta"),
            ("kl_penalty_coef", kl_penalty_coef, "kl_penalty_coef"),
        ):
            given = getattr(config, theirs)
            if given and mine and given != mine:
                raise HyperParameterError(
                    f"{where}({name}={mine!r}) disagrees with config.{theirs}={given!r}; set one of them",
                    name,
                    mine,
                )
        kl_beta = kl_beta or config.beta
        kl_penalty_coef = kl_penalty_coef or config.kl_penalty_coef
        if kl_penalty_source == "current_learner":
            kl_penalty_source = config.kl_penalty_source
        elif config.kl_penalty_source not in ("current_learner", kl_penalty_source):
            raise HyperParameterError(
                f"{where}(kl_penalty_source={kl_penalty_source!r}) disagrees with config.kl_penalty_source="
                f"{config.kl_penalty_source!r}; set one of them",
                "kl_penalty_source",
                kl_penalty_source,
            )
    check(where, "learning_rate", learning_rate, positive_problem, "5e-6")
    check(where, "loss_fn", loss_fn, one_of_problem(*LOSS_FNS), "'cispo'")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise HyperParameterError(
            f"{where}(importance_sampling_level={importance_sampling_level!r}) must be 'token' or "
            "'sequence' (GSPO), or ART's 'average' or 'geometric_average'",
            "importance_sampling_level",
            importance_sampling_level,
        )
    check(where, "epsilon", epsilon, optional(nonnegative_problem), "0.2")
    check(where, "epsilon_high", epsilon_high, optional(nonnegative_problem), "0.28")
    check(where, "kl_beta", kl_beta, nonnegative_problem, "0.04")
    check(where, "kl_penalty_coef", kl_penalty_coef, nonnegative_problem, "0.1")
    check(
        where, "kl_penalty_source", kl_penalty_source, one_of_problem("current_learner", "sample"), "'sample'"
    )
    check(where, "tis_cap", tis_cap, optional(positive_problem), "2.0")
    check(
        where,
        "truncated_importance_sampling",
        truncated_importance_sampling,
        optional(positive_problem),
        "2.0",
    )
    if tis_cap is not None and truncated_importance_sampling is not None:
        raise HyperParameterError(
            f"{where}(tis_cap={tis_cap!r}) and truncated_importance_sampling={truncated_importance_sampling!r} "
            "are two TIS caps; set one (tis_cap=C is truncated_importance_sampling=C with precalculate_logprobs=True)",
            "tis_cap",
            tis_cap,
        )
    check(
        where,
        "max_negative_advantage_importance_sampling_weight",
        max_negative_advantage_importance_sampling_weight,
        optional(positive_problem),
        "2.0",
    )
    check(where, "kimi_k2_tau", kimi_k2_tau, optional(nonnegative_problem), "0.5")
    check(where, "advantage_balance", advantage_balance, between_problem(-1.0, 1.0), "0.0")
    check(
        where,
        "num_trajectories_learning_rate_multiplier_power",
        num_trajectories_learning_rate_multiplier_power,
        finite_problem,
        "0.5",
    )
    for name, value in (
        ("scale_rewards", scale_rewards),
        ("normalize_advantages", normalize_advantages),
        ("precalculate_logprobs", precalculate_logprobs),
        ("mask_prob_ratio", mask_prob_ratio),
        ("allow_stale", allow_stale),
        ("drop_nonfinite_rewards", drop_nonfinite_rewards),
        ("allow_training_without_logprobs", allow_training_without_logprobs),
    ):
        check(where, name, value, bool_problem, "True")
    check(
        where,
        "logprob_calculation_chunk_size",
        logprob_calculation_chunk_size,
        optional(whole_problem(1)),
        "8",
    )
    ppo = loss_fn == "ppo"
    epsilon = (0.2 if ppo else 1.0) if epsilon is None else epsilon
    epsilon_high = (None if ppo else 4.0) if epsilon_high is None else epsilon_high
    loss = {
        "loss_fn": loss_fn,
        "importance_sampling_level": importance_sampling_level,
        "epsilon_low": float(epsilon),
        "epsilon_high": None if epsilon_high is None else float(epsilon_high),
        "kl_beta": float(kl_beta),
        "tis_cap": None if tis_cap is None else float(tis_cap),
        "truncated_importance_sampling": (
            None if truncated_importance_sampling is None else float(truncated_importance_sampling)
        ),
        "mask_prob_ratio": mask_prob_ratio,
        "max_negative_advantage_importance_sampling_weight": (
            None
            if max_negative_advantage_importance_sampling_weight is None
            else float(max_negative_advantage_importance_sampling_weight)
        ),
        "kimi_k2_tau": None if kimi_k2_tau is None else float(kimi_k2_tau),
        "kl_penalty_coef": float(kl_penalty_coef),
        "precalculate_logprobs": precalculate_logprobs,
        "kl_ref_adapter_path": _reference_adapter(kl_ref_adapter_path, kl_penalty_coef or kl_beta),
    }
    if kl_penalty_source != "current_learner":  # absent: GRPOLossConfig's ART default
        loss["kl_penalty_source"] = kl_penalty_source
    if logprob_calculation_chunk_size is not None:  # absent: GRPOLossConfig's None, whole rows
        loss["logprob_calculation_chunk_size"] = int(logprob_calculation_chunk_size)
    return float(learning_rate), loss


def check_optimizer_snapshots(interval: Any, final_step: Any, config: Any) -> None:
    """ART 0.5.23's `optimizer_save_interval` (whole >= 1, ART's default 5) and
    `final_training_step` (None or whole >= 1), the keywords or `config`'s (a checked
    `TrainConfig` or None). ART snapshots the optimizer state every `interval` steps and at the
    final step (`art/megatron/train.py`); art-mega commits it with every step's checkpoint,
    which covers every choice, so a value other than ART's default is accepted with one logged line.

    Raises:
        HyperParameterError: a value that is not a whole number in range (named).
    """
    from art_mega.hyperparams import check, optional, whole_problem

    where = "backend.train"
    if config is not None:
        interval = config.optimizer_save_interval if interval == 5 else interval
        final_step = config.final_training_step if final_step is None else final_step
    check(where, "optimizer_save_interval", interval, whole_problem(1), "5")
    check(where, "final_training_step", final_step, optional(whole_problem(1)), "100")
    for name, value, default in (
        ("optimizer_save_interval", interval, 5),
        ("final_training_step", final_step, None),
    ):
        if value != default and (name, value) not in _LOGGED_SNAPSHOT_OPTIONS:
            _LOGGED_SNAPSHOT_OPTIONS.add((name, value))
            log.info(
                "%s(%s=%r): art-mega commits the optimizer state with every step's checkpoint, "
                "so every step resumes exactly (ART snapshots it less often)",
                where,
                name,
                value,
            )


_LOGGED_SNAPSHOT_OPTIONS: set[tuple[str, Any]] = set()
"""The (option, value) pairs `check_optimizer_snapshots` has logged (once per process)."""


def check_packing(
    grad_accumulation_sequences: Any,
    packed_sequence_length: Any,
    config: Any,
    power: float,
    seq_len: int,
) -> tuple[int | None, int]:
    """ART's `grad_accumulation_sequences` (the keyword, or `config`'s, a checked `TrainConfig`
    or None) and `packed_sequence_length` for `backend.train`; returns (packed rows per
    optimizer step over all DP ranks, None: ART's default, the DP ranks (`rl_step_batches`);
    the row length in tokens).

    grad_accumulation_sequences: None or a whole number >= 1 (a multiple of the DP ranks,
    `check_accumulation`), not with a non-zero `power` (ART's
    num_trajectories_learning_rate_multiplier_power scales a step's rate by the trajectories
    it trains; ART's Megatron trainer, the one that accumulates, does not apply it);
    packed_sequence_length: None (`seq_len`) or a whole number from 2 to `seq_len` (ART refuses
    one above the model's max_seq_length too).

    Raises:
        HyperParameterError: the first of them out of range or of the wrong type, the keyword
            and `config` disagreeing, or accumulation with a non-zero power.
    """
    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import check, optional, whole_problem

    where = "backend.train"
    check(where, "grad_accumulation_sequences", grad_accumulation_sequences, optional(whole_problem(1)), "4")
    check(where, "packed_sequence_length", packed_sequence_length, optional(whole_problem(2)), str(seq_len))
    given = None if config is None else config.grad_accumulation_sequences
    if given is not None and grad_accumulation_sequences is not None and given != grad_accumulation_sequences:
        raise HyperParameterError(
            f"{where}(grad_accumulation_sequences={grad_accumulation_sequences!r}) disagrees with "
            f"config.grad_accumulation_sequences={given!r}; set one of them",
            "grad_accumulation_sequences",
            grad_accumulation_sequences,
        )
    accumulate = grad_accumulation_sequences if grad_accumulation_sequences is not None else given
    if packed_sequence_length is not None and packed_sequence_length > seq_len:
        raise HyperParameterError(
            f"{where}(packed_sequence_length={packed_sequence_length!r}) exceeds the trainer's "
            f"seq_len={seq_len}; pass at most {seq_len} or raise MegatronBackend(seq_len=...) "
            "(init_args.max_seq_length)",
            "packed_sequence_length",
            packed_sequence_length,
        )
    if accumulate is not None and power != 0:
        raise HyperParameterError(
            f"{where}(num_trajectories_learning_rate_multiplier_power={power!r}) scales the rate "
            f"of one step over all the call's trajectories, so it cannot be combined with "
            f"grad_accumulation_sequences={accumulate!r} (ART's Megatron trainer does not apply it "
            "either); set one of them",
            "num_trajectories_learning_rate_multiplier_power",
            power,
        )
    rows = seq_len if packed_sequence_length is None else int(packed_sequence_length)
    return (None if accumulate is None else int(accumulate)), rows


def check_accumulation(grad_accumulation_sequences: int, dp: int) -> int:
    """`grad_accumulation_sequences` (packed rows per optimizer step, over all DP ranks) when
    it splits evenly over the trainer's `dp` data-parallel ranks (ART's Megatron trainer
    requires it too).

    Raises:
        HyperParameterError: it is not a multiple of `dp` (named, with the nearest ones).
    """
    from art_mega.errors import HyperParameterError

    if grad_accumulation_sequences % dp:
        lower = grad_accumulation_sequences // dp * dp
        nearest = " or ".join(str(n) for n in (lower, lower + dp) if n > 0)
        raise HyperParameterError(
            f"backend.train(grad_accumulation_sequences={grad_accumulation_sequences!r}) does not "
            f"split over the trainer's {dp} data-parallel ranks; pass a multiple of {dp}, e.g. {nearest}",
            "grad_accumulation_sequences",
            grad_accumulation_sequences,
        )
    return grad_accumulation_sequences


def rl_step_batches(
    documents: list[Any], seq_len: int, dp: int, rows_per_step: int | None
) -> tuple[list[Any], int]:
    """An rl job's batch files and optimizer steps: `documents` packed into rows of `seq_len`
    tokens, `rows_per_step` rows per optimizer step over the `dp` DP ranks (ART's
    grad_accumulation_sequences; None: `dp`, ART's MegatronBackend default, so one row per
    rank and step); returns (one `TrainBatch` per DP rank, `batch.pack_steps`; rows per step
    on each rank, `RLJob.step_rows`).

    Raises:
        HyperParameterError: `rows_per_step` is not a multiple of `dp` (`check_accumulation`).
        ValueError: a document longer than `seq_len`.
    """
    from art_mega.trainer.batch import pack_steps

    rows = check_accumulation(dp if rows_per_step is None else rows_per_step, dp)
    return pack_steps(documents, seq_len, dp, rows), rows // dp


def _reference_adapter(path: Any, kl: float) -> str | None:
    """`kl_ref_adapter_path` as the adapter folder the ranks read (a checkpoint's step folder
    is one), or None.

    Raises:
        HyperParameterError: not None, a str or a path; no adapter_config.json there; or no KL
            term reads it (kl_penalty_coef and kl_beta both 0).
    """
    from art_mega.errors import HyperParameterError

    if path is None:
        return None
    where = f"backend.train(kl_ref_adapter_path={path!r})"
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise HyperParameterError(
            f"{where} must be the path of a PEFT adapter folder; pass e.g. "
            "kl_ref_adapter_path='.art/.../checkpoints/0003'",
            "kl_ref_adapter_path",
            path,
        )
    folder = checkpoint.adapter_dir(Path(path))
    if not (folder / "adapter_config.json").is_file():
        raise HyperParameterError(
            f"{where} holds no adapter_config.json; name a PEFT LoRA adapter folder of this base "
            "model, or a committed checkpoint (step folder) of it",
            "kl_ref_adapter_path",
            path,
        )
    if not kl:
        raise HyperParameterError(
            f"{where} is the KL reference, but no KL term reads it; set kl_penalty_coef (ART's "
            "KL-penalised advantages) or kl_beta above 0, or remove it",
            "kl_ref_adapter_path",
            path,
        )
    return str(folder.resolve())


ART_TRAINER_ARGS = {
    "adam_beta1": 0.9,
    "adam_beta2": 0.99,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.1,
    "max_grad_norm": 0.1,
}
"""ART's optimizer defaults for RL (`art/dev/get_model_config.py` trainer_args: AdamW betas
(0.9, 0.99), HF's epsilon 1e-8, weight decay 0.1, gradient-norm clip 0.1); ART's SFT steps use
weight decay 0 and clip 1.0 (`ART_SFT_OPTIMIZER`) with the same betas and epsilon."""

ART_SFT_OPTIMIZER = {"weight_decay": 0.0, "clip_grad": 1.0}


def art_optimizer(trainer_args: Mapping[str, Any]) -> tuple[Any, float, float]:
    """The trainer ranks' optimizer from ART's `trainer_args` (InternalModelConfig; absent keys:
    `ART_TRAINER_ARGS`): (`OptimizerConfig` with the betas and epsilon and SFT's decay and
    clip, RL's weight decay, RL's clip), as ART trains: RL steps with `weight_decay` and
    `max_grad_norm`, SFT steps with weight decay 0 and clip 1.0.

    Raises:
        HyperParameterError: a value out of its range (names the trainer_args key).
    """
    from art_mega.hyperparams import between_problem, check, nonnegative_problem, positive_problem

    args = {**ART_TRAINER_ARGS, **{k: v for k, v in trainer_args.items() if k in ART_TRAINER_ARGS}}
    where = "TrainableModel(_internal_config=...trainer_args)"
    for name in ("adam_beta1", "adam_beta2"):
        check(where, name, args[name], between_problem(0.0, 0.999999), "0.9")
    check(where, "adam_epsilon", args["adam_epsilon"], positive_problem, "1e-8")
    check(where, "weight_decay", args["weight_decay"], nonnegative_problem, "0.1")
    check(where, "max_grad_norm", args["max_grad_norm"], nonnegative_problem, "0.1")
    optimizer = OptimizerConfig(
        beta1=float(args["adam_beta1"]),
        beta2=float(args["adam_beta2"]),
        eps=float(args["adam_epsilon"]),
        **ART_SFT_OPTIMIZER,
    )
    return optimizer, float(args["weight_decay"]), float(args["max_grad_norm"])


def trajectories_learning_rate(learning_rate: float, documents: int, power: float) -> float:
    """ART's `num_trajectories_learning_rate_multiplier_power`: `learning_rate` * documents **
    power, where `documents` is the number of tokenized trajectories (histories) the call
    trains; every optimizer step of the call takes that rate (ART's LocalBackend counts those
    packed into each step's sequence; its MegatronBackend does not apply the power). A call
    with no document keeps `learning_rate` (it trains nothing).

    Raises:
        HyperParameterError: the product is not a float32 learning rate > 0 (named, with the count).
    """
    import math

    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import positive_problem

    if documents == 0 or power == 0:
        return learning_rate
    try:
        scaled = learning_rate * float(documents) ** power
    except OverflowError:
        scaled = math.inf
    why = positive_problem(scaled)
    if why is not None:
        raise HyperParameterError(
            f"backend.train(num_trajectories_learning_rate_multiplier_power={power!r}) makes the "
            f"learning rate {learning_rate!r} * {documents} ** {power!r} = {scaled!r}, which {why}; "
            "use a smaller power",
            "num_trajectories_learning_rate_multiplier_power",
            power,
        )
    return scaled


def checked_groups(
    trajectory_groups: Any, drop_nonfinite_rewards: bool, scale_rewards: bool = True
) -> tuple[list[Any], int]:
    """`backend.train`'s groups after the input and reward checks, and how many trajectories
    with a NaN or inf reward were left out (only with `drop_nonfinite_rewards`); advantages are
    checked as the step computes them (`scale_rewards`).

    Raises:
        TrainInputError: see `trajectories.check_train_groups`.
        NonFiniteValueError: a NaN or inf reward (without `drop_nonfinite_rewards`), or rewards
            so large that a group's advantages overflow (group and trajectory named).
    """
    from art_mega.errors import NonFiniteValueError
    from art_mega.trainer.advantages import group_advantages
    from art_mega.trajectories import check_train_groups, nonfinite_rewards, without_trajectories

    groups = check_train_groups(trajectory_groups)
    bad = nonfinite_rewards(groups)
    if bad and not drop_nonfinite_rewards:
        g, t, reward = bad[0]
        raise NonFiniteValueError(
            f"backend.train(trajectory_groups): trajectory {t} of group {g} has the reward {reward} "
            f"({len(bad)} non-finite rewards in this call); rewards must be finite numbers: fix the "
            "reward, or pass drop_nonfinite_rewards=True to leave such trajectories out",
            "reward",
            reward,
            g,
            t,
        )
    if bad:
        groups = without_trajectories(groups, [(g, t) for g, t, _ in bad])
    for g, group in enumerate(groups):
        try:
            group_advantages([t.reward for t in group.trajectories], scale_rewards)
        except NonFiniteValueError as exc:
            raise NonFiniteValueError(
                f"backend.train(trajectory_groups): group {g}: {exc}",
                exc.quantity,
                exc.value,
                g,
                exc.trajectory,
            ) from None
    return groups, len(bad)


PACKED_ROW_TOKENS = 1024
"""The packed row length in tokens when `MegatronBackend(seq_len=None)` (the default): a batch
whose longest trajectory is longer gets rows of that length (up to max_model_len), so the
trainer's work follows the batch and not the model's context."""


def packed_row_len(limit: int, longest: int) -> int:
    """The packed row length in tokens of a batch whose longest sequence has `longest` tokens,
    under the sequence limit `limit` (`seq_len` / `init_args.max_seq_length` / max_model_len):
    `PACKED_ROW_TOKENS`, or `longest` when longer, never above `limit` (a longer sequence is
    then refused by the packing, naming the limit)."""
    return min(limit, max(PACKED_ROW_TOKENS, longest))


BACKEND_WHOLE_NUMBERS = {
    "lora_rank": (1, "8"),
    "seq_len": (2, "1024"),
    "max_model_len": (2, "1024"),
    "keep_adapters": (1, "2"),
}
"""`MegatronBackend`'s integer arguments: (minimum, example). A row of one token trains nothing
(the loss predicts each token from the ones before it); the served step stays loaded, so at
least one adapter is kept."""


def check_backend_options(
    *,
    lora_rank: Any,
    lora_alpha: Any,
    lora_targets: Any,
    seq_len: Any,
    max_model_len: Any,
    keep_adapters: Any,
    startup_timeout_s: Any,
    vllm_python: Any,
    where: str = "MegatronBackend",
) -> None:
    """Refuse `MegatronBackend`'s arguments before anything starts (see `BACKEND_WHOLE_NUMBERS`;
    lora_rank at most vLLM's largest slot; lora_alpha and startup_timeout_s: finite > 0; lora_targets: None or a list or tuple of known
    target names, not one string; vllm_python: None or a non-empty path string).

    Raises:
        HyperParameterError: a number of the wrong type or out of range (named, with an example).
        UserError: lora_targets or vllm_python of the wrong type, or an unknown LoRA target.
    """
    from art_mega.errors import HyperParameterError
    from art_mega.hyperparams import check, positive_problem, whole_problem
    from art_mega.inference.protocol import VLLM_LORA_RANKS
    from art_mega.trainer.families import LORA_NAMES

    values = {
        "lora_rank": lora_rank,
        "seq_len": seq_len,
        "max_model_len": max_model_len,
        "keep_adapters": keep_adapters,
    }
    for name, (minimum, example) in BACKEND_WHOLE_NUMBERS.items():
        if values[name] is not None or name not in ("seq_len", "max_model_len"):  # None: the model's
            check(where, name, values[name], whole_problem(minimum), example)
    if lora_rank > VLLM_LORA_RANKS[-1]:
        raise HyperParameterError(
            f"{where}(lora_rank={lora_rank!r}) is above {VLLM_LORA_RANKS[-1]}, the largest LoRA rank "
            "vLLM serves; pass e.g. lora_rank=8",
            "lora_rank",
            lora_rank,
        )
    check(where, "lora_alpha", lora_alpha, positive_problem, "16.0")
    check(where, "startup_timeout_s", startup_timeout_s, positive_problem, "900.0")
    if lora_targets is not None:
        if (
            not isinstance(lora_targets, (list, tuple))
            or not lora_targets
            or not all(isinstance(t, str) for t in lora_targets)
        ):
            raise UserError(
                f"{where}(lora_targets={lora_targets!r}) must be a non-empty list or tuple of module names, "
                "e.g. lora_targets=('q_proj', 'k_proj', 'v_proj', 'o_proj'), or None for the default"
            )
        LORA_NAMES.normalise(tuple(lora_targets))
    if vllm_python is not None and (not isinstance(vllm_python, (str, os.PathLike)) or not str(vllm_python)):
        raise UserError(
            f"{where}(vllm_python={vllm_python!r}) must be the path of a Python interpreter with vLLM, "
            "e.g. vllm_python='/opt/venv-vllm/bin/python', or None for the default"
        )


class MegatronBackend:
    """Trains one `TrainableModel` with Megatron ranks and serves it with vLLM replicas.

    Args:
        runtime: a started multi-host `ArtRuntime` whose topology has a trainer and inference;
            None builds and owns a local one.
        lora_rank, lora_alpha, lora_targets: the LoRA adapter (targets in HF or Megatron names).
        seq_len: packed row length in tokens (a longer trajectory is an error naming it); None
            (default): trajectories up to `max_model_len` tokens, packed into rows of
            `PACKED_ROW_TOKENS` tokens or of the longest trajectory's length when longer.
        max_model_len: the replicas' context length in tokens; None (default): the model's
            context, capped by what the replica's KV cache holds (`dev.settings.default_max_model_len`,
            one logged line when capped).
        keep_adapters: published steps each replica keeps loaded.
        startup_timeout_s: bound on trainer and replica start-up (seconds).
        vllm_python: the interpreter that runs vLLM (default: see `default_vllm_python`).
        gpu_memory_utilization: fraction (0, 1] of each GPU vLLM may take (None: vLLM's 0.9);
            lower it for replicas with `InferenceSpec.shared_gpus=True`, which start after the
            trainer ranks hold their weights and then sleep during each train step
            (`inference.sleep`).
        dtype: the trainer's parameter dtype, "float32", "bfloat16" (Megatron keeps fp32 main
            weights for Adam), or "auto" (default): bfloat16 when the trainer ranks have GPUs,
            float32 on CPU ranks. On one H200 (SmolLM2-135M shape, LoRA r=8, packed 4096-token
            rows) a bf16 step ran 1.4x the tokens/s of fp32 (benchmarks/RESULTS.md).
        micro_batch_rows: packed rows per forward/backward microbatch (Megatron's micro batch
            size); the step's rows are accumulated over microbatches, so this trades memory
            for speed, not results. On one H200 4 rows ran 2.5x the tokens/s of 1 row (the
            step is bound by kernel launches at 1 row); the default 1 suits CPU and big models.

    Raises:
        UserError (HyperParameterError for the numbers): an argument of the wrong type (a bool or
            float where a whole number goes, a string where a number goes), not finite, out of
            range, or an unknown LoRA target, named in one sentence before anything starts.
    """

    def __init__(
        self,
        runtime: Any = None,
        *,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        lora_targets: tuple[str, ...] | None = None,
        seq_len: int | None = None,
        max_model_len: int | None = None,
        keep_adapters: int = 2,
        startup_timeout_s: float = 900.0,
        vllm_python: str | None = None,
        gpu_memory_utilization: float | None = None,
        dtype: str = "auto",
        micro_batch_rows: int = 1,
    ) -> None:
        if dtype not in ("auto", "float32", "bfloat16"):
            raise UserError(
                f"MegatronBackend(dtype={dtype!r}) is not a trainer dtype; use 'auto', 'float32' or 'bfloat16'"
            )
        try:  # any integer type, numpy's too; not a bool and not a float
            rows = None if "bool" in type(micro_batch_rows).__name__ else operator.index(micro_batch_rows)
        except TypeError:
            rows = None
        if rows is None or rows < 1:
            raise UserError(
                f"MegatronBackend(micro_batch_rows={micro_batch_rows!r}) counts packed rows per microbatch; "
                "use a whole number of at least 1, e.g. 1 on CPU or 4 on a GPU with memory to spare"
            )
        if runtime is not None and not all(hasattr(runtime, a) for a in ("topology", "clients", "health")):
            raise UserError(
                f"MegatronBackend(runtime={runtime!r}) must be a started art_mega ArtRuntime "
                "(await ArtRuntime.start(topology)), or None for a local one"
            )
        check_backend_options(
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
            seq_len=seq_len,
            max_model_len=max_model_len,
            keep_adapters=keep_adapters,
            startup_timeout_s=startup_timeout_s,
            vllm_python=vllm_python,
        )
        if gpu_memory_utilization is not None and (
            fraction_problem(gpu_memory_utilization) is not None or gpu_memory_utilization == 0
        ):
            raise UserError(
                f"MegatronBackend(gpu_memory_utilization={gpu_memory_utilization!r}) is a fraction of "
                "each GPU's memory; use a value in (0, 1], e.g. 0.5, or None for vLLM's default"
            )
        self._runtime = runtime
        self._owns_runtime = runtime is None
        self.lora = {
            "rank": int(lora_rank),
            "alpha": float(lora_alpha),
            "targets": list(lora_targets or []),
        }
        self._given = {"seq_len": seq_len, "max_model_len": max_model_len, "dtype": dtype}
        """The backend's own arguments, before a model's `_internal_config` overrides them."""
        self.seq_len: int | None = None if seq_len is None else int(seq_len)
        """The trainer's sequence limit in tokens (None until `register` without one given)."""
        self._fixed_rows = seq_len is not None
        """Whether `seq_len` is also every packed row's length (set by the user), else rows
        follow the batch (`PACKED_ROW_TOKENS`, `_step_with`)."""
        self.max_model_len: int | None = None if max_model_len is None else int(max_model_len)
        self._engine: Any = None
        """The model's checked `EngineSettings` (`dev.settings`), from `_apply_model_config`."""
        self.keep_adapters = int(keep_adapters)
        self.startup_timeout_s = float(startup_timeout_s)
        self._vllm_python = None if vllm_python is None else str(vllm_python)
        self.gpu_memory_utilization = (
            None if gpu_memory_utilization is None else float(gpu_memory_utilization)
        )
        self.dtype = dtype
        self.micro_batch_rows = int(micro_batch_rows)
        self._placement: dict[str, Any] = {}
        """The GPU placement fields of the model config the owned local runtime was built from."""
        self._shared: Any = None
        self._model: Any = None
        self._model_dir: Path | None = None
        self._run_dir: Path | None = None
        self._service: Any = None
        self._router: Any = None
        self._publisher: Any = None
        self._prefix_cache: dict[str, tuple[float, float]] = {}
        """Each replica's (queried, hit) prefix-cache prompt tokens at the last step's read."""
        self._recovery: Any = None
        self._tokenizer: Any = None
        self._checked_reference: tuple[Any, ...] | None = None
        """What `_check_reference` last accepted: folder, its files' stats, base model, LoRA."""
        self._step = 0
        self._base_is_step0 = True
        self._rl_optimizer = (ART_TRAINER_ARGS["weight_decay"], ART_TRAINER_ARGS["max_grad_norm"])
        self._lock = asyncio.Lock()
        self._behaviour = BehaviourMonitor()
        """Logs the behaviour-policy warning once per run (`trainer.behaviour`)."""

    # ------------------------------------------------------------------ set-up

    async def _local_runtime(self, model: Any) -> Any:
        from art_mega.trainer.checkpoint import root_holding_run

        return await self._start_local(model, str(root_holding_run("artifact_root", model.project, model.name)))

    async def _start_local(self, model: Any, artifact_root: str) -> Any:
        """Start the loopback runtime `model` trains on, artifacts under `artifact_root`: its
        topology from this host's facts (what its agent reports: GPUs, MIG slices,
        CUDA_VISIBLE_DEVICES) and `model._internal_config` (`launch.local_topology.local_plan`:
        CPU, ART's shared GPUs, or dedicated GPUs from trainer_gpu_ids / inference_gpu_ids).

        Raises:
            HyperParameterError, TopologyError: see `local_plan`; AgentStartError: see
                `ArtRuntime.start_local`.
        """
        from art_mega.launch.context import default_cache_root
        from art_mega.launch.local_topology import local_plan, placement_of
        from art_mega.preflight.host_facts import collect_host_facts
        from art_mega.runtime.runtime import ArtRuntime

        config = getattr(model, "_internal_config", None)
        plan = local_plan(
            collect_host_facts(),
            config,
            artifact_root=artifact_root,
            cache_root=default_cache_root(),
            vllm_python=self._vllm_python or default_vllm_python(),
            startup_timeout_s=self.startup_timeout_s,
        )
        self._placement = placement_of(config)
        return await ArtRuntime.start_local(plan.topology)

    def _apply_model_config(self, model: Any) -> None:
        """Check `model._internal_config` against this backend's runtime and take its
        `init_args.max_seq_length` (the sequence limit, replacing `seq_len`; rows then follow
        the batch, `PACKED_ROW_TOKENS`),
        `engine_args.max_model_len` and `engine_args.gpu_memory_utilization` (replacing the
        backend's) before anything starts.

        Raises:
            HyperParameterError: a value `dev.settings.engine_settings` refuses; a max_lora_rank
                below the backend's lora_rank; GPU
                placement (GPU id lists, tensor_parallel_size, enable_sleep_mode) set for a
                runtime this backend did not build from it, whose topology places the processes.
        """
        from art_mega.dev.settings import engine_settings, log_notes
        from art_mega.errors import HyperParameterError
        from art_mega.launch.local_topology import placement_of

        config = getattr(model, "_internal_config", None) or {}
        settings = engine_settings(config)
        placement = placement_of(config)
        if self._runtime is not None and placement != self._placement:
            name, value = next(iter(placement.items()), next(iter(self._placement.items()), ("", None)))
            if self._owns_runtime:
                where = f"this backend's local runtime was placed for {self._placement or 'ART shared mode'}"
                fix = "close() the backend first or use a new backend for this model"
            else:
                where = "the given runtime's topology places the trainer and replicas"
                fix = "set GPUs in that topology's TrainerSpec/InferenceSpec instead, or leave it out"
            raise HyperParameterError(
                f"TrainableModel(_internal_config=...) sets {name}={value!r}, but {where}; {fix}", name, value
            )
        log_notes(settings)  # one line per setting accepted but done otherwise here
        self._engine = settings
        # init_args.max_seq_length is ART's limit, rows follow the batch; MegatronBackend(seq_len=) fixes them
        self.seq_len = self._given["seq_len"] if settings.max_seq_length is None else settings.max_seq_length
        self._fixed_rows = self._given["seq_len"] is not None and settings.max_seq_length is None
        self.max_model_len = self._given["max_model_len"]
        if settings.max_model_len is not None:
            self.max_model_len = settings.max_model_len
        if settings.gpu_memory_utilization is not None:
            self.gpu_memory_utilization = settings.gpu_memory_utilization
        if self._given["dtype"] == "auto":  # init_args.dtype: the trainer's, unless the backend's is set
            self.dtype = settings.trainer_dtype or "auto"
        if settings.max_lora_rank is not None and settings.max_lora_rank < int(self.lora["rank"]):
            raise HyperParameterError(
                f"TrainableModel(_internal_config=...) sets max_lora_rank={settings.max_lora_rank!r}, below "
                f"the LoRA rank {self.lora['rank']} the replicas must serve; raise it or leave it out",
                "max_lora_rank",
                settings.max_lora_rank,
            )

    def _apply_lora_config(self, model: Any) -> None:
        """Take ART 0.5.23's `model.lora_config` (`rank`, `alpha`, `target_modules`; see
        `dev.lora.lora_settings`) as this backend's LoRA before anything starts. A value the
        backend was given otherwise (not its default) must agree.

        Raises:
            HyperParameterError: a LoRA value out of range, or one that disagrees with the
                backend's `lora_rank` / `lora_alpha` / `lora_targets` (set it once).
            UserError: unknown target modules (`check_backend_options`).
        """
        from art_mega.dev.lora import lora_settings
        from art_mega.errors import HyperParameterError

        wanted = lora_settings(getattr(model, "lora_config", None))
        if not wanted:
            return
        current = {
            "lora_rank": self.lora["rank"],
            "lora_alpha": self.lora["alpha"],
            "lora_targets": tuple(self.lora["targets"]) or None,
        }
        defaults = {"lora_rank": 8, "lora_alpha": 16.0, "lora_targets": None}
        merged = {**current, **wanted}
        check_backend_options(
            **merged,
            seq_len=self.seq_len,
            max_model_len=self.max_model_len,
            keep_adapters=self.keep_adapters,
            startup_timeout_s=self.startup_timeout_s,
            vllm_python=self._vllm_python,
            where="TrainableModel(lora_config=...)",
        )
        for name, value in wanted.items():
            mine = current[name]
            if mine != defaults[name] and mine != (tuple(value) if name == "lora_targets" else value):
                key = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_targets": "target_modules"}[name]
                raise HyperParameterError(
                    f"TrainableModel(lora_config=...) sets {key}={value!r}, but the backend was made with "
                    f"{name}={mine!r}; set the LoRA once",
                    f"lora_config.{key}",
                    value,
                )
        self.lora = {
            "rank": int(merged["lora_rank"]),
            "alpha": float(merged["lora_alpha"]),
            "targets": list(merged["lora_targets"] or []),
        }

    async def register(self, model: Any) -> Path:
        """Start (or resume) training `model`; returns its run directory.

        Resolves the base model, starts the trainer ranks (resuming from the last committed
        checkpoint, or warm-starting from an adapter), starts the replicas, and publishes the
        current step's adapter so `model.get_inference_name()` serves it.

        Everything that can be known without a trainer rank is checked before any rank or
        replica starts: the topology, the artifact root, the model against the trainer's
        parallel sizes (config.json only), the warm-start adapter (or the committed
        checkpoint's) against the backend's LoRA, that every host reads the model, and that no
        other backend's ranks or replicas run on the runtime. A register that fails after the
        starts began stops every rank and replica it started and forgets the model, so
        `register` works again on this backend (after `close()` too) or on another one.

        Raises:
            UserError: a second model, an unresolvable base model, a topology without trainer or
                inference, inference specs with different pythons, an unknown LoRA target.
            ModelSplitError: the heads, KV heads, FFN or experts do not divide by the
                TrainerSpec's tp / ep / etp, or the heads or FFN by the InferenceSpec's tp.
            AdapterMismatchError: the warm-start adapter or the committed checkpoint has another
                LoRA rank, alpha or target modules than this backend.
            CheckpointFileError: the run's commit pointer or its committed step's manifest is
                malformed, the committed step's adapter is missing, truncated, not the
                manifest's, unlike its own config, not fitting the base model or not finite, or
                a step folder is there that the commit does not account for (named with its
                path; `checkpoint.read_resume_step`).
            BaseModelError: also a warm-start adapter whose files are missing or truncated, whose
                tensors do not fit its config or the base model, or hold NaN or inf
                (`checkpoint.check_warm_start`).
            RuntimeBusyError: trainer ranks or replicas already run on the runtime's agents.
            TrainerJobError, ReplicaStartError, AgentError: a rank or replica did not start
                (named); nothing this call started is left running.
        """
        from art_mega.inference.remote import cpu_replica_hosts, unwarm_replicas, warm_replicas

        if self._model is not None:
            raise UserError(
                f"this backend already trains model {self._model.name!r}; make one backend per model"
            )
        self._apply_model_config(model)
        self._apply_lora_config(model)
        if self._runtime is None:
            self._runtime = await self._local_runtime(model)
        topology = self._runtime.topology
        if not topology.trainer_ranks or not topology.replicas:
            raise UserError(
                "the runtime's topology needs a TrainerSpec and an InferenceSpec to train a model"
            )
        python = replica_python(topology, self._vllm_python)  # UserError before any check that costs time
        # a CPU replica's vLLM import runs while the checks below prove the cluster
        warmed = cpu_replica_hosts(self._runtime.clients, topology.replicas)
        try:
            await warm_replicas(self._runtime.clients, warmed, python, topology.cluster.cache_root)
            return await self._register_warmed(model, topology, python)
        except BaseException:
            await unwarm_replicas(self._runtime.clients, warmed)  # a start that began stopped its own
            raise

    async def _register_warmed(self, model: Any, topology: Any, python: str) -> Path:
        """`register`'s checks and start, once the replicas' interpreters are warming."""
        from art_mega.basemodels.resolve import resolve_base_model_off_loop
        from art_mega.preflight.reach import (
            check_artifact_root_reach,
            check_controller_sees_artifact_root,
            check_hosts_see_model,
        )
        from art_mega.transfer.adapters import adapter_transport_for

        check_artifact_root_reach(topology)  # before any trainer rank or replica starts
        await check_controller_sees_artifact_root(self._runtime)
        # UserError, also before any start; a step folder's rank state stays on the trainer's host
        transport = adapter_transport_for(self._runtime, files=checkpoint.ADAPTER_FILES)
        cluster = topology.cluster
        resolved = await resolve_base_model_off_loop(model.base_model, cluster.cache_root)  # may download
        run_dir = checkpoint.run_dir(cluster.artifact_root, model.project, model.name)
        checkpoint.warn_earlier_launch_run(cluster.artifact_root, model.project, model.name)
        # both read and hash every adapter tensor (GBs for a big MoE's LoRA): off the event loop,
        # which keeps the agents' leases
        committed = await asyncio.to_thread(
            checkpoint.read_resume_step, checkpoint.checkpoints_dir(run_dir), resolved.model_dir
        )
        self._check_model_and_adapter(topology.trainer, topology.replicas, resolved, run_dir, committed)
        # MemoryPlanError before any start; written to the run folder once the starts begin
        plan = self._plan_memory(model, topology, resolved.model_dir)
        if committed is None and resolved.warm_start is not None:  # what the ranks would load
            await asyncio.to_thread(
                checkpoint.check_warm_start, resolved.warm_start, resolved.model_dir, model.base_model
            )
        await check_hosts_see_model(self._runtime, resolved.model_dir, resolved.warm_start, resolved.hub_id)
        await check_runtime_idle(self._runtime)
        # the interpreter the replicas will run under joins a collective before any start (cached)
        await self._runtime.prove_replicas(python)
        try:
            await self._start_serving(model, resolved, run_dir, committed, transport, plan)
        except BaseException:
            await self._stop_serving()  # a half-started register leaves no rank or replica behind
            raise
        return run_dir

    def _check_model_and_adapter(
        self, trainer: Any, replicas: Any, resolved: Any, run_dir: Path, committed: int | None
    ) -> None:
        """Refuse (without torch, from JSON files only) a model the trainer's tp / ep / etp or a
        replica's tp cannot split (`replicas`: the topology's `ReplicaSpec`s), unknown LoRA
        targets, and an adapter the ranks would load that does not have this backend's LoRA: the
        committed checkpoint's when there is one (a resume), else the warm-start adapter.

        Raises:
            ModelSplitError, AdapterMismatchError, UserError: see `register`.
            TopologyError: trainer sizes the trainer cannot run yet (`TrainerSpec.unsupported`).
        """
        from art_mega.errors import TopologyError
        from art_mega.trainer.model_builder import check_model_fits
        from art_mega.trainer.peft_config import check_adapter_config, read_adapter_config

        if (refused := trainer.unsupported()) is not None:  # compile_topology refuses it first
            raise TopologyError(refused[1], refused[0])
        check_model_fits(
            resolved.model_dir, trainer.tp, ep=trainer.ep, etp=trainer.etp, pp=trainer.pp, spec="TrainerSpec"
        )
        for replica_tp in sorted({r.tp for r in replicas}):  # vLLM splits heads and FFN the same way
            check_model_fits(resolved.model_dir, replica_tp, spec="InferenceSpec")
        lora = self._lora_settings(resolved.model_dir)
        if committed is not None:
            adapter = checkpoint.adapter_dir(
                checkpoint.step_dir(checkpoint.checkpoints_dir(run_dir), committed)
            )
            check_adapter_config(
                read_adapter_config(adapter),
                adapter,
                **lora,
                what=f"the adapter of this run's committed step {committed} at",
                otherwise="or give the model another name to start a new run",
            )
        elif resolved.warm_start is not None:
            check_adapter_config(read_adapter_config(resolved.warm_start), resolved.warm_start, **lora)

    def _lora_settings(self, model_dir: Any) -> dict[str, Any]:
        """The backend's LoRA as `check_adapter_config` compares an adapter with it: rank, alpha
        and the HF target modules of the model at `model_dir` (its family's names).

        Raises:
            UserError: an unsupported model family or an unknown LoRA target.
        """
        from art_mega.trainer.families import family_for
        from art_mega.trainer.hf_checkpoint import read_hf_config

        names = family_for(read_hf_config(model_dir)).lora  # the model's LoRA <-> PEFT names
        targets = names.normalise(tuple(self.lora["targets"]) or names.targets)
        return {
            "rank": self.lora["rank"],
            "alpha": self.lora["alpha"],
            "target_modules": names.hf_target_modules(targets),
        }

    def _engine_for(self, topology: Any, model_dir: Path) -> dict[str, Any]:
        """The replicas' engine settings from the model's `EngineSettings` (`self._engine`), as
        `ReplicaLaunch` fields: dtype, LoRA slots, and the other vLLM engine arguments as argv
        (`extra_args`); sets `max_model_len` when None (`dev.settings.default_max_model_len`,
        from the KV cache of a CPU replica, `ReplicaLaunch.kv_cache_gib`; on GPUs from each GPU's
        memory times gpu_memory_utilization less the weights) and `seq_len` to it when None.

        """
        from art_mega.dev.settings import EngineSettings, default_max_model_len
        from art_mega.inference.protocol import VLLM_LORA_RANKS, ReplicaLaunch, lora_rank_slot
        from art_mega.inference.replica import CPU_BLOCK_SIZE
        from art_mega.inference.vllm_engine_args import engine_argv
        from art_mega.trainer.hf_checkpoint import read_hf_config

        settings = self._engine or EngineSettings()
        on_gpu = any(gpus for r in topology.replicas for _, gpus in r.gpu_ids)
        # on GPUs vLLM's default, as ART's engine runs: the model's own dtype; on CPU float32
        dtype = settings.dtype or ("auto" if on_gpu else "float32")
        slot = lora_rank_slot(int(self.lora["rank"]))
        if settings.max_lora_rank is not None:
            slot = lora_rank_slot(min(settings.max_lora_rank, VLLM_LORA_RANKS[-1]))
        if self.max_model_len is None:
            hf_config = read_hf_config(model_dir)
            width = {"float32": 4}.get(dtype, 2)
            if on_gpu:
                kv_bytes = self._gpu_kv_bytes(topology, model_dir)
                block = 16
            else:
                kv_bytes, block = ReplicaLaunch.model_fields["kv_cache_gib"].default * 2**30, CPU_BLOCK_SIZE
            self.max_model_len, capped = default_max_model_len(hf_config, kv_bytes, width, block)
            if capped is not None:
                import logging

                logging.getLogger(__name__).warning("%s", capped)
        if self.seq_len is None:
            self.seq_len = self.max_model_len
        return {
            "dtype": dtype,
            "max_lora_rank": slot,
            **({"max_loras": settings.max_loras} if settings.max_loras is not None else {}),
            "extra_args": tuple(engine_argv(settings.vllm_args)),
        }

    def _gpu_kv_bytes(self, topology: Any, model_dir: Path) -> int | None:
        """What a GPU replica's KV cache may take, in bytes: gpu_memory_utilization (vLLM's 0.9
        when None) of its smallest GPU's memory times its GPUs, less the model's weight files and
        `memory_plan.REPLICA_ACTIVATION_RESERVE_BYTES` (1 GiB) per GPU for activations (vLLM
        profiles the rest); None when the GPUs' memory is not
        known (vLLM then fits the context itself)."""
        from art_mega.trainer.memory_plan import REPLICA_ACTIVATION_RESERVE_BYTES

        runtime_facts = getattr(self._runtime, "host_facts", {}) or {}
        util = 0.9 if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        budgets = []
        for replica in topology.replicas:
            memories = [
                gpu.memory_bytes
                for host, gpus in replica.gpu_ids
                for gpu in getattr(runtime_facts.get(host), "gpus", ())
                if gpu.index in gpus or gpu.uuid in gpus
            ]
            count = sum(len(gpus) for _, gpus in replica.gpu_ids)
            if not memories or not count:
                return None
            budgets.append(int(util * min(memories) * count) - count * REPLICA_ACTIVATION_RESERVE_BYTES)
        weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
        return max(min(budgets) - weights, 0) if budgets else None

    def _trainer_dtype(self, topology: Any) -> str:
        """The ranks' parameter dtype: the backend's, or for "auto" bfloat16 on GPU ranks and
        float32 on CPU ranks."""
        on_gpu = any(r.gpu_id is not None for r in topology.trainer_ranks)
        return ("bfloat16" if on_gpu else "float32") if self.dtype == "auto" else self.dtype

    def _plan_memory(self, model: Any, topology: Any, model_dir: Path) -> Any:
        """The run's memory plan (`trainer.memory_plan`) from config.json, the backend's LoRA,
        rows, context and `gpu_memory_utilization`, and the hosts' NVML GPU memory; logged in one
        line (and a line when rows up to the limit would not fit). Sets `max_model_len` and
        `seq_len` when None (`_engine_for`).

        Raises:
            MemoryPlanError: a trainer rank or a replica does not fit its GPU memory (never on
                CPU ranks and replicas, whose plan is only logged).
        """
        from art_mega.inference.protocol import ReplicaLaunch
        from art_mega.trainer import memory_plan
        from art_mega.trainer.hf_checkpoint import read_hf_config

        shape, valid_tp = memory_plan.ModelShape.from_model_dir(model_dir)
        engine = self._engine_for(topology, model_dir)
        replica_dtype = engine["dtype"]
        if replica_dtype == "auto":  # vLLM serves float32 checkpoints in 16 bits too
            replica_dtype = (
                "float16" if read_hf_config(model_dir).get("torch_dtype") == "float16" else "bfloat16"
            )
        lora = LoraConfig(
            rank=self.lora["rank"],
            **({"targets": tuple(self.lora["targets"])} if self.lora["targets"] else {}),
        )
        seq_len = int(self.seq_len)
        plan = memory_plan.plan_memory(
            shape,
            topology,
            memory_plan.gpu_memory_of(topology, getattr(self._runtime, "host_facts", {}) or {}),
            model=str(model.base_model),
            trainer_dtype=self._trainer_dtype(topology),
            replica_dtype=replica_dtype,
            lora_rank=lora.rank,
            lora_targets=lora.targets,
            row_tokens=seq_len if self._fixed_rows else min(seq_len, PACKED_ROW_TOKENS),
            seq_len=seq_len,
            micro_batch_rows=self.micro_batch_rows,
            max_model_len=int(self.max_model_len),
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_loras=engine.get("max_loras", ReplicaLaunch.model_fields["max_loras"].default),
            max_lora_rank=engine["max_lora_rank"],
        )
        memory_plan.log_plan(plan)
        memory_plan.check_plan(plan, shape, valid_tp)
        return plan

    async def _start_serving(
        self,
        model: Any,
        resolved: Any,
        run_dir: Path,
        committed: int | None,
        transport: Any,
        plan: Any = None,
    ) -> None:
        """Start the trainer ranks and replicas of a checked registration (writing its memory
        `plan` into the run folder first), commit step 0 when nothing is committed, publish the
        served step and start replica recovery. The caller stops what was started when this
        raises (`_stop_serving`)."""
        from art_mega.inference.adapters import AdapterPublisher
        from art_mega.inference.protocol import ReplicaLaunch
        from art_mega.inference.recovery import ReplicaRecovery
        from art_mega.inference.router import PolicyRouter, ReplicaEndpoint
        from art_mega.inference.sleep import SharedGpuReplicas
        from art_mega.inference.tool_calls import added_tokens, tool_call_parser
        from art_mega.trainer.hf_checkpoint import read_hf_config
        from art_mega.trainer.service import TrainerService

        topology = self._runtime.topology
        self._model, self._model_dir = model, resolved.model_dir
        checkpoints = checkpoint.checkpoints_dir(run_dir)
        checkpoints.mkdir(parents=True, exist_ok=True)
        checkpoint.clean_uncommitted(checkpoints)  # a crashed save's leftovers; no rank runs yet
        self._run_dir = run_dir
        if plan is not None:
            from art_mega.trainer.memory_plan import write_plan

            write_plan(run_dir, plan)
        trainer_args = getattr(model, "_internal_config", {}).get("trainer_args") or {}
        optimizer, rl_decay, rl_clip = art_optimizer(trainer_args)
        self._rl_optimizer = (rl_decay, rl_clip)  # ART's RL steps decay and clip differently from SFT's
        config = EngineConfig(
            model_dir=str(resolved.model_dir),
            optimizer=optimizer,
            lora=LoraConfig(
                rank=self.lora["rank"],
                alpha=self.lora["alpha"],
                **({"targets": tuple(self.lora["targets"])} if self.lora["targets"] else {}),
            ),
            dtype=self._trainer_dtype(topology),
            micro_batch_rows=self.micro_batch_rows,
            resume_dir=None if committed is None else str(checkpoint.step_dir(checkpoints, committed)),
            # a committed step's own adapter and optimizer state replace the warm start
            warm_start=str(resolved.warm_start) if committed is None and resolved.warm_start else None,
        )
        engine = self._engine_for(topology, resolved.model_dir)
        launch = ReplicaLaunch(
            model=str(resolved.model_dir),
            served_model_name=model.name,  # the latest step; the base model also as `base_model`
            base_model_name=model.base_model,
            python=replica_python(topology, self._vllm_python),
            max_model_len=self.max_model_len,
            log_dir=str(run_dir / "logs"),
            ready_timeout_s=self.startup_timeout_s,
            gpu_memory_utilization=self.gpu_memory_utilization,
            # ART's server arguments: tool calling on (with the model family's parser) and
            # vLLM's own sampling defaults rather than the model's generation_config.json
            tool_call_parser=tool_call_parser(
                read_hf_config(resolved.model_dir).get("model_type"), added_tokens(resolved.model_dir)
            ),
            generation_config="vllm",
            # ART's chat_template_kwargs (e.g. enable_thinking) in every request's render; the
            # trainer tokenizes with the same ones (`_template_kwargs`)
            chat_template_kwargs=getattr(model, "_internal_config", {}).get("chat_template_kwargs") or {},
            **engine,
        )
        shared = [ReplicaEndpoint.from_spec(r) for r in topology.replicas if r.shared_gpus]
        self._service = TrainerService(self._runtime.clients, topology, run_dir / "logs")

        async def export_first_step() -> None:
            # the ranks are ready before vLLM on every layout measured: step 0's export need
            # not wait for the replicas
            if committed is None:
                await self._service.run(ExportJob(step=0, checkpoint_dir=str(self._checkpoint(0))))
                checkpoint.write_commit(checkpoints, 0)

        def load_tokenizer(model_dir: Path) -> Any:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model_dir)

        # the first train step's tokenizer (3.7-5.2 s on 2 cores) loads while the processes
        # start, at a lower priority: the replicas' start is what the first rollout waits for
        tokenizer = asyncio.ensure_future(
            in_lowered_thread(load_tokenizer, resolved.model_dir, nice=TOKENIZER_NICE)
        )
        try:
            await self._start_processes(config, launch, shared_gpus=bool(shared), then=export_first_step)
        except BaseException:
            tokenizer.cancel()  # its thread ends on its own; its result is not used
            raise
        (loaded,) = await asyncio.gather(tokenizer, return_exceptions=True)
        if not isinstance(loaded, BaseException):  # else the first step's `tokenizer()` raises it
            self._tokenizer = loaded
        self._router = PolicyRouter(model.name, [ReplicaEndpoint.from_spec(r) for r in topology.replicas])
        router = self._router
        self._shared = SharedGpuReplicas(
            shared, timeout_s=self.startup_timeout_s, is_up=lambda name: name not in router.down()
        )
        self._publisher = AdapterPublisher(
            self._router,
            keep=self.keep_adapters,
            stage=transport,
            prune=transport.prune if transport is not None else None,
        )
        self._step = 0 if committed is None else committed
        self._base_is_step0 = resolved.warm_start is None  # step 0 a fresh LoRA: B = 0
        committed = self._step
        await self._publisher.publish(committed, str(checkpoint.adapter_dir(self._checkpoint(committed))))
        self._recovery = ReplicaRecovery(
            self._runtime.clients,
            topology.replicas,
            launch,
            self._publisher,
            before_restart=self._shared.wait_awake,
        )
        self._recovery.start()

    async def _start_processes(
        self, config: EngineConfig, launch: Any, shared_gpus: bool, then: Any = None
    ) -> None:
        """Start the trainer ranks and the replicas and wait until all are ready; `then` (an
        async callable, or None) runs as soon as the ranks are ready, while the replicas may
        still be starting, and its failure counts as the ranks' start failing.

        Dedicated GPUs (or CPU): both start at once; when one fails, what already runs is
        stopped at once, so that the other start fails fast rather than finishing (a vLLM start
        takes minutes on a big model), and the first failure is raised. Shared GPUs: the ranks
        first, as vLLM sizes its memory from what is free when it starts.

        Raises:
            TrainerJobError, ReplicaStartError, AgentError: the first start that failed.
        """
        from art_mega.inference.remote import start_replicas

        clients, replicas = self._runtime.clients, self._runtime.topology.replicas

        async def trainer() -> None:
            await self._service.start(config, timeout_s=self.startup_timeout_s)
            if then is not None:
                await then()

        if shared_gpus:
            await trainer()
            await start_replicas(clients, replicas, launch)
            return
        starts = [
            asyncio.ensure_future(trainer()),
            asyncio.ensure_future(start_replicas(clients, replicas, launch)),
        ]
        try:
            await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled: so are the starts; register's cleanup stops what began
            for start in starts:
                start.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            raise
        failed = [s.exception() for s in starts if s.done() and not s.cancelled() and s.exception()]
        if failed:
            await self._stop_processes()
            await asyncio.gather(*starts, return_exceptions=True)
            raise failed[0]

    async def _stop_processes(self) -> None:
        """Stop the topology's trainer ranks and replicas through their agents, whether or not
        their starts finished (idempotent; an agent that does not answer is skipped: its own
        shutdown stops its children)."""
        from art_mega.inference.remote import stop_replicas

        clients, topology = self._runtime.clients, self._runtime.topology
        hosts = sorted({r.host_id for r in topology.trainer_ranks})
        await asyncio.gather(
            *(clients[h].call(TRAINER_STOP) for h in hosts),
            stop_replicas(clients, topology.replicas),
            return_exceptions=True,
        )

    async def _stop_serving(self) -> None:
        """Stop this backend's replica recovery, adapter publisher, trainer ranks and replicas (if
        it started any) and forget the registered model, so that `register` can run again."""
        if self._recovery is not None:
            await self._recovery.stop()  # before the replicas stop, or it would restart them
        if self._publisher is not None:
            await self._publisher.aclose()
        if self._service is not None and self._runtime is not None:
            await self._stop_processes()
        self._model = self._model_dir = self._run_dir = self._tokenizer = None
        self._service = self._router = self._publisher = self._recovery = self._shared = None
        self._step = 0

    def _checkpoint(self, step: int) -> Path:
        assert self._run_dir is not None
        return checkpoint.step_dir(checkpoint.checkpoints_dir(self._run_dir), step)

    def _require(self, model: Any) -> None:
        if self._model is None or model.name != self._model.name:
            raise UserError(f"model {getattr(model, 'name', model)!r} is not registered with this backend")

    def _template_kwargs(self) -> dict[str, Any]:
        """The registered model's `_internal_config["chat_template_kwargs"]` ({} when unset):
        the replicas render every request with them, so the trainer's tokenization does too."""
        return dict(getattr(self._model, "_internal_config", {}).get("chat_template_kwargs") or {})

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    # ------------------------------------------------------------------ serving

    def inference_endpoint(self, model: Any) -> tuple[str, str]:
        """(base_url, api_key) of a replica serving `model` (the least-loaded one that is up)."""
        self._require(model)
        return self._router.route().base_url, "art-mega"

    def policy_router(self, model: Any) -> Any:
        """The `PolicyRouter` of `model`'s replicas (what `model.openai_client()` routes with)."""
        self._require(model)
        return self._router

    def inference_name(self, model: Any) -> str:
        """`<name>@<step>` of the served policy."""
        self._require(model)
        return self._router.inference_name()

    async def get_step(self, model: Any) -> int:
        self._require(model)
        return self._step

    # ------------------------------------------------------------------ training

    async def train(
        self,
        model: Any,
        trajectory_groups: Any,
        *,
        learning_rate: float = DEFAULT_LEARNING_RATE,
        loss_fn: str = "cispo",
        importance_sampling_level: str = "token",
        epsilon: float | None = None,
        epsilon_high: float | None = None,
        kl_beta: float = 0.0,
        tis_cap: float | None = None,
        scale_rewards: bool = True,
        normalize_advantages: bool = True,
        advantage_balance: float = 0.0,
        kl_penalty_coef: float = 0.0,
        truncated_importance_sampling: float | None = None,
        precalculate_logprobs: bool = False,
        mask_prob_ratio: bool = False,
        max_negative_advantage_importance_sampling_weight: float | None = None,
        kimi_k2_tau: float | None = None,
        num_trajectories_learning_rate_multiplier_power: float = 0.0,
        kl_ref_adapter_path: str | None = None,
        kl_penalty_reference_step: int | None = None,
        kl_penalty_source: str = "current_learner",
        optimizer_save_interval: int = 5,
        final_training_step: int | None = None,
        config: Any = None,
        allow_stale: bool = False,
        drop_nonfinite_rewards: bool = False,
        allow_training_without_logprobs: bool = False,
        grad_accumulation_sequences: int | None = None,
        packed_sequence_length: int | None = None,
        logprob_calculation_chunk_size: int | None = None,
        **unknown: Any,
    ) -> TrainResult:
        """GRPO on these groups, one new step (one checkpoint); returns it and its metrics.

        ART's options (`LocalBackend.train`) mean what they mean in ART (`trainer.loss.grpo_loss`
        gives each term): `loss_fn` "cispo" (ART's default, epsilon 1.0 / epsilon_high 4.0) or
        "ppo" (clipped, epsilon 0.2, epsilon_high = epsilon); `importance_sampling_level`,
        `mask_prob_ratio`, `max_negative_advantage_importance_sampling_weight`, `kimi_k2_tau`,
        `truncated_importance_sampling`, `precalculate_logprobs` (the trainer recomputes the
        old logprobs; the sampled ones are then TIS's), `kl_penalty_coef` (KL-penalised
        advantages against the base model, or the adapter of `kl_ref_adapter_path` or of the
        committed checkpoint `kl_penalty_reference_step`); `scale_rewards` / `normalize_advantages` (False:
        centred, not divided by the group's std); `advantage_balance` (then every advantage is
        divided by their mean magnitude, as ART's packing does: `tokenize.balance_advantages`);
        `num_trajectories_learning_rate_multiplier_power` (`trajectories_learning_rate`);
        `logprob_calculation_chunk_size` (the trainer's logprobs over chunks of that many
        positions, a memory knob: same values, `logprobs.token_logprobs`); ART 0.5.23's
        `kl_penalty_source` ("current_learner" or "sample": whose logprobs the KL penalty
        compares with the reference) and `optimizer_save_interval` / `final_training_step` (how
        often ART snapshots the optimizer; art-mega commits it with every step, which covers
        any interval: a value other than ART's default is accepted with one logged line). The
        ART options art-mega does not implement (`ART_OPTION_HINTS`) pass only at the value
        where they do nothing, else each is refused with what to use. art-mega's own: `kl_beta`
        (a k3 KL loss term), `tis_cap` (= truncated_importance_sampling with
        precalculate_logprobs), `allow_stale`, `drop_nonfinite_rewards`.

        Optimizer steps: the trajectories' token sequences are packed into rows of
        `packed_sequence_length` tokens (None: `seq_len`; a longer sequence is refused, ART
        drops it with a warning). With `grad_accumulation_sequences` G (the keyword or
        `config`'s, a multiple of the trainer's DP ranks; None: the DP ranks, as ART's
        MegatronBackend, so on one DP rank one step per packed row, as ART's LocalBackend) the
        call takes ceil(rows / G) optimizer steps of G rows each, in packing order
        (`batch.pack_steps`; ART takes ceil(packed sequences / G), in an unseeded shuffled
        order), every one at the learning rate, the old policy of a recomputing loss
        (`precalculate_logprobs`, `tis_cap`) computed once before the first; the metrics are
        the steps' means, and `data/step_num_gradient_steps` counts them.

        Every choice sampled through `model.openai_client()` carries the policy step that served
        it. The step is on-policy for the current step only; `allow_stale=True` trains on older
        (or newer) ones too, off-policy: the loss weighs each token by the ratio of the current
        policy to the logprobs it was sampled with (the PPO ratio; add `tis_cap` for truncated
        importance sampling against the trainer's own recomputation). `data/stale_trajectories`
        counts them either way.

        As in ART, only sampled Choices (with their logprobs) are trained; a plain assistant
        message (a dict) is context, unless `allow_training_without_logprobs=True`: then it is
        trained with the current policy as its sampling policy (ratio 1, see `loss.grpo_loss`).
        A trajectory left with nothing to train counts in
        `data/trajectories_dropped_no_assistant_tokens`; a step with nothing to train at all
        still runs and commits, with `loss/nothing_trainable` = 1 (ART also advances the step).

        Everything is checked before anything is tokenized or sent to a rank: the options (see
        `check_grpo_options`; `config`, a `TrainConfig`, gives `learning_rate`, and `beta` as
        `kl_beta` unless `kl_beta` is set), the groups (`trajectories.check_train_groups`) and
        the rewards: a NaN or +-inf reward is refused, or with `drop_nonfinite_rewards=True`
        its trajectory is left out and counted in `data/trajectories_dropped_nonfinite_reward`.
        Inside the ranks a non-finite loss or gradient norm aborts the step before the optimizer
        update, and a checkpoint whose LoRA or optimizer tensors are not finite is never
        committed: either way the commit and the served step stay where they were.

        Raises:
            UserError: unregistered model, a trajectory longer than `seq_len` (or
                `packed_sequence_length`), or (without `allow_stale`) a trajectory served by a
                step other than the current one.
            HyperParameterError: an option out of range or of the wrong type
                (`check_grpo_options`, `check_packing`, `check_accumulation`), an unknown
                keyword (named), or a KL reference adapter that is not whole, does not fit the
                base model or holds NaN or inf (`_check_reference`).
            AdapterMismatchError: the KL reference adapter has another LoRA rank, alpha or
                targets than the backend.
            TrainInputError: `trajectory_groups` is not a non-empty list of TrajectoryGroup, or
                a message has an unknown role or a bad content (group and trajectory named).
            NonFiniteValueError: a NaN or inf reward (without `drop_nonfinite_rewards`), sampling
                logprob, or an advantage that overflows (group and trajectory named).
            RankRefusedStepError: the ranks refused the step over a non-finite loss, gradient
                norm or checkpoint tensor (a UserError naming the step and the quantity; see above).
            TrainerJobError: a rank failed or died (named); the last commit stays usable, and the
                next call retries the same step on ranks restarted from it.
        """
        from art_mega.metrics import step_data_metrics
        from art_mega.trainer.tokenize import balance_advantages, grpo_documents

        self._require(model)
        # a user's adapter is checked below; a kl_penalty_reference_step is this run's own commit
        outside_reference = kl_ref_adapter_path is not None
        kl_ref_adapter_path = self._reference_path(kl_ref_adapter_path, kl_penalty_reference_step)
        learning_rate, loss = check_grpo_options(
            learning_rate=learning_rate,
            importance_sampling_level=importance_sampling_level,
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            kl_beta=kl_beta,
            tis_cap=tis_cap,
            scale_rewards=scale_rewards,
            config=config,
            allow_stale=allow_stale,
            drop_nonfinite_rewards=drop_nonfinite_rewards,
            unknown=unknown,
            allow_training_without_logprobs=allow_training_without_logprobs,
            loss_fn=loss_fn,
            normalize_advantages=normalize_advantages,
            advantage_balance=advantage_balance,
            kl_penalty_coef=kl_penalty_coef,
            truncated_importance_sampling=truncated_importance_sampling,
            precalculate_logprobs=precalculate_logprobs,
            mask_prob_ratio=mask_prob_ratio,
            max_negative_advantage_importance_sampling_weight=max_negative_advantage_importance_sampling_weight,
            kimi_k2_tau=kimi_k2_tau,
            num_trajectories_learning_rate_multiplier_power=num_trajectories_learning_rate_multiplier_power,
            kl_ref_adapter_path=kl_ref_adapter_path,
            logprob_calculation_chunk_size=logprob_calculation_chunk_size,
            kl_penalty_source=kl_penalty_source,
        )
        check_optimizer_snapshots(optimizer_save_interval, final_training_step, config)
        accumulate, row_len = check_packing(
            grad_accumulation_sequences,
            packed_sequence_length,
            config,
            num_trajectories_learning_rate_multiplier_power,
            self.seq_len,
        )
        scale_rewards = scale_rewards and normalize_advantages  # ART: False centres only
        groups, dropped = checked_groups(trajectory_groups, drop_nonfinite_rewards, scale_rewards)
        checked = outside_reference and loss.get("kl_ref_adapter_path") is not None
        checked_dir = self._model_dir
        if checked:  # reads tensors: off the loop
            await asyncio.to_thread(self._check_reference, loss["kl_ref_adapter_path"], checked_dir)
        async with self._lock:
            self._require(model)  # a close() that ran while this call waited
            if checked and self._model_dir != checked_dir:  # ... and a register of another model
                await asyncio.to_thread(self._check_reference, loss["kl_ref_adapter_path"], self._model_dir)
            started = time.perf_counter()
            stale = self._check_policy_steps(groups, allow_stale)
            documents, stats = grpo_documents(
                self.tokenizer(),
                groups,
                scale_rewards,
                allow_training_without_logprobs,
                template_kwargs=self._template_kwargs(),
            )
            documents = balance_advantages(documents, float(advantage_balance))
            learning_rate = trajectories_learning_rate(
                learning_rate, len(documents), float(num_trajectories_learning_rate_multiplier_power)
            )
            metrics = {
                **stats.as_metrics(),
                **step_data_metrics(groups, trainable=True),
                "data/stale_trajectories": float(stale),
                "data/trajectories_dropped_nonfinite_reward": float(dropped),
            }
            return await self._step_with(
                [documents],
                metrics,
                "rl",
                [learning_rate],
                loss,
                started,
                seq_len=None if packed_sequence_length is None else row_len,
                rows_per_step=accumulate,
            )

    def _check_reference(self, folder: str, model_dir: Path) -> None:
        """Refuse a KL reference adapter (`kl_ref_adapter_path` as `_reference_adapter` resolved
        it) that the trainer ranks could not load into this backend's LoRA, before the step is
        sent: the checks of a warm start (`checkpoint.adapter_problem` against the registered base
        model's folder `model_dir`, read by the caller on the event loop: whole files, tensors fitting its config and the model, finite values) and its
        config against the backend's rank, alpha and targets. A folder whose two files have not
        changed since its last check (inode, size, mtime, ctime), for the same base model and
        LoRA, is not read again; the folder of the last accepted reference is refused once its
        files changed, since the ranks read a reference once per folder (a new reference belongs
        in a new folder).

        Raises:
            HyperParameterError: naming kl_ref_adapter_path, the file and what is wrong with it,
                or that the last reference's folder changed in place.
            AdapterMismatchError: another LoRA rank, alpha or targets than the backend's.
        """
        from art_mega.errors import HyperParameterError
        from art_mega.trainer.peft_config import check_adapter_config, read_adapter_config

        lora = self._lora_settings(model_dir)
        try:
            stats = tuple(
                (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                for s in (Path(folder, name).stat() for name in checkpoint.ADAPTER_FILES)
            )
            key: tuple[Any, ...] | None = (folder, stats, str(model_dir), repr(lora))
        except OSError:
            key = None  # adapter_problem names the missing file
        if key is not None and key == self._checked_reference:
            return
        where = f"backend.train(kl_ref_adapter_path={folder!r})"
        if self._checked_reference is not None and self._checked_reference[0] == folder:
            raise HyperParameterError(
                f"{where} changed since an earlier step used it as the KL reference, and the trainer "
                "ranks keep the reference they loaded from a folder; write the new reference into a "
                "new folder and pass that",
                "kl_ref_adapter_path",
                folder,
            )
        found = checkpoint.adapter_problem(folder, model_dir=model_dir)
        if found is not None:
            path, problem = found
            raise HyperParameterError(
                f"{where} cannot be the KL reference: {path} {problem}; name a whole adapter with "
                f"finite values trained on {model_dir}",
                "kl_ref_adapter_path",
                folder,
            )
        check_adapter_config(
            read_adapter_config(folder),
            folder,
            **lora,
            what="the KL reference adapter (kl_ref_adapter_path) at",
            otherwise="or name a reference adapter trained with the backend's settings",
        )
        self._checked_reference = key

    def _reference_path(self, path: Any, step: Any) -> Any:
        """`kl_ref_adapter_path`, or the committed checkpoint folder of ART's
        `kl_penalty_reference_step` (a step of this run, at most the current one).

        Raises:
            HyperParameterError: both given; the step not a whole number from 0 to the current
                step; its checkpoint folder gone (`delete_checkpoints`).
        """
        from art_mega.errors import HyperParameterError
        from art_mega.hyperparams import check, whole_problem

        if step is None:
            return path
        where = "backend.train"
        if path is not None:
            raise HyperParameterError(
                f"{where}(kl_penalty_reference_step={step!r}) and kl_ref_adapter_path={path!r} both "
                "name the KL reference; set one of them",
                "kl_penalty_reference_step",
                step,
            )
        check(where, "kl_penalty_reference_step", step, whole_problem(0), "0")
        root = None if self._run_dir is None else checkpoint.checkpoints_dir(self._run_dir)
        folder = None if root is None else checkpoint.step_dir(root, step)
        if step > self._step or folder is None or not folder.is_dir():
            raise HyperParameterError(
                f"{where}(kl_penalty_reference_step={step!r}) names no committed checkpoint of this "
                f"run (the current step is {self._step}, and deleted checkpoints are gone); pass a "
                "kept step from 0 to the current one",
                "kl_penalty_reference_step",
                step,
            )
        return str(folder)

    def _check_policy_steps(self, groups: list[Any], allow_stale: bool) -> int:
        """How many trajectories were served by a step other than the current one; raises
        `UserError` naming the first (group, index, expected and found steps) unless `allow_stale`."""
        from art_mega.trajectories import off_policy

        # a fresh LoRA's step 0 has B = 0 (`trainer.lora`): the base model is that policy
        stale = off_policy(groups, self._step, base_is_expected=self._step == 0 and self._base_is_step0)
        if stale and not allow_stale:
            group, index, steps = stale[0]
            found = " and ".join("the base model" if s is None else f"policy step {s}" for s in steps)
            raise UserError(
                f"trajectory {index} of group {group} was sampled by {found}, but "
                f"backend.train expects step {self._step} ({len(stale)} stale trajectories); sample "
                "with the current model.get_inference_name() or pass allow_stale=True to train off-policy."
            )
        return len(stale)

    async def train_sft(
        self,
        model: Any,
        trajectories: Any,
        config: Any = None,
        _config: Any = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> TrainResult:
        """ART's `train_sft`: the trajectories in batches of `config.batch_size` (in order), one
        optimizer step per batch at its learning rate (`TrainSFTConfig.learning_rates`), then
        one checkpoint: the model's step moves by 1, as in ART.

        Each batch's loss is ART's: the cross-entropy summed over the batch's trained
        (assistant) tokens divided by their number, so every trained token of a batch weighs
        the same (`tokenize.sft_documents`). `config` is a `TrainSFTConfig`; without it `kwargs`
        are its fields (not both). `_config` is ART's `dev.TrainSFTConfig` (a dict without
        keys). `verbose` prints the batches and rates.

        Returns the new step and its metrics: ART's `loss/train`, `loss/learning_rate`,
        `loss/grad_norm` (each the mean over the batches), `data/step_num_trajectories`,
        `data/step_trainer_tokens`, `data/step_num_gradient_steps` (batches),
        `data/step_num_dropped_trajectories` (0: a trajectory longer than `seq_len` is refused,
        not dropped), `time/step_trainer_s`, and art-mega's `data/*` and `time/*` rows.

        Raises:
            UserError: unregistered model, a trajectory longer than `seq_len`.
            HyperParameterError: `config` is not a TrainSFTConfig or comes with `kwargs`, a
                keyword that is not a TrainSFTConfig field, `_config` not an empty dict,
                `verbose` not a bool, or a list of learning rates that is not one per batch.
            pydantic.ValidationError: `kwargs` are not valid TrainSFTConfig values (names the field).
            TrainInputError: `trajectories` is not a non-empty iterable of Trajectory, or a
                message has an unknown role or a bad content (trajectory and message named).
            NonFiniteValueError: a sampled Choice holds a NaN or inf logprob.
            RankRefusedStepError, TrainerJobError: as for `train` (a batch after the first
                with a non-finite loss fails the job: the ranks restart from the last commit).
        """
        from art_mega.errors import HyperParameterError
        from art_mega.hyperparams import bool_problem, check
        from art_mega.metrics import art_train_metrics
        from art_mega.sft import TrainSFTConfig
        from art_mega.trainer.tokenize import BatchStats, sft_documents
        from art_mega.trajectories import check_sft_trajectories

        self._require(model)
        if config is not None and not isinstance(config, TrainSFTConfig):
            raise HyperParameterError(
                f"train_sft(config={config!r}) must be an art_mega.TrainSFTConfig; pass e.g. "
                "config=art.TrainSFTConfig(learning_rate=5e-5)",
                "config",
                config,
            )
        for name, value in kwargs.items():
            if name not in TrainSFTConfig.model_fields:
                raise HyperParameterError(
                    f"train_sft got the unknown keyword {name}={value!r}; use config=TrainSFTConfig"
                    f"({', '.join(TrainSFTConfig.model_fields)}), _config or verbose",
                    name,
                    value,
                )
            if config is not None:
                raise HyperParameterError(
                    f"train_sft got config= and {name}= together; set {name} in the TrainSFTConfig",
                    name,
                    value,
                )
        if _config is not None and (not isinstance(_config, dict) or set(_config) - {"metric_logging"}):
            raise HyperParameterError(
                f"train_sft(_config={_config!r}) must be ART's dev.TrainSFTConfig, whose one key is "
                "metric_logging; leave the others out",
                "_config",
                _config,
            )
        if _config and _config.get("metric_logging") is not None:
            log.info(
                "train_sft(_config={'metric_logging': %r}): art-mega logs every train_sft call's metrics "
                "(model.train_sft(log_metrics=False) turns that off)",
                _config["metric_logging"],
            )
        check("train_sft", "verbose", verbose, bool_problem, "True")
        config = config or TrainSFTConfig(**kwargs)
        trajectories = check_sft_trajectories(trajectories)
        size = config.resolved_batch_size()
        rates = config.learning_rates(config.batch_count(len(trajectories)))
        async with self._lock:
            self._require(model)  # a close() that ran while this call waited
            started = time.perf_counter()
            steps, total = [], BatchStats()
            for k in range(len(rates)):
                documents, stats = sft_documents(
                    self.tokenizer(),
                    trajectories[k * size : (k + 1) * size],
                    config.assistant_turns,
                    k * size,
                    template_kwargs=self._template_kwargs(),
                )
                steps.append(documents)
                for name, value in stats.__dict__.items():
                    setattr(total, name, getattr(total, name) + value)
                if verbose:
                    print(f"train_sft batch {k}: {len(documents)} sequences, lr {rates[k]:.3g}")
            result = await self._step_with(steps, total.as_metrics(), "sft", rates, {}, started)
        metrics = result.metrics
        renamed = art_train_metrics(metrics, kl_loss=False)
        metrics.clear()
        metrics.update(renamed)
        metrics.update(
            {
                "data/step_num_trajectories": float(len(trajectories)),
                "data/step_trainer_tokens": float(total.trained_tokens),
                "data/step_num_dropped_trajectories": 0.0,
                "data/step_num_gradient_steps": float(len(rates)),
            }
        )
        if verbose:
            print(f"train_sft: step {result.step}, loss/train {metrics['loss/train']:.4f}")
        return result

    async def _step_with(
        self,
        steps: list[list[Any]],
        metrics: dict[str, float],
        kind: str,
        learning_rates: list[float],
        loss: dict[str, Any],
        started: float,
        *,
        seq_len: int | None = None,
        rows_per_step: int | None = None,
    ) -> TrainResult:
        """One job on the ranks and its commit: an rl job (`steps` = [its documents], one rate;
        one optimizer step per `rows_per_step` packed rows over all DP ranks,
        `check_accumulation`; None: the DP ranks, one row per rank and step, ART's
        MegatronBackend default) or an sft job (one document list and one rate per optimizer
        step); rows of `seq_len` tokens (None: `self.seq_len`, else it is `backend.train`'s
        packed_sequence_length); returns the new step."""
        from art_mega.metrics import art_train_metrics
        from art_mega.trainer.batch import pack
        from art_mega.trainer.protocol import sft_batch_file
        from art_mega.transfer.adapters import transfer_metrics

        assert self._run_dir is not None
        step = self._step + 1
        dp = max(r.dp_rank for r in self._runtime.topology.trainer_ranks) + 1
        row_len = self.seq_len if seq_len is None else seq_len
        if seq_len is None and not self._fixed_rows:  # rows as long as the batch needs, up to the limit
            row_len = packed_row_len(
                row_len, max((len(d) for documents in steps for d in documents), default=0)
            )
        step_rows: int | None = None  # rl only
        try:
            if kind == "rl":
                batches, step_rows = rl_step_batches(steps[0], row_len, dp, rows_per_step)
                packed = [batches]
            else:
                packed = [pack(documents, row_len, dp) for documents in steps]
        except ValueError as exc:
            where = (
                "backend.train(packed_sequence_length=...)"
                if seq_len is not None
                else "MegatronBackend(seq_len=...)"
                if self._fixed_rows
                else "init_args.max_seq_length, or engine_args.max_model_len by default"
            )
            raise UserError(f"{exc} ({where})") from None
        if step_rows is not None:
            metrics["data/step_num_gradient_steps"] = float(packed[0][0].shape[0] // step_rows)
        batch_dir = self._run_dir / "batches" / f"{step:04d}"
        for k, batches in enumerate(packed):
            for rank, batch in enumerate(batches):
                file = (
                    batch_dir / f"dp{rank}.safetensors"
                    if kind == "rl"
                    else sft_batch_file(batch_dir, k, rank)
                )
                file.parent.mkdir(parents=True, exist_ok=True)
                batch.save(file)
        await self._send_batches(batch_dir)
        prepared = time.perf_counter()
        where = {"step": step, "batch_dir": str(batch_dir), "checkpoint_dir": str(self._checkpoint(step))}
        job = (
            RLJob(
                **where,
                learning_rate=learning_rates[0],
                loss=GRPOLossConfig(**loss),
                weight_decay=self._rl_optimizer[0],
                clip_grad=self._rl_optimizer[1],
                step_rows=step_rows,
            )
            if kind == "rl"
            else SFTJob(**where, learning_rates=learning_rates)
        )
        metrics.update(await self._prefix_cache_metrics())  # before a sleep, of this step's rollouts
        async with self._shared.asleep(metrics):  # replicas on the trainer's GPUs free them
            # after a failed step the ranks may be one update ahead: restart them from the last commit
            await self._service.recover(self._checkpoint(self._step))
            result = await self._service.run(job)
        try:
            checkpoint.write_commit(checkpoint.checkpoints_dir(self._run_dir), step)
        except BaseException:
            self._service.dirty = True  # the ranks hold step `step`, the commit says `self._step`
            raise
        self._step = step
        trained = time.perf_counter()
        report = await self._publisher.publish(step, str(checkpoint.adapter_dir(self._checkpoint(step))))
        published = time.perf_counter()
        shutil.rmtree(batch_dir, ignore_errors=True)
        await self._remove_on_trainer_hosts(batch_dir, best_effort=True)  # as the rmtree above
        metrics.update(result.rank0.metrics)
        self._behaviour.check(metrics)
        metrics.update(
            {
                "time/prepare_s": prepared - started,
                "time/train_s": trained - prepared,
                "time/publish_s": published - trained,
                "time/adapter_load_s": max(report.load_s.values(), default=0.0),
                **transfer_metrics(self._publisher.stage, step),
            }
        )
        metrics = art_train_metrics(metrics, kl_loss=float(loss.get("kl_beta", 0.0)) > 0)
        return LocalTrainResult(step=step, metrics=metrics, checkpoint_path=str(self._checkpoint(step)))

    async def _prefix_cache_metrics(self) -> dict[str, float]:
        """`inference/prefix_cache_hit_rate`: the share (0..1) of the prompt tokens the replicas
        were sent since the last step's read (the first: since they started) that their prefix
        caches held, from each replica's /metrics; left out when none were sent. A replica that
        is down (out of routing) or whose /metrics does not answer is left out of it and counted in
        `inference/prefix_cache_unread_replicas` (the step itself does not depend on it)."""
        from art_mega.errors import ReplicaHTTPError
        from art_mega.inference.server_api import ReplicaClient

        async def read(replica: Any) -> tuple[float, float] | None:
            async with ReplicaClient(replica.name, replica.url, 10.0) as client:
                try:
                    return await client.prefix_cache_counts()
                except ReplicaHTTPError:
                    return None

        replicas = self._router.replicas if self._router is not None else ()
        up = {r.name for r in self._router.up()} if self._router is not None else set()

        async def read_up(replica: Any) -> tuple[float, float] | None:
            return await read(replica) if replica.name in up else None  # down: not waited for

        counts = await asyncio.gather(*(read_up(r) for r in replicas))
        queried = hit = 0.0
        for replica, now in zip(replicas, counts):
            if now is None:
                continue
            before = self._prefix_cache.get(replica.name, (0.0, 0.0))
            if now[0] < before[0]:  # restarted since: its counters began again at 0
                before = (0.0, 0.0)
            queried, hit = queried + now[0] - before[0], hit + now[1] - before[1]
            self._prefix_cache[replica.name] = now
        out = {"inference/prefix_cache_hit_rate": hit / queried} if queried > 0 else {}
        unread = sum(now is None for now in counts)
        return {**out, "inference/prefix_cache_unread_replicas": float(unread)} if unread else out

    async def delete_checkpoints(self, model: Any, best_checkpoint_metric: str = "val/reward") -> list[int]:
        """Delete every committed checkpoint but the latest and the best by `best_checkpoint_metric`,
        ART's rule (`checkpoint.best_step`: the step of the highest mean of the metric in
        history.jsonl; none logged: the latest only). A step the replicas still load (the
        `keep_adapters` window) is unloaded from them first (`AdapterPublisher.unload`), so no
        replica serves a deleted step; only the step the replicas serve as the policy stays
        while it is served (its publication failed and a newer one did not happen: the
        latest step is newer than it), with one logged line. Returns the deleted steps.

        Raises:
            ReplicaHTTPError: a replica could not unload a step (the first such answer); that
                step's files stay, the other steps are deleted.
        """
        import logging

        from art_mega.metrics import read_history

        self._require(model)
        assert self._run_dir is not None
        checkpoints = checkpoint.checkpoints_dir(self._run_dir)
        best = checkpoint.best_step(read_history(self._run_dir / "history.jsonl"), best_checkpoint_metric)
        deleted = checkpoint.deletable_steps(checkpoint.step_folders(checkpoints), self._step, best)
        failures: dict[int, list[Any]] = {}
        if self._publisher is not None:
            served = self._publisher.router.served_step
            if served in deleted:
                logging.getLogger(__name__).warning(
                    "delete_checkpoints keeps step %s: the replicas serve it as the policy (step %s was "
                    "not published); it goes at the next call after a publication",
                    served,
                    self._step,
                )
                deleted.remove(served)
            failures = await self._publisher.unload(deleted)
        deleted = [s for s in deleted if s not in failures]
        for s in deleted:
            await self._remove_on_trainer_hosts(checkpoint.delete_step(checkpoints, s))
        if failures:
            raise next(iter(failures.values()))[0]
        return deleted

    # ------------------------------------------------------------------ checkpoints in S3 / forks

    def _artifact_root(self) -> Path:
        """The folder runs live under before `register`: the runtime's artifact_root, else the
        local default (`launch.context.default_artifact_root`)."""
        if self._runtime is not None:
            return Path(self._runtime.topology.cluster.artifact_root)
        from art_mega.launch.context import default_artifact_root

        return Path(default_artifact_root())

    def _offline_run_dir(self, model: Any, where: str) -> Path:
        """`model`'s run folder, for a call that writes checkpoints no rank is training.

        Raises:
            UserError: this backend has `model` registered; the runtime's artifact_root is
                host-local with trainer ranks on other hosts (they would not see the files).
        """
        name = getattr(model, "name", model)
        if self._model is not None and self._model.name == name:
            raise UserError(
                f"{where}: model {name!r} is registered with this backend and its ranks hold its "
                "checkpoints; call it before model.register(backend)"
            )
        if self._runtime is not None and remote_trainer_hosts(self._runtime.topology):
            raise UserError(
                f"{where}: the runtime's artifact_root is host-local and trainer ranks run on other "
                "hosts, which would not see the copied checkpoint; use a shared artifact_root"
            )
        return checkpoint.run_dir(self._artifact_root(), model.project, model.name)

    async def _experimental_push_to_s3(
        self,
        model: Any,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> None:
        """ART's push: upload `model`'s run folder (committed checkpoints, history, logs) to
        `s3://<s3_bucket or $BACKUP_BUCKET>/[<prefix>/]<project>/models/<name>/`, the commit
        pointer last (`art_mega.trainer.s3.push_run`). Runs in a worker thread.

        Raises:
            UserError: `delete=True` (not supported); no bucket named; the bucket is missing
                (differs from ART, which creates it) or unreachable; the run folder is missing.
            CheckpointFileError: the run's pointer or committed manifest is malformed.
        """
        from art_mega.trainer import s3

        if delete:
            raise UserError(
                "_experimental_push_to_s3(delete=True) is not supported: art-mega never removes "
                "objects from the bucket; leave delete out"
            )
        bucket = s3.bucket_name(s3_bucket, "_experimental_push_to_s3")
        run_dir = checkpoint.run_dir(self._artifact_root(), model.project, model.name)
        await asyncio.to_thread(
            s3.push_run, run_dir, bucket, s3.run_key(model.project, model.name, prefix), verbose=verbose
        )

    async def _experimental_pull_from_s3(
        self,
        model: Any,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        only_step: int | str | None = None,
        step: int | None = None,
        exclude: list[str] | None = None,
        latest_only: bool = False,
    ) -> None:
        """ART's pull: download `model`'s run from the bucket into its local run folder, committed
        through `art_mega.trainer.checkpoint` so `register` resumes from it (`trainer.s3.pull_run`).

        `only_step`: None every committed step (and history, logs); an int that step; "latest" the
        bucket's committed step. `step` and `latest_only` are ART's deprecated spellings of it.

        Raises:
            UserError: `delete=True` or `exclude` (not supported); the model is registered here;
                no bucket; the bucket is missing or unreachable, or holds committed checkpoints of
                the run but not `only_step`; a committed local step differs from the bucket's. A
                bucket without a committed checkpoint of the run pulls nothing (one logged line),
                as in ART: a first run goes on from its base model.
            CheckpointFileError: a manifest is malformed or does not match its adapter.
        """
        from art_mega.trainer import s3

        where = "_experimental_pull_from_s3"
        if delete or exclude is not None:
            raise UserError(
                f"{where}(delete={delete!r}, exclude={exclude!r}) is not supported: art-mega pulls "
                "the run's committed checkpoints (all, or only_step) and its files; leave both out"
            )
        if step is not None:
            only_step = step
        elif latest_only and only_step is None:
            only_step = "latest"
        if (
            only_step is not None
            and only_step != "latest"
            and (isinstance(only_step, bool) or not isinstance(only_step, int) or only_step < 0)
        ):
            raise UserError(f"{where}(only_step={only_step!r}) must be a step number >= 0, 'latest' or None")
        run_dir = self._offline_run_dir(model, where)
        bucket = s3.bucket_name(s3_bucket, where)
        await asyncio.to_thread(
            s3.pull_run,
            run_dir,
            bucket,
            s3.run_key(model.project, model.name, prefix),
            only_step,
            verbose=verbose,
        )

    async def _experimental_fork_checkpoint(
        self,
        model: Any,
        from_model: str,
        from_project: str | None = None,
        from_s3_bucket: str | None = None,
        not_after_step: int | None = None,
        verbose: bool = False,
        prefix: str | None = None,
    ) -> None:
        """ART's fork: start `model` from the checkpoint of `from_model` (of `from_project`,
        default `model.project`) at the newest committed step <= `not_after_step` (the newest
        when None), read from the local artifact root or, with `from_s3_bucket`, from
        `s3://<bucket>/[<prefix>/]<from_project>/models/<from_model>`. Call it before `register`.

        The step keeps its number, as in ART, and is committed in `model`'s run, so `register`
        resumes from it: the next `train` makes step n+1. The whole checkpoint folder is copied:
        the adapter, and the rank state files, so the forked run also continues the source's
        optimizer state (Adam moments, step count) where ART's fork carries the adapter only;
        on another trainer layout the moments are re-sharded (`TrainerEngine.load_portable`).

        Raises:
            UserError: `model` is registered here; `model` already has a committed checkpoint
                (ART would add the step folder beside them); `from_model` has no committed
                checkpoint in that project (or bucket); none at or before `not_after_step`;
                the bucket is missing or unreachable.
            CheckpointFileError: the chosen step's manifest is malformed or does not match its adapter.
        """
        from art_mega.trainer import s3

        where = "_experimental_fork_checkpoint"
        if not_after_step is not None and (
            isinstance(not_after_step, bool) or not isinstance(not_after_step, int) or not_after_step < 0
        ):
            raise UserError(f"{where}(not_after_step={not_after_step!r}) must be a step number >= 0 or None")
        if not isinstance(from_model, str) or not from_model:
            raise UserError(f"{where}(from_model={from_model!r}) must name the model to fork from")
        project = from_project or model.project
        dest = checkpoint.checkpoints_dir(self._offline_run_dir(model, where))
        describe = f"model {from_model!r} of project {project!r}"
        if from_s3_bucket is not None:
            bucket = s3.bucket_name(from_s3_bucket, where)
            source = (bucket, s3.run_key(project, from_model, prefix))
            await asyncio.to_thread(
                s3.fork_step,
                None,
                dest,
                not_after_step=not_after_step,
                s3_source=source,
                describe=describe,
                verbose=verbose,
            )
        else:
            root = checkpoint.checkpoints_dir(checkpoint.run_dir(self._artifact_root(), project, from_model))
            await asyncio.to_thread(
                s3.fork_step,
                root,
                dest,
                not_after_step=not_after_step,
                s3_source=None,
                describe=describe,
                verbose=verbose,
            )

    async def _send_batches(self, batch_dir: Path) -> None:
        """With a host-local artifact_root, write each `dp<r>.safetensors` under `batch_dir` (an
        sft job's are in one folder per batch) on every other trainer host whose ranks read DP
        rank r's batches, through its agent (same path under its root); nothing with a shared root.

        Raises:
            ArtifactFileError, AgentError: an agent could not write it (named).
        """
        from art_mega.transfer.files import send_file

        root = self._runtime.topology.cluster.artifact_root
        sends = [
            send_file(self._runtime.clients[host], root, str(file.relative_to(root)), file.read_bytes())
            for host, dp_ranks in remote_trainer_hosts(self._runtime.topology).items()
            for dp in dp_ranks
            for file in sorted(batch_dir.rglob(f"dp{dp}.safetensors"))
        ]
        await asyncio.gather(*sends)

    async def _remove_on_trainer_hosts(self, folder: Path, best_effort: bool = False) -> None:
        """With a host-local artifact_root, remove `folder` (under the root) on every other trainer
        host through its agent; nothing with a shared root.

        Raises:
            ArtifactFileError, AgentError: an agent could not remove it (named); never with
                `best_effort`.
        """
        from art_mega.transfer.files import remove_remote

        root = self._runtime.topology.cluster.artifact_root
        relative = str(folder.relative_to(root))
        hosts = remote_trainer_hosts(self._runtime.topology)
        await asyncio.gather(
            *(remove_remote(self._runtime.clients[h], root, relative) for h in hosts),
            return_exceptions=best_effort,
        )

    async def close(self) -> None:
        """Stop the replicas and trainer ranks this backend started and forget its model (a later
        `register` starts them again); close the runtime when this backend owns it (a later
        `register` starts a new one). Idempotent. A step in flight (`train`, `train_sft`) ends
        first: the ranks and replicas it uses are not stopped under it; a step that waits for
        the backend then finds the model unregistered (UserError)."""
        async with self._lock:
            run_dir = self._run_dir
            await self._stop_serving()
        if run_dir is not None:
            from art_mega.progress import line

            line(f"art-mega: run folder {run_dir}")
        if self._owns_runtime and self._runtime is not None:
            runtime, self._runtime = self._runtime, None
            await runtime.close()

    async def __aenter__(self) -> MegatronBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
