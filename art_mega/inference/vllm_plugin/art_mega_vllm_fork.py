"""art-mega's vLLM general plugin for a CPU replica's start-up: a single-process replica forks its
engine core, and the server resolves its processor's chat template while the engine core loads.

It runs inside a CPU replica's vLLM interpreter (torch and vllm, no art_mega) and imports nothing
else; vLLM loads it in each of its processes through the entry point `art_mega_fork` in the
dist-info beside this file, as `art_mega_vllm_lora`.

Why: vLLM 0.32's OpenAI server always runs its engine core in a second process
(`AsyncLLM` -> `make_async_mp_client`). Its CLI starts that process with `spawn` unless
VLLM_WORKER_MULTIPROC_METHOD says otherwise (entrypoints/serve/utils/api_utils.py), and
`CpuPlatform.check_and_update_config` then sets spawn unconditionally, so the engine core starts
a fresh interpreter and imports vLLM a second time. Forking it from the server, which has
already imported vLLM, skips that import: for SmolLM2-135M on this 2-core machine, 24 s -> 13 s
from the command to a healthy /health (one start each, nothing else running; the server's log
shows the engine core initializing 10 s after the server parsed its arguments with spawn, 1 s
with fork), with the same greedy tokens and no slower decoding.

A spawned engine core gets two things a forked one would not: the libraries vLLM's CPU platform
puts in LD_PRELOAD for its children (torch's libgomp, so that one OpenMP runtime serves the
thread binding, and vLLM's bundled tcmalloc when the wheel has one), which act only at exec, and
OpenMP variables set before a worker process starts (multiproc_executor's `configure_omp_envs`),
which an OpenMP runtime already loaded ignores. So the fork is kept to the case where neither is
lost:
- the CPU platform, one engine-core process running its worker in-process: tensor x pipeline x
  data parallel size 1 and vLLM's `uni` executor (art-mega's CPU replicas: `--distributed-
  executor-backend uni` and VLLM_ENABLE_V1_MULTIPROCESSING=0, without which the CPU platform
  switches `uni` to `mp` and the engine core starts a worker process of its own);
- every library in LD_PRELOAD, as vLLM's `check_and_update_config` leaves it, already mapped in
  this server process (`/proc/self/maps`) and no other file of the same name mapped beside it
  (`preload_problem`): what the spawned child would have preloaded is what the forked one has;
- VLLM_WORKER_MULTIPROC_METHOD=fork in the environment the server started with:
  `art_mega.inference.replica.vllm_env(on_cpu=True)` sets it unless the environment names a
  method, so a user's explicit spawn wins.
A forked child also inherits what a spawned one would not: the server's open files. Two of
them matter, and `forked_child` (run in every child this server forks, `os.register_at_fork`)
deals with both:
- the server's TCP socket (vLLM binds its port before it starts the engine core, and listens
  on it after): a child that kept it would hold the port open after the server died, so a
  replica restarted on the same port could not bind it, and connections would queue with nobody
  answering. The child's copy is replaced by /dev/null at the same descriptor number
  (`release_listeners`; the engine core uses none of the server's TCP sockets), so the server's
  Python socket object, which the child also inherits, closes /dev/null, never a descriptor
  reused for something else;
- its parent: a spawned engine core outlives a killed server too, but holds nothing of it. The
  forked one is given a parent-death signal (SIGKILL, `prctl(PR_SET_PDEATHSIG)`), so the engine
  core ends with the server rather than waiting to be stopped with the replica's process group.
  Linux sends it when the forking *thread* ends, so it is set only for a fork from the server's
  main thread (where vLLM 0.32 starts its engine core); the replica log says when it is not.
One hazard stays with fork, as for vLLM's own fork on GPUs: an OpenMP runtime that ran a
parallel region in the server before the fork leaves the child a thread pool whose threads are
gone. vLLM 0.32's server runs no torch op before it starts the engine core, nor do art-mega's
plugins; a replica's first request (its warm-up, `replica.wait_ready`) decodes in the child.
Otherwise (or with a vLLM whose `CpuPlatform.check_and_update_config` is not the classmethod
`(vllm_config)` this was written for) it changes nothing, and the replica log says why.

The chat template (`overlap_chat_template`): before it serves, vLLM 0.32's server renders one
chat message (`BaseRenderer.warmup`), and for a request without tools that looks for a chat
template of the model's processor first (`vllm.renderers.hf._try_get_processor_chat_template`,
cached per tokenizer name, revisions and trust_remote_code), which loads the whole processor
(for a text model, its tokenizer) a second time: 1.5 s for SmolLM2-135M on this 2-core machine
(a py-spy profile of a replica start), spent after the engine core is ready, while the server
idled for 3.8 s before that waiting for the engine core to load its weights. So once vLLM has
started the engine core (`start_mm_warmup_in_background`, where vLLM overlaps a multimodal
model's own warm-up with the same wait), a thread runs that same lookup with the arguments
vLLM's `resolve_chat_template` passes it, and `warmup` waits for that thread before it renders:
the warm-up finds the result in vLLM's cache. The replica log says how long the lookup took and
whether the warm-up still loaded a processor itself (`cached_get_processor` misses after the
thread), which would mean vLLM now asks with other arguments. With a server given
`--chat-template`, or tools in its default chat template arguments, vLLM needs no processor
template and the thread's load is spent in that wait for nothing.

Only a text model's server does this (a multimodal one's warm-up shares vLLM's single multimodal
executor, kept apart from other threads). A server that runs in a warm interpreter
(art_mega_vllm_warm.py) and whose renderer this patched also lists its files for the next start
to read ahead once more, RELIST_DELAY_S after its warm-up (`relist`): the warm script listed them
after its import, before the server imported and touched the rest.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import sys
import threading
import time

METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"

_STARTED_PRELOAD = os.environ.get("LD_PRELOAD", "")
"""LD_PRELOAD as this process started (vLLM's CPU platform extends it later, for its children)."""

_USER_METHOD = os.environ.get(METHOD_ENV)
"""The start method when vLLM imports this plugin: the replica's environment's, or the spawn that
vLLM's CLI sets before that when the environment names none (the platform's own spawn comes
later, in `check_and_update_config`)."""


def fork_problem(vllm_config: object, user_method: str | None) -> str | None:
    """Why this replica's engine core must keep vLLM's spawn by its configuration (None: it may
    fork, as far as the configuration goes; the libraries are `preload_problem`'s).

    `vllm_config`: vLLM's VllmConfig after `check_and_update_config` (reads `parallel_config`'s
    `world_size`, `data_parallel_size` and `distributed_executor_backend`); `user_method`:
    VLLM_WORKER_MULTIPROC_METHOD as it was when this module was imported (the replica's
    environment, or spawn set by vLLM's CLI where the environment named none), or None.
    """
    if user_method != "fork":
        return f"VLLM_WORKER_MULTIPROC_METHOD is {user_method!r}, not 'fork'"
    parallel = getattr(vllm_config, "parallel_config", None)
    world = getattr(parallel, "world_size", None)
    data = getattr(parallel, "data_parallel_size", None)
    if world != 1 or data != 1:
        return f"the replica runs {world} worker(s) x {data} data-parallel engine(s), not one process"
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend != "uni":
        return (
            f"the engine core runs its worker through the {backend!r} executor, not in-process ('uni'; "
            "the CPU platform picks 'mp' unless VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    return None


def preload_problem(preload: str, mapped: set[str], started_with: str = "") -> str | None:
    """Why a forked engine core would not have the libraries a spawned one preloads (None: it
    would). `preload`: LD_PRELOAD as vLLM leaves it for its children (paths separated by ':' or
    spaces); `mapped`: the real paths of the files mapped in this process; `started_with`:
    LD_PRELOAD as this process started (`_STARTED_PRELOAD`).

    Each library must be mapped, and no other file of the same library (the name before `.so`:
    a system `libgomp.so.1.0.0` beside torch's `libgomp.so.1`; a vendored `libgomp-<hash>.so.1`
    is another library, loaded beside torch's in a spawned child too) mapped beside it. A
    malloc replacement (tcmalloc, jemalloc) replaces malloc only when preloaded, not when mapped
    later, so it must also be in `started_with`.
    """
    import os.path

    def library(path: str) -> str:
        return os.path.basename(path).split(".so")[0]

    started = {os.path.realpath(e) for e in started_with.replace(" ", ":").split(":") if e}
    for entry in preload.replace(" ", ":").split(":"):
        if not entry:
            continue
        path = os.path.realpath(entry)
        if path not in mapped:
            return f"LD_PRELOAD names {entry}, which is not loaded in this process"
        if "malloc" in library(path) and path not in started:
            return f"LD_PRELOAD names {entry}, a malloc this process did not start with"
        others = sorted(m for m in mapped if library(m) == library(path) and m != path)
        if others:
            return f"this process maps {others[0]} beside LD_PRELOAD's {entry}"
    return None


def release_listeners(fd_dir: str = "/proc/self/fd") -> list[int]:
    """Replace each TCP socket (IPv4 or IPv6: bound, listening or connected) among this
    process's descriptors with /dev/null, in place (`os.dup2`, so the descriptor number stays
    taken); returns their numbers.

    Run in a forked child: its copies of the parent's TCP sockets are released, the parent's own
    are untouched (a descriptor closed in one process leaves the other's open). A socket only
    bound at the fork counts too: vLLM's server binds its port before it starts the engine core
    and listens on it after, and a listen() in the parent makes the child's copy a listening
    socket as well (one socket, two descriptors). Descriptors that are not sockets, or are other
    sockets (UNIX, UDP), are left alone; one that closes meanwhile, or cannot be read, is skipped.
    """
    released = []
    try:
        fds = [int(name) for name in os.listdir(fd_dir)]
    except OSError:
        return released
    for fd in fds:
        try:
            if not os.readlink(f"{fd_dir}/{fd}").startswith("socket:"):
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with probe:
            tcp = probe.family in (socket.AF_INET, socket.AF_INET6) and probe.type == socket.SOCK_STREAM
        if tcp:
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, fd, inheritable=False)
            finally:
                os.close(null)
            released.append(fd)
    return released


_FORKING: dict = {"pid": 0, "main_thread": False, "hooked": False}
"""The process and thread that forked last (set in the parent by `_before_fork`, read in the child),
and whether the fork hooks are installed (once per process)."""


def _before_fork() -> None:
    _FORKING["pid"] = os.getpid()
    _FORKING["main_thread"] = threading.current_thread() is threading.main_thread()


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> bool:
    """Have Linux send `signum` to this process when its parent (the thread that forked it)
    ends (`prctl(PR_SET_PDEATHSIG)`); exit at once if `parent_pid` has already gone. Returns
    False where prctl is not available or fails (not Linux)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signum), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
            return False
    except (AttributeError, OSError):
        return False
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    return True


def forked_child() -> None:
    """In a child this server forked: release its listening sockets and arm the parent-death
    signal (see the module docstring); one line to stderr (the replica log)."""
    released = release_listeners()
    if _FORKING["main_thread"]:
        dies = die_with_parent(_FORKING["pid"])
        death = "ends with the server" if dies else "could not arm a parent-death signal"
    else:
        death = "has no parent-death signal (forked from a thread other than the server's main thread)"
    print(
        f"art-mega: vLLM fork plugin: forked process {os.getpid()} released TCP socket descriptor(s) "
        f"{released or 'none'} and {death}",
        file=sys.stderr,
        flush=True,
    )


def mapped_files() -> set[str]:
    """The real paths of the files mapped in this process (Linux `/proc/self/maps`; empty where
    it cannot be read, so that `preload_problem` keeps spawn)."""
    import os.path

    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return set()
    return {
        os.path.realpath(parts[5])
        for parts in (line.split(maxsplit=5) for line in lines)
        if len(parts) == 6 and parts[5].startswith("/")
    }


def register() -> None:
    """vLLM's entry point: on the CPU platform, make `check_and_update_config` leave the
    environment's fork in place for a single-process replica whose preloaded libraries this
    process already has. Prints one line to stderr (the replica log) saying which it chose and
    why; a second call in the same process does nothing."""
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
            problem = preload_problem(os.environ.get("LD_PRELOAD", ""), mapped_files(), _STARTED_PRELOAD)
        if problem is None:
            os.environ[METHOD_ENV] = "fork"
            if not _FORKING["hooked"]:
                _FORKING["hooked"] = True
                os.register_at_fork(before=_before_fork, after_in_child=forked_child)
            print(f"{prefix} the engine core forks from the API server", file=sys.stderr, flush=True)
        else:
            print(f"{prefix} the engine core keeps vLLM's spawn: {problem}", file=sys.stderr, flush=True)

    check_and_update_config._art_mega = True  # type: ignore[attr-defined]
    platform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    overlap_chat_template(prefix)


_TEMPLATE: dict = {"patched": False, "thread": None, "seconds": None, "misses": None}
"""`overlap_chat_template`'s state in this process: whether it patched vLLM's renderer, the
lookup's thread, its seconds, and `cached_get_processor`'s misses once it ended."""


def _template_problem(base: object, hf: object, processor: object) -> str | None:
    """Why vLLM's renderer is not the one `overlap_chat_template` was written for, or None."""
    lookup = getattr(hf, "_try_get_processor_chat_template", None)
    wanted = {
        "start_mm_warmup_in_background": ("self",),
        "warmup": ("self", "chat_params"),
    }
    for name, parameters in wanted.items():
        method = getattr(getattr(base, "BaseRenderer", None), name, None)
        if method is None or tuple(inspect.signature(method).parameters) != parameters:
            return f"BaseRenderer.{name} is not the method {parameters} it was written for"
    if lookup is None or tuple(inspect.signature(lookup).parameters) != (
        "tokenizer",
        "revision",
        "code_revision",
        "trust_remote_code",
    ):
        return "vllm.renderers.hf has no _try_get_processor_chat_template(tokenizer, revision, code_revision, trust_remote_code)"
    if not hasattr(getattr(processor, "cached_get_processor", None), "cache_info"):
        return "vllm.transformers_utils.processor.cached_get_processor is not an lru_cache"
    return None


RELIST_DELAY_S = 3.0
"""Seconds after its warm-up at which a warm interpreter's server lists its files again: by then
it serves (uvicorn and its lifespan, imported after the warm-up, are in)."""


def relist() -> None:
    """In a warm interpreter's server that warmed up: list again, in a thread, RELIST_DELAY_S
    later, the files it read (`art_mega.readahead`, which the warm script loaded as
    `art_mega_readahead` and gave its listing), now with what the server imported and touched
    since the hand-over."""
    readahead = sys.modules.get("art_mega_readahead")
    listing = getattr(readahead, "LISTING", None)
    if not listing:
        return

    def later() -> None:
        time.sleep(RELIST_DELAY_S)
        readahead.record(listing)

    threading.Thread(target=later, name="art-mega-relist", daemon=True).start()


def overlap_chat_template(prefix: str) -> None:
    """In vLLM's API server: have the processor chat template lookup run while the engine core
    starts (see the module docstring). Does nothing in a process that has not imported vLLM's
    renderers (an engine core started with spawn); says on stderr when vLLM's renderer is not
    the one this was written for. Once per process."""
    if _TEMPLATE["patched"] or "vllm.renderers.base" not in sys.modules:
        return
    from vllm.renderers import base, hf
    from vllm.transformers_utils import processor

    problem = _template_problem(base, hf, processor)
    if problem is not None:
        print(
            f"{prefix} the chat template is resolved after the engine core starts: {problem}",
            file=sys.stderr,
            flush=True,
        )
        return
    _TEMPLATE["patched"] = True
    renderer_cls = base.BaseRenderer
    start_original = renderer_cls.start_mm_warmup_in_background
    warmup_original = renderer_cls.warmup

    def lookup(renderer: object) -> None:
        started = time.perf_counter()
        try:  # the arguments of vLLM 0.32's resolve_chat_template
            model_config = renderer.model_config  # type: ignore[attr-defined]
            hf._try_get_processor_chat_template(
                renderer.get_tokenizer(),  # type: ignore[attr-defined]
                revision=model_config.tokenizer_revision,
                code_revision=(
                    model_config.code_revision if model_config.tokenizer == model_config.model else None
                ),
                trust_remote_code=model_config.trust_remote_code,
            )
        except Exception:  # noqa: BLE001 - the warm-up then looks it up itself, and reports
            pass
        finally:
            _TEMPLATE["seconds"] = time.perf_counter() - started
            _TEMPLATE["misses"] = processor.cached_get_processor.cache_info().misses

    def start_mm_warmup_in_background(self: object) -> None:
        start_original(self)
        # a text model only: a multimodal one's own warm-up runs now on vLLM's single multimodal
        # executor, which vLLM keeps apart from other threads (numba's workqueue aborts the
        # process on concurrent use, renderers/base.py)
        if (
            _TEMPLATE["thread"] is None
            and isinstance(self, hf.HfRenderer)
            and self.tokenizer is not None
            and getattr(self, "mm_processor", None) is None
        ):
            thread = threading.Thread(target=lookup, args=(self,), name="art-mega-chat-template", daemon=True)
            _TEMPLATE["thread"] = thread
            thread.start()

    def warmup(self: object, chat_params: object) -> None:
        thread = _TEMPLATE["thread"]
        if thread is None:
            warmup_original(self, chat_params)
            relist()
            return
        thread.join()
        warmup_original(self, chat_params)
        relist()
        again = processor.cached_get_processor.cache_info().misses != _TEMPLATE["misses"]
        seconds = _TEMPLATE["seconds"] or 0.0
        print(
            f"{prefix} looked up the processor chat template in {seconds:.2f} s while the engine"
            f" core started; the warm-up {'loaded a processor again' if again else 'loaded no processor'}",
            file=sys.stderr,
            flush=True,
        )

    renderer_cls.start_mm_warmup_in_background = start_mm_warmup_in_background  # type: ignore[method-assign]
    renderer_cls.warmup = warmup  # type: ignore[method-assign]
