"""A warm interpreter for a replica: imports a server module now, runs it as `python -m` later.

Run by the agent as `python art_mega_vllm_warm.py OUTPUT MODULE [PRELOAD ...]` in the replica's
interpreter (vLLM's, where art-mega itself is not installed: this file imports only the standard
library). It imports MODULE and each PRELOAD module (best effort: a PRELOAD that fails is named on
stderr and skipped), then reads one JSON line from stdin:

    {"argv": [...], "env": {...}, "cwd": "...", "log": "/path/replica.log"}

and becomes the replica: it appends what it printed so far (stdout and stderr point at a scratch
file OUTPUT until then, which is then removed) to `log`, points stdout and stderr at `log`,
replaces its environment with `env`, changes to `cwd`, sets `sys.argv` to MODULE's file plus
`argv` and runs MODULE as `__main__`, as `python -m MODULE *argv` would.

A MODULE that failed to import is reported the same way: its traceback lands in `log` once a
request comes, and the process exits with code 1. End of input (the agent closed the pipe, or
died) ends the process with code 0 before anything runs.

The agent uses it only where the environment `env` matches the one this interpreter was started
with, except for variables read after import (`art_mega.inference.warm`): modules that read
their environment when imported (vLLM's logging, torch's threads) then see the same values.
"""

from __future__ import annotations

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


def main(argv: list[str]) -> int:
    scratch, module, preload = argv[0], argv[1], argv[2:]
    failure = None
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
    print(
        f"art-mega: warm interpreter {os.getpid()}: {module} imported, waiting", file=sys.stderr, flush=True
    )
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
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    spec = importlib.util.find_spec(module)
    sys.argv = [spec.origin if spec is not None and spec.origin else module, *request["argv"]]
    sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
