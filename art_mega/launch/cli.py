"""The `art-mega` command line: a thin layer that parses options and calls the launch library.

Bad input ends with one sentence and exit code 2 (a traceback only with --debug).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from typing import Annotated

import typer

from art_mega.errors import UserError

app = typer.Typer(
    name="art-mega",
    help="Train LLM agents with GRPO and SFT on one machine or many.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ProgramOpt = Annotated[
    str,
    typer.Option(
        "--program", help="path/to/script.py:main or package.module:main (an async def main(launch))."
    ),
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]
LeaseOpt = Annotated[
    str | None,
    typer.Option(
        "--controller-lease",
        help="Seconds an agent waits for a word from its controller before it stops its children and "
        "exits, freeing its port (default: $ART_MEGA_CONTROLLER_LEASE or 20).",
    ),
]


def _fail(message: str, code: int) -> None:
    print(f"art-mega: error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def _guarded(debug: bool, body):  # type: ignore[no-untyped-def]
    """Run `body()` and turn known errors into one sentence and an exit code."""
    from pydantic import ValidationError

    from art_mega.errors import format_validation_error

    try:
        return body()
    except typer.Exit:
        raise
    except UserError as exc:
        if debug:
            raise
        _fail(str(exc), exc.exit_code)
    except ValidationError as exc:
        if debug:
            raise
        _fail(format_validation_error(exc), 2)
    except Exception as exc:
        from art_mega.runtime.client import AgentError
        from art_mega.runtime.local_agent import AgentStartError

        if debug or not isinstance(exc, (AgentError, AgentStartError)):
            raise
        _fail(str(exc), 1)


def _check_address(option: str, value: str) -> None:
    from art_mega.topology import EndpointSpec

    try:
        EndpointSpec.parse(value)
    except UserError as exc:
        raise UserError(f"{option} {value!r}: {exc}") from None


def _check_launch_id(value: str | None) -> None:
    import re

    if value is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", value):
        raise UserError(f"--launch-id {value!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is out of range; use 0 (a free port) to 65535")


def _check_timeout(value: float) -> None:
    if not value > 0:
        raise UserError(f"--startup-timeout {value} must be a positive number of seconds")


@app.command()
def local(
    program: ProgramOpt,
    port: Annotated[int, typer.Option(help="Agent port on 127.0.0.1; 0 picks a free port.")] = 0,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", help="Seconds to wait for the agent.")
    ] = 60.0,
    controller_lease: LeaseOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM on this machine with one loopback agent."""

    def body() -> int:
        from art_mega.launch.controller import run_local
        from art_mega.launch.program import load_program, parse_program
        from art_mega.runtime.lease import parse_controller_lease

        _check_port(port)
        _check_timeout(startup_timeout)
        lease_s = parse_controller_lease(controller_lease)
        ref = parse_program(program)
        main = load_program(ref)
        return asyncio.run(run_local(main, ref, port, startup_timeout, debug, lease_s))

    raise typer.Exit(_guarded(debug, body))


@app.command()
def controller(
    program: ProgramOpt,
    worker: Annotated[
        list[str], typer.Option("--worker", help="tcp://HOST:PORT of a running agent (repeatable).")
    ],
    launch_id: Annotated[
        str | None, typer.Option("--launch-id", help="The launch id the workers were started with.")
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM over agents started elsewhere with `art-mega worker` (secret in ART_MEGA_SECRET)."""

    def body() -> int:
        from art_mega.launch.controller import run_attached
        from art_mega.launch.program import load_program, parse_program
        from art_mega.runtime.auth import secret_from_env

        for address in worker:
            _check_address("--worker", address)
        _check_launch_id(launch_id)
        try:
            secret = secret_from_env()
        except ValueError as exc:
            raise UserError(str(exc)) from None
        ref = parse_program(program)
        main = load_program(ref)
        return asyncio.run(run_attached(main, ref, worker, secret, launch_id, debug))

    raise typer.Exit(_guarded(debug, body))


@app.command()
def ssh(
    program: ProgramOpt,
    host: Annotated[
        list[str],
        typer.Option(
            "--host", help="[USER@]SSH_TARGET[=WORKER_HOST] (repeatable); the agent binds WORKER_HOST."
        ),
    ],
    python: Annotated[
        str | None, typer.Option("--python", help="Python on every host (default: this interpreter's path).")
    ] = None,
    port: Annotated[int, typer.Option("--port", help="Agent port on every host.")] = 22222,
    ssh_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--ssh-arg",
            help="ssh option for launch and stop: -F FILE, -i KEY, -p PORT, -l USER, -J JUMP, -o K=V.",
        ),
    ] = None,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", help="Seconds to wait for every agent.")
    ] = 60.0,
    controller_lease: LeaseOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM with an agent started over SSH on every --host."""

    def body() -> int:
        from art_mega.launch.program import load_program, parse_program
        from art_mega.launch.ssh import default_python, plan_hosts, run_ssh
        from art_mega.runtime.lease import parse_controller_lease

        _check_timeout(startup_timeout)
        lease_s = parse_controller_lease(controller_lease)
        plan_hosts(host, ssh_arg or [], port)
        ref = parse_program(program)
        main = load_program(ref)
        chosen = python or default_python()
        return asyncio.run(
            run_ssh(main, ref, host, chosen, port, ssh_arg or [], startup_timeout, debug, lease_s)
        )

    raise typer.Exit(_guarded(debug, body))


@app.command()
def skypilot(
    program: ProgramOpt,
    port: Annotated[
        int, typer.Option("--port", help="Agent port on every node; rank 0 also uses PORT+1.")
    ] = 22222,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", help="Seconds to wait for the agent and for every node.")
    ] = 120.0,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM across a SkyPilot task: run this same command on every node (its run: section)."""

    def body() -> int:
        from art_mega.launch.program import load_program, parse_program
        from art_mega.launch.skypilot import prepare, run_skypilot

        _check_timeout(startup_timeout)
        if not 1 <= port <= 65534:
            raise UserError(f"--port {port} is out of range; use 1..65534 (rank 0 also listens on PORT+1)")
        node, secret = prepare(os.environ)
        ref = parse_program(program)
        main = load_program(ref)
        return asyncio.run(run_skypilot(main, ref, node, secret, port, startup_timeout, debug))

    raise typer.Exit(_guarded(debug, body))


@app.command()
def worker(
    address: Annotated[
        str, typer.Option("--address", help="tcp://HOST:PORT to listen on (port 0 = a free port).")
    ],
    launch_id: Annotated[
        str | None,
        typer.Option("--launch-id", help="Id this agent reports (default: $ART_MEGA_LAUNCH_ID or random)."),
    ] = None,
    secret_stdin: Annotated[
        bool, typer.Option("--secret-stdin", help="Read the launch secret from the first line of stdin.")
    ] = False,
    exit_on_stdin_eof: Annotated[
        bool, typer.Option("--exit-on-stdin-eof", help="Stop this agent when stdin closes (used over SSH).")
    ] = False,
    controller_lease: LeaseOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Run this host's agent. The launch secret comes from ART_MEGA_SECRET or stdin, never argv."""

    def body() -> int:
        from art_mega.runtime.agent import agent_main
        from art_mega.runtime.auth import load_secret
        from art_mega.runtime.lease import parse_controller_lease

        _check_address("--address", address)
        _check_launch_id(launch_id)
        lease_s = parse_controller_lease(controller_lease)
        raw = sys.stdin.readline() if secret_stdin else os.environ.get("ART_MEGA_SECRET")
        try:
            secret = load_secret(raw)
        except ValueError as exc:
            message = str(exc)
            if secret_stdin:
                message = message.replace("ART_MEGA_SECRET", "the secret line on stdin (--secret-stdin)")
            raise UserError(message) from None
        os.environ.pop("ART_MEGA_SECRET", None)
        chosen = launch_id or os.environ.get("ART_MEGA_LAUNCH_ID") or secrets.token_hex(8)
        return agent_main(address, chosen, secret, exit_on_stdin_eof, lease_s)

    raise typer.Exit(_guarded(debug, body))


@app.command()
def report(
    run_dir: Annotated[str, typer.Argument(help="A model's run directory (it holds history.jsonl).")],
    debug: DebugOpt = False,
) -> None:
    """Write PNG plots of RUN_DIR (reward, loss, KL, grad norm, step time) and print a summary."""

    def body() -> int:
        from pathlib import Path

        from art_mega.metrics import read_history
        from art_mega.report import summary, write_report

        paths = write_report(run_dir)
        for label, value in summary(read_history(Path(run_dir) / "history.jsonl")):
            print(f"{label:<32} {value}")
        for path in paths:
            print(f"wrote {path}")
        return 0

    raise typer.Exit(_guarded(debug, body))


def main() -> None:
    """Console-script entry point."""
    app()
