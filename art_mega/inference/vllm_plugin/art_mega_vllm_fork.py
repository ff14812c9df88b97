"""art-mega's vLLM general plugin: a single-process CPU replica forks its engine core.

It runs inside a CPU replica's vLLM interpreter (torch and vllm, no art_mega) and imports nothing
else; vLLM loads it in each of its processes through the entry point `art_mega_fork` in the
dist-info beside this file, as `art_mega_vllm_lora`.

Why: vLLM 0.32's OpenAI server always runs its engine core in a second process
(`AsyncLLM` -> `make_async_mp_client`; `VLLM_ENABLE_V1_MULTIPROCESSING` only concerns the offline
`LLM`). Its CLI starts that process with `spawn` unless VLLM_WORKER_MULTIPROC_METHOD says
otherwise (entrypoints/serve/utils/api_utils.py), and `CpuPlatform.check_and_update_config`
then sets spawn unconditionally, so the engine core starts a fresh interpreter and imports vLLM
a second time. Forking it from the server, which has already imported vLLM, skips that import:
for SmolLM2-135M on this 2-core machine, 24 s -> 16 s from the command to a healthy /health (one
start each, nothing else running; the server's log shows the engine core initializing 10 s
after the server parsed its arguments with spawn, 1 s with fork).

`art_mega.inference.replica.vllm_env(on_cpu=True)` sets VLLM_WORKER_MULTIPROC_METHOD=fork unless
the replica's environment names a method; this plugin keeps that choice past the CPU platform's
override, and only where it was measured: the CPU platform and one engine-core process with no
worker processes (tensor x pipeline x data parallel size 1, the `uni` executor art-mega gives
CPU replicas). Otherwise (another method in the environment, more processes, or a vLLM whose
`CpuPlatform.check_and_update_config` is not the classmethod `(vllm_config)` this was written
for) it changes nothing and says so.
"""

from __future__ import annotations

import inspect
import os
import sys

METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"

_USER_METHOD = os.environ.get(METHOD_ENV)
"""The start method in the environment this process began with, before vLLM sets its own."""


def fork_problem(vllm_config: object, user_method: str | None) -> str | None:
    """Why this replica's engine core must keep vLLM's spawn (None: it may fork).

    `vllm_config`: vLLM's VllmConfig (reads `parallel_config.world_size` and
    `parallel_config.data_parallel_size`); `user_method`: VLLM_WORKER_MULTIPROC_METHOD as the
    replica's environment gave it, or None.
    """
    if user_method != "fork":
        return f"the replica's environment sets VLLM_WORKER_MULTIPROC_METHOD={user_method!r}, not 'fork'"
    parallel = getattr(vllm_config, "parallel_config", None)
    world = getattr(parallel, "world_size", None)
    data = getattr(parallel, "data_parallel_size", None)
    if world != 1 or data != 1:
        return f"the replica runs {world} worker(s) x {data} data-parallel engine(s), not one process"
    return None


def register() -> None:
    """vLLM's entry point: on the CPU platform, make `check_and_update_config` leave the
    environment's fork in place for a single-process replica. Prints one line to stderr (the replica log) when it patches or
    why it does not; a second call in the same process does nothing."""
    import vllm
    from vllm.platforms import current_platform

    prefix = f"art-mega: vLLM fork plugin (vllm {vllm.__version__}):"
    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    original = inspect.getattr_static(platform, "check_and_update_config", None)
    if getattr(original, "__func__", None) is not None and getattr(original.__func__, "_art_mega", False):
        return
    if not isinstance(original, classmethod) or tuple(inspect.signature(original.__func__).parameters) != (
        "cls",
        "vllm_config",
    ):
        print(
            f"{prefix} changed nothing: CpuPlatform.check_and_update_config is not the classmethod"
            " (vllm_config)",
            file=sys.stderr,
            flush=True,
        )
        return

    def check_and_update_config(cls: type, vllm_config: object) -> None:
        original.__func__(cls, vllm_config)
        problem = fork_problem(vllm_config, _USER_METHOD)
        if problem is None:
            os.environ[METHOD_ENV] = "fork"
            print(f"{prefix} the engine core forks from the API server", file=sys.stderr, flush=True)
        else:
            print(f"{prefix} the engine core keeps vLLM's spawn: {problem}", file=sys.stderr, flush=True)

    check_and_update_config._art_mega = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
