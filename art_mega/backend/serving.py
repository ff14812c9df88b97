"""MegatronBackend's serving: `register` (check the model, plan memory, start the trainer ranks
and the vLLM replicas, warm), and their stop; the interpreter that runs vLLM; the trainer's hosts."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_mega.backend.batches import PACKED_ROW_TOKENS
from art_mega.backend.options import art_optimizer
from art_mega.errors import UserError
from art_mega.trainer import checkpoint
from art_mega.trainer.protocol import (
    TRAINER_STOP,
    EngineConfig,
    ExportJob,
    LoraConfig,
)

log = logging.getLogger(__name__)


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


class ServingMixin:
    """`register` and the start and stop of the trainer ranks and replicas (part of `MegatronBackend`)."""

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
        from art_mega.transfer.remote import adapter_transport_for

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
        if committed is not None and not self.lora["targets"]:
            self._resume_targets(
                checkpoint.adapter_dir(checkpoint.step_dir(checkpoint.checkpoints_dir(run_dir), committed)),
                resolved.model_dir,
            )
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

    def _resume_targets(self, adapter: Path, model_dir: Any) -> None:
        """A backend without `lora_targets` resumes a run on the modules its committed `adapter`
        covers where they are not the model's default (the default changed in art-mega 2026-12:
        before, Qwen3.5's delta-net and DeepSeek-V3's MLA projections were left out), with one
        logged line; an adapter_config.json it cannot read is left to `check_adapter_config`."""
        from art_mega.trainer.families import lora_names_of
        from art_mega.trainer.hf_checkpoint import read_hf_config
        from art_mega.trainer.peft_config import read_adapter_config

        try:
            config = read_adapter_config(adapter)
            names = lora_names_of(read_hf_config(model_dir))
            modules = names.config_modules(config["target_modules"], config.get("target_parameters") or [])
            targets = names.normalise(modules)
        except (UserError, KeyError, TypeError):
            return
        if targets != names.default_targets:
            log.info(
                "resuming on the committed adapter's LoRA modules %s (this model's default: %s); pass "
                "lora_targets to choose",
                sorted(names.hf_target_modules(targets)),
                sorted(names.hf_target_modules(names.default_targets)),
            )
            self.lora["targets"] = list(targets)

    def _lora_targets(self, model_dir: Any) -> tuple[tuple[str, ...], Any]:
        """(the Megatron LoRA targets the ranks train on the model at `model_dir`, its family's
        `LoraNames`): the backend's `lora_targets`, else the family's default (ART 0.5.23's
        default for that model: q/k/v/o and gate/up/down_proj; Qwen3.5 also its gated delta-net
        projections; DeepSeek-V3 its MLA projections; `LoraNames.default_targets`).

        Raises:
            UserError: an unsupported model family, or a target this family does not have (e.g.
                q_proj on DeepSeek-V3's multi-head latent attention; `LoraNames.normalise`).
        """
        from art_mega.trainer.families import lora_names_of
        from art_mega.trainer.hf_checkpoint import read_hf_config

        names = lora_names_of(read_hf_config(model_dir))
        return names.normalise(tuple(self.lora["targets"]) or names.default_targets), names

    def _lora_settings(self, model_dir: Any) -> dict[str, Any]:
        """The backend's LoRA as `check_adapter_config` compares an adapter with it: rank, alpha
        and the targets of the model at `model_dir` (`_lora_targets`) as its family writes them
        (`LoraNames.peft_targets`: HF target modules, and GPT-OSS's target parameters).

        Raises:
            UserError: as `_lora_targets`.
        """
        targets, names = self._lora_targets(model_dir)
        return {
            "rank": self.lora["rank"],
            "alpha": self.lora["alpha"],
            **names.peft_targets(targets),
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
            from art_mega.trainer.families import decoder_config

            hf_config = decoder_config(read_hf_config(model_dir))  # a wrapper's sparse text_config filled
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
        from art_mega.trainer.prepare.memory_plan import REPLICA_ACTIVATION_RESERVE_BYTES

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
        """The run's memory plan (`trainer.prepare.memory_plan`) from config.json, the backend's LoRA,
        rows, context and `gpu_memory_utilization`, and the hosts' NVML GPU memory; logged in one
        line (and a line when rows up to the limit would not fit). Sets `max_model_len` and
        `seq_len` when None (`_engine_for`).

        Raises:
            MemoryPlanError: a trainer rank or a replica does not fit its GPU memory (never on
                CPU ranks and replicas, whose plan is only logged).
        """
        from art_mega.inference.protocol import ReplicaLaunch
        from art_mega.trainer.hf_checkpoint import read_hf_config
        from art_mega.trainer.prepare import memory_plan

        shape, valid_tp = memory_plan.ModelShape.from_model_dir(model_dir)
        engine = self._engine_for(topology, model_dir)
        replica_dtype = engine["dtype"]
        if replica_dtype == "auto":  # vLLM serves float32 checkpoints in 16 bits too
            replica_dtype = (
                "float16" if read_hf_config(model_dir).get("torch_dtype") == "float16" else "bfloat16"
            )
        lora = LoraConfig(rank=self.lora["rank"], targets=self._lora_targets(model_dir)[0])
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

    def _engine_config(
        self, model: Any, resolved: Any, topology: Any, checkpoints: Path, committed: int | None
    ) -> EngineConfig:
        """The ranks' `EngineConfig` of a checked registration: the base model, ART's optimizer
        (`trainer_args`; the RL steps' decay and clip kept for `train`), the backend's LoRA, dtype
        and micro-batch rows, the committed step to resume from or else the warm start."""
        trainer_args = getattr(model, "_internal_config", {}).get("trainer_args") or {}
        optimizer, rl_decay, rl_clip = art_optimizer(trainer_args)
        self._rl_optimizer = (rl_decay, rl_clip)  # ART's RL steps decay and clip differently from SFT's
        return EngineConfig(
            model_dir=str(resolved.model_dir),
            optimizer=optimizer,
            lora=LoraConfig(
                rank=self.lora["rank"],
                alpha=self.lora["alpha"],
                targets=self._lora_targets(resolved.model_dir)[0],
            ),
            dtype=self._trainer_dtype(topology),
            micro_batch_rows=self.micro_batch_rows,
            resume_dir=None if committed is None else str(checkpoint.step_dir(checkpoints, committed)),
            # a committed step's own adapter and optimizer state replace the warm start
            warm_start=str(resolved.warm_start) if committed is None and resolved.warm_start else None,
        )

    def _replica_launch(self, model: Any, resolved: Any, run_dir: Path, topology: Any) -> Any:
        """The `ReplicaLaunch` of every replica of a checked registration (ART's server
        arguments, the engine settings of `_engine_for`)."""
        from art_mega.inference.protocol import ReplicaLaunch
        from art_mega.inference.tool_calls import added_tokens, tool_call_parser
        from art_mega.trainer.hf_checkpoint import read_hf_config

        engine = self._engine_for(topology, resolved.model_dir)
        return ReplicaLaunch(
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
        from art_mega.inference.recovery import ReplicaRecovery
        from art_mega.inference.router import PolicyRouter, ReplicaEndpoint
        from art_mega.inference.sleep import SharedGpuReplicas
        from art_mega.trainer.remote import TrainerService

        topology = self._runtime.topology
        self._model, self._model_dir = model, resolved.model_dir
        checkpoints = checkpoint.checkpoints_dir(run_dir)
        checkpoints.mkdir(parents=True, exist_ok=True)
        checkpoint.clean_uncommitted(checkpoints)  # a crashed save's leftovers; no rank runs yet
        self._run_dir = run_dir
        if plan is not None:
            from art_mega.trainer.prepare.memory_plan import write_plan

            write_plan(run_dir, plan)
        config = self._engine_config(model, resolved, topology, checkpoints, committed)
        launch = self._replica_launch(model, resolved, run_dir, topology)
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
