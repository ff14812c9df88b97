"""A warm interpreter for a replica: imports a server module now, runs it as `python -m` later.

Run by the agent as `python art_mega_vllm_warm.py OUTPUT FILES MODULE [PRELOAD ...]` in the
replica's interpreter (vLLM's, where art-mega itself is not installed). It imports MODULE and each
PRELOAD module (best effort: a PRELOAD that fails is named on stderr and skipped), then reads one
JSON line from stdin:

    {"argv": [...], "env": {...}, "cwd": "...", "log": "/path/replica.log"}

and becomes the replica: it appends what it printed so far (stdout and stderr point at a scratch
file OUTPUT until then, which is then removed) to `log`, points stdout and stderr at `log`,
makes its environment `env` where `env` differs from the one it was started with (what the
imports set stays, as in a fresh process), changes to `cwd`, sets `sys.argv` to MODULE's file plus
`argv` and runs MODULE as `__main__`, as `python -m MODULE *argv` would.

FILES ("" for none) is the listing (`art_mega.readahead`) of the files the last such import
read: a thread asks the kernel to read them ahead while the import runs, which the import would
otherwise wait for one page fault at a time when the page cache has dropped them (vLLM's server:
14.4 s cold, 10.0 s cold with the read-ahead, 9.2 s warm on this 2-core machine). After a
successful import the listing is written anew, and once more by a server that warmed up where
`art_mega_vllm_fork` patched vLLM's renderer, with what it imported and touched since. A missing or unreadable
listing only costs the read-ahead. This file imports only the standard library, and art_mega/readahead.py (also
standard library only) by its path.

The imports run with Python's cyclic garbage collector paused, and what they built is then frozen
(`gc.freeze`) before the collector resumes: a collection during the import finds almost nothing
to free but walks every object built so far (vLLM's server: 0.7 million objects; 10.8 s against
12.4 s for the import on this machine), and the collections vLLM runs itself later (after the
engine core loads its weights, in the engine core forked from this process, and
`freeze_gc_heap` when the server starts) walk only what was built after the freeze. The cost is
what the imports left as cyclic garbage (about 22,000 objects for vLLM's server), which is never
freed. vLLM freezes its start-up heap the same way once its server is up.

A MODULE that failed to import is reported the same way: its traceback lands in `log` once a
request comes, and the process exits with code 1. End of input (the agent closed the pipe, or
died) ends the process with code 0 before anything runs.

The agent uses it only where the environment `env` matches the one this interpreter was started
with, except for variables read after import (`art_mega.inference.warm`): modules that read
their environment when imported (vLLM's logging, torch's threads) then see the same values.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import runpy
import sys
import traceback


def _take_over_output(scratch: str, log_path: str) -> None:
    """Append `scratch`'s content to `log_path` and remove it, then point fds 1 and 2 at
    `log_path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with open(scratch, "rb") as early, open(log_path, "ab") as copy:
            copy.write(early.read())
        os.unlink(scratch)
    except OSError:
        pass
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _readahead_module():
    """art_mega/readahead.py (standard library only), loaded by its path: art_mega is not
    installed in this interpreter."""
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "readahead.py"
    )
    spec = importlib.util.spec_from_file_location("art_mega_readahead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    scratch, listing, module, preload = argv[0], argv[1], argv[2], argv[3:]
    started_with = dict(os.environ)
    readahead = _readahead_module()
    readahead.read_ahead(listing)
    failure = None
    gc.disable()  # see the module docstring
    try:
        importlib.import_module(module)
    except BaseException:  # noqa: BLE001 - reported in the replica's log when a request comes
        failure = traceback.format_exc()
    if failure is None:
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - an optimisation only
                print(f"art-mega: warm interpreter: could not preload {name}: {exc!r}", file=sys.stderr)
    gc.freeze()
    gc.enable()
    if failure is None:
        readahead.record(listing)
        readahead.LISTING = listing  # the server lists again once it serves (art_mega_vllm_fork)
        sys.modules[readahead.__name__] = readahead
    state = "failed to import" if failure is not None else "imported"
    print(f"art-mega: warm interpreter {os.getpid()}: {module} {state}, waiting", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    request = json.loads(line)
    _take_over_output(scratch, request["log"])
    if failure is not None:
        sys.stderr.write(failure)
        return 1
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as a replica spawned with stdin=DEVNULL
    os.close(devnull)
    _apply_environment(started_with, request["env"])
    os.chdir(request["cwd"])
    spec = importlib.util.find_spec(module)
    sys.argv = [spec.origin if spec is not None and spec.origin else module, *request["argv"]]
    if not sys.flags.safe_path:  # `python -m` puts the working directory first, a script its folder
        sys.path[0] = request["cwd"]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _apply_environment(started_with: dict[str, str], wanted: dict[str, str]) -> None:
    """Make the environment `wanted` where it differs from `started_with` (what this process was
    started with), keeping what the imports set themselves (vLLM sets torch and triton
    variables when imported, as it would in a fresh `python -m`)."""
    for key in started_with.keys() - wanted.keys():
        os.environ.pop(key, None)
    for key, value in wanted.items():
        if started_with.get(key) != value or key not in os.environ:
            os.environ[key] = value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
