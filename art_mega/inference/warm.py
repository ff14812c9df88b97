"""A warm replica interpreter on this host: vLLM's server module imported before the start asks.

Importing `vllm.entrypoints.openai.api_server` is most of a CPU replica's start (8.6 s of the
15.3 s from exec to a healthy SmolLM2-135M server alone on this 2-core machine, and 12 s while
the trainer rank starts beside it). The backend asks each CPU replica host's agent to warm the
replica's interpreter (`INFERENCE_WARM`) when `register` begins, so the import runs while the
cluster is proved; the start (`replica.spawn_replica`) then hands the warm process its argv,
environment and log instead of exec'ing a new one (`vllm_plugin/art_mega_vllm_warm.py` is the
interpreter's side).

The warm process is used only when the start's command is `<same python> -m <same module>` and
its environment equals the one the process was started with, except for variables vLLM reads
after import (`LATE_ENV`); otherwise it is stopped and the replica starts fresh, and the
replica's log says why. One warm process at most per agent; an agent's close and
`INFERENCE_STOP` stop it. A replica restarted after a crash starts fresh (a warm process kept
for it would take a core's worth of import from the first rollouts).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from art_mega.agent.supervisor import spawn_child, stop_process

WARM_SCRIPT = Path(__file__).parent / "vllm_plugin" / "art_mega_vllm_warm.py"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PRELOAD = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.lora.punica_wrapper.punica_cpu",
)
"""Modules a CPU replica's engine core imports after the fork (1.1 s of imports there); a
module missing from another vLLM version is skipped."""
LATE_ENV = frozenset({"VLLM_CPU_KVCACHE_SPACE"})
"""Variables that may differ between the warm process and the start: vLLM reads them through
`vllm.envs` when the engine is configured, not when imported."""
_STOP_GRACE_S = 2.0


@dataclass
class WarmProcess:
    """One warm interpreter: `python` runs `module`, started with `env`; its early output goes to
    `output` until a start hands it the replica's log."""

    python: str
    module: str
    env: dict[str, str]
    process: asyncio.subprocess.Process
    output: Path

    def mismatch(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why a start of `argv` with `env` cannot use this process, or None."""
        if self.process.returncode is not None:
            return f"the warm interpreter exited with code {self.process.returncode}"
        if list(argv[:3]) != [self.python, "-m", self.module]:
            return (
                f"the start runs {' '.join(argv[:3])!r}, the warm interpreter {self.python} -m {self.module}"
            )
        differ = sorted(
            k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k) and k not in LATE_ENV
        )
        if differ:
            return f"the start's environment differs from the warm interpreter's in {', '.join(differ)}"
        return None


def _append(path: Path, text: str) -> None:
    with open(path, "a", errors="replace") as log:
        log.write(text)


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the process's group (it leads its own session), without waiting."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class WarmInterpreters:
    """This agent's warm replica interpreter (at most one). `module` and `preload` are what it
    imports (vLLM's server by default)."""

    def __init__(self, module: str = SERVER_MODULE, preload: Sequence[str] = PRELOAD) -> None:
        self.module = module
        self.preload = tuple(preload)
        self._warm: WarmProcess | None = None
        self._lock = asyncio.Lock()

    def files_read(self, python: str, cache_dir: str | Path) -> Path:
        """Where the warm script keeps, under the host's `cache_dir`, the listing of the files
        `python`'s import of `module` read (read ahead the next time: see the script)."""
        from art_mega.readahead import listing_path

        return listing_path(cache_dir, "replica", f"{python}\0{self.module}")

    @property
    def current(self) -> WarmProcess | None:
        return self._warm

    async def warm(
        self, python: str, env: Mapping[str, str], cache_dir: str | Path | None = None
    ) -> WarmProcess:
        """Start a warm interpreter `python` with `env` unless one with both already runs (then
        that one); one with another python or environment is stopped first. `cache_dir` (the
        host's cache root; None: none) keeps the list of files its import reads.

        Raises:
            OSError: `python` cannot be executed.
        """
        async with self._lock:
            current = self._warm
            if current is not None and current.mismatch([python, "-m", self.module], env) is None:
                return current
            await self._drop()
            listing = "" if cache_dir is None else str(self.files_read(python, cache_dir))
            fd, output = tempfile.mkstemp(prefix="art-mega-warm-", suffix=".log")
            try:
                process = await spawn_child(
                    [
                        python,
                        str(WARM_SCRIPT),
                        output,
                        listing,
                        self.module,
                        *self.preload,
                    ],
                    env=dict(env),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=fd,
                    stderr=fd,
                )
            except BaseException:
                Path(output).unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
            self._warm = WarmProcess(python, self.module, dict(env), process, Path(output))
            return self._warm

    async def hand_over(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path
    ) -> tuple[asyncio.subprocess.Process | None, str]:
        """Give the warm interpreter the start of replica `name` (`argv` as `python -m module
        ...`, `env`, `cwd`, the log it appends to); returns (its process, "") or (None, why not,
        or "" when there is no warm interpreter). A used process first says so in the log; a
        refused one is stopped, its output so far appended to the log. Either way this agent
        has no warm interpreter afterwards."""
        async with self._lock:
            current, self._warm = self._warm, None
            if current is None:
                return None, ""
            why = current.mismatch(argv, env)
            if why is None:
                pid = current.process.pid
                _append(
                    log_path,
                    f"=== art-mega: replica {name}: its process is the warm interpreter (pid {pid})\n",
                )
                request = {"argv": list(argv[3:]), "env": dict(env), "cwd": cwd, "log": str(log_path)}
                stdin = current.process.stdin
                assert stdin is not None
                try:
                    stdin.write((json.dumps(request) + "\n").encode())
                    await stdin.drain()
                    stdin.close()
                    return current.process, ""
                except (BrokenPipeError, ConnectionResetError) as exc:
                    why = f"the warm interpreter stopped reading ({exc.__class__.__name__})"
                except BaseException:  # cancelled: nobody would own the process it may become
                    _kill_group(current.process)
                    current.output.unlink(missing_ok=True)
                    raise
            await self._stop(current, log_path)
            _append(
                log_path,
                f"=== art-mega: replica {name}: not in warm interpreter {current.process.pid}: {why}\n",
            )
            return None, why

    async def drop(self) -> None:
        """Stop the warm interpreter, if any (idempotent)."""
        async with self._lock:
            await self._drop()

    async def _drop(self) -> None:
        current, self._warm = self._warm, None
        if current is not None:
            await self._stop(current)

    @staticmethod
    async def _stop(warm: WarmProcess, log_path: Path | None = None) -> None:
        """Stop `warm`; its output goes to the end of `log_path` (when given), then away."""
        await stop_process(warm.process, _STOP_GRACE_S)
        if log_path is not None:
            try:
                _append(log_path, warm.output.read_text(errors="replace"))
            except OSError:
                pass
        warm.output.unlink(missing_ok=True)
