"""The `art-mega` command line: a thin layer that parses options and calls the launch library.

Bad input ends with one sentence and exit code 2 (a traceback only with --debug), also where
click/typer refuse an option (an unknown flag, `--port abc`): `main` prints their message as one
line instead of typer's usage box. Numbers are read in ASCII digits only (`int()` and `float()`
also take `٣`, `inf` and `nan`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Annotated

import typer

from art_mega.errors import LoopbackAddressError, UserError, describe, exit_code_for

app = typer.Typer(
    name="art-mega",
    help="Train LLM agents with GRPO and SFT on one machine or many.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from art_mega import __version__

        print(f"art-mega {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Train LLM agents with GRPO and SFT on one machine or many."""


ProgramOpt = Annotated[
    str,
    typer.Option(
        "--program", help="path/to/script.py:main or package.module:main (an async def main(launch))."
    ),
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]


MAX_STARTUP_TIMEOUT_S = 86400.0
"""The longest --startup-timeout (one day): larger values overflow socket and timer limits."""
MIN_STARTUP_TIMEOUT_S = 1.0
"""The shortest --startup-timeout: an agent is a fresh Python process that needs more than this to
answer, so a shorter bound (5e-324 is > 0) could only ever time out."""
_INTEGER = re.compile(r"-?[0-9]+")
_SECONDS = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def integer(value: str | int) -> int:
    """An option's integer, written in ASCII digits (`int()` alone also takes '٣' and ' 7 ').

    Raises:
        ValueError: anything else (typer turns it into a usage error; `main` prints one line, exit 2).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not _INTEGER.fullmatch(str(value)):
        raise ValueError(f"{value!r} is not an integer written in ASCII digits; give e.g. 22222")
    return int(str(value))


def seconds(value: str | float) -> float:
    """An option's duration in seconds: a finite number in [MIN_STARTUP_TIMEOUT_S (1),
    MAX_STARTUP_TIMEOUT_S (one day)], ASCII digits.

    Raises:
        ValueError: inf, nan, a negative number, 0, under a second, a non-ASCII digit, or more
            than a day.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif _SECONDS.fullmatch(str(value)):
        number = float(str(value))
    else:
        raise ValueError(
            f"{value!r} is not a number of seconds written in ASCII digits (inf, nan and negative "
            "numbers are refused); give e.g. 120"
        )
    if not 0 < number <= MAX_STARTUP_TIMEOUT_S:
        raise ValueError(
            f"{value!r} is outside 0 < seconds <= {MAX_STARTUP_TIMEOUT_S:g} (one day); give e.g. 120"
        )
    if number < MIN_STARTUP_TIMEOUT_S:
        raise ValueError(
            f"{value!r} is under {MIN_STARTUP_TIMEOUT_S:g} s, too short for an agent to start; give e.g. 120"
        )
    return number


LeaseOpt = Annotated[
    str | None,
    typer.Option(
        "--controller-lease",
        metavar="SECONDS",
        help="Seconds an agent waits for a word from its controller before it stops its children and "
        "exits, freeing its port (default: $ART_MEGA_CONTROLLER_LEASE or 20).",
    ),
]


MaxRestartsOpt = Annotated[
    int,
    typer.Option(
        "--max-restarts",
        parser=integer,
        help="Times to restart after a lost host (torchelastic's name): stop every host, wait for them, "
        "prove the cluster again and rerun the program, which resumes from LATEST (default 0).",
    ),
]


def _check_max_restarts(value: int) -> None:
    if not 0 <= value <= 1000:
        raise UserError(f"--max-restarts {value} is out of range; use 0 (no restart) to 1000")


def _fail(message: str, code: int) -> None:
    print(f"art-mega: error: {message}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def _guarded(debug: bool, body):  # type: ignore[no-untyped-def]
    """Run `body()`; an exception it raises ends the command as its row of `errors.EXIT_CODES`
    says: `errors.describe`'s one sentence (or the traceback, for a failure in code) and
    `errors.exit_code_for`'s exit code, the same as a program's failure in `controller`. With
    --debug every exception propagates (its traceback, exit 1)."""
    try:
        return body()
    except (typer.Exit, typer.Abort, _click_class("ClickException")):
        raise  # click's own: `main` reports them
    except Exception as exc:
        if debug:
            raise
        sentence = describe(exc)
        if sentence is None:
            traceback.print_exception(exc)
            sys.stderr.flush()
            raise typer.Exit(exit_code_for(exc)) from None
        _fail(sentence, exit_code_for(exc))


def _check_address(option: str, value: str) -> None:
    from art_mega.topology import EndpointSpec

    try:
        EndpointSpec.parse(value)
    except UserError as exc:
        raise UserError(f"{option} {value!r}: {exc}") from None


def _refuse_loopback_bind(address: str) -> None:
    """Refuse an agent started over SSH from another machine that would listen on loopback.

    Its worker host (a name such as this machine's own hostname, which Debian's /etc/hosts maps
    to 127.0.1.1) resolving to a loopback address here means the controller and the other hosts,
    which reach it from outside, cannot connect. Called only for agents `art-mega ssh` starts
    (`--exit-on-stdin-eof`): their SSH_CONNECTION is the launch's own session, where an agent
    started from a user's SSH login (`art-mega local` there) merely inherits the login's.

    Raises:
        LoopbackAddressError: naming the address, what it resolves to, and the `--host` fix.
    """
    from art_mega.preflight.netif import loopback_ip, ssh_client_elsewhere
    from art_mega.topology import EndpointSpec

    elsewhere = ssh_client_elsewhere(os.environ.get("SSH_CONNECTION"))
    host = EndpointSpec.parse(address).host
    loopback = loopback_ip(host) if elsewhere is not None else None
    if elsewhere is None or loopback is None:
        return
    client, server = elsewhere
    notes = [] if loopback == host else [f"{host} resolves to it here"]
    if loopback == "127.0.1.1":
        notes.append("Debian's /etc/hosts maps a machine's own name to 127.0.1.1")
    how = f" ({'; '.join(notes)})" if notes else ""
    raise LoopbackAddressError(
        f"--address {address}: this agent would listen on {loopback}{how}, a loopback address the controller "
        f"at {client} and the other hosts cannot reach; give this host's network address as its worker host, "
        f"e.g. --host SSH_TARGET={server} (the address SSH reached it on)",
        host,
        loopback,
    )


def _check_launch_id(value: str | None, what: str = "--launch-id") -> None:
    if value is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", value):
        raise UserError(f"{what} {value!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is out of range; use 0 (a free port) to 65535")


def _refuse_loopback(hosts: Sequence[tuple[str, str]], option: str, fixes: Sequence[str]) -> None:
    """Refuse a multi-host launch that would advertise a loopback or unspecified (0.0.0.0, ::)
    address for one host's agent.

    `hosts` are (as the user wrote it, worker host) pairs; `fixes[i]` is the fix to suggest for
    `hosts[i]`.

    Raises:
        LoopbackAddressError: naming the value, the loopback address and the fix.
    """
    from art_mega.preflight.netif import is_unspecified_ip, loopback_in_multi_host

    for (label, host), fix in zip(hosts, fixes):
        if len(hosts) > 1 and is_unspecified_ip(host):
            raise LoopbackAddressError(
                f"{option} {label!r} would advertise its agent at {host}, the unspecified address, which "
                f"every other host of this {len(hosts)}-host launch reads as itself; give its network "
                f"address: {fix}",
                label,
                host,
            )
    found = loopback_in_multi_host(hosts)
    if found is None:
        return
    label, host, address = found
    fix = fixes[[h[0] for h in hosts].index(label)]
    how = "a loopback address" if address == host else f"the loopback address {host} resolves to here"
    if address == "127.0.1.1":
        how += " (Debian's /etc/hosts maps a machine's own name to 127.0.1.1)"
    raise LoopbackAddressError(
        f"{option} {label!r} would advertise its agent at {address}, {how}, which the other hosts "
        f"of this {len(hosts)}-host launch cannot reach; give its network address: {fix}",
        label,
        address,
    )


@contextlib.contextmanager
def _reading_ahead() -> Iterator[None]:
    """Read ahead the files this controller's last run read, and list what this one read when
    it ends (`art_mega.readahead`; under the local cache root). An agent keeps its own
    listing (`worker`)."""
    from art_mega.launch.context import default_cache_root
    from art_mega.readahead import listing_path, read_ahead, record

    listing = listing_path(default_cache_root(), "controller", sys.executable)
    read_ahead(listing)
    try:
        yield
    finally:
        record(listing)


@app.command()
def local(
    program: ProgramOpt,
    port: Annotated[
        int, typer.Option(parser=integer, help="Agent port on 127.0.0.1; 0 picks a free port.")
    ] = 0,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", parser=seconds, help="Seconds to wait for the agent.")
    ] = 60.0,
    controller_lease: LeaseOpt = None,
    max_restarts: MaxRestartsOpt = 0,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM on this machine with one loopback agent."""

    def body() -> int:
        from art_mega.agent.lease import parse_controller_lease
        from art_mega.launch.controller import run_local
        from art_mega.launch.program import load_program, parse_program

        _check_port(port)
        _check_max_restarts(max_restarts)
        lease_s = parse_controller_lease(controller_lease)
        ref = parse_program(program)
        with _reading_ahead():  # before the program imports art-mega's modules
            main = load_program(ref)
            return asyncio.run(run_local(main, ref, port, startup_timeout, debug, lease_s, max_restarts))

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
        from art_mega.agent.auth import secret_from_env
        from art_mega.launch.controller import run_attached
        from art_mega.launch.program import load_program, parse_program
        from art_mega.topology import EndpointSpec

        for address in worker:
            _check_address("--worker", address)
        _refuse_loopback(
            [(a, EndpointSpec.parse(a).host) for a in worker],
            "--worker",
            ["start that agent with art-mega worker --address tcp://ADDRESS:PORT and pass that"]
            * len(worker),
        )
        _check_launch_id(launch_id)
        try:
            secret = secret_from_env()
        except ValueError as exc:
            raise UserError(str(exc)) from None
        ref = parse_program(program)
        with _reading_ahead():  # before the program imports art-mega's modules
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
    port: Annotated[int, typer.Option("--port", parser=integer, help="Agent port on every host.")] = 22222,
    ssh_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--ssh-arg",
            help="ssh option for launch and stop: -F FILE, -i KEY, -p PORT, -l USER, -J JUMP, -o K=V.",
        ),
    ] = None,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", parser=seconds, help="Seconds to wait for every agent.")
    ] = 60.0,
    controller_lease: LeaseOpt = None,
    max_restarts: MaxRestartsOpt = 0,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM with an agent started over SSH on every --host."""

    def body() -> int:
        from art_mega.agent.lease import parse_controller_lease
        from art_mega.launch.program import load_program, parse_program
        from art_mega.launch.ssh import default_python, plan_hosts, run_ssh

        lease_s = parse_controller_lease(controller_lease)
        _check_max_restarts(max_restarts)
        planned = plan_hosts(host, ssh_arg or [], port)
        _refuse_loopback(
            [(h.target.text, h.endpoint.host) for h in planned],
            "--host",
            [
                f"--host {h.target.user + '@' if h.target.user else ''}{h.target.target}=ADDRESS, the IP "
                "the other hosts reach it on"
                for h in planned
            ],
        )
        ref = parse_program(program)
        with _reading_ahead():  # before the program imports art-mega's modules
            main = load_program(ref)
            chosen = python or default_python()
            return asyncio.run(
                run_ssh(
                    main,
                    ref,
                    host,
                    chosen,
                    port,
                    ssh_arg or [],
                    startup_timeout,
                    debug,
                    lease_s,
                    max_restarts,
                )
            )

    raise typer.Exit(_guarded(debug, body))


@app.command()
def skypilot(
    program: ProgramOpt,
    port: Annotated[
        int, typer.Option("--port", parser=integer, help="Agent port on every node; rank 0 also uses PORT+1.")
    ] = 22222,
    startup_timeout: Annotated[
        float,
        typer.Option(
            "--startup-timeout", parser=seconds, help="Seconds to wait for the agent and for every node."
        ),
    ] = 120.0,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM across a SkyPilot task: run this same command on every node (its run: section)."""

    def body() -> int:
        from art_mega.launch.program import load_program, parse_program
        from art_mega.launch.skypilot import prepare, run_skypilot

        if not 1 <= port <= 65534:
            raise UserError(f"--port {port} is out of range; use 1..65534 (rank 0 also listens on PORT+1)")
        node, secret = prepare(os.environ)
        ref = parse_program(program)
        with _reading_ahead():  # before the program imports art-mega's modules
            main = load_program(ref)
            return asyncio.run(run_skypilot(main, ref, node, secret, port, startup_timeout, debug))

    raise typer.Exit(_guarded(debug, body))


@app.command()
def slurm(
    program: ProgramOpt,
    port: Annotated[
        int, typer.Option("--port", parser=integer, help="Agent port on every node; node 0 also uses PORT+1.")
    ] = 22222,
    startup_timeout: Annotated[
        float,
        typer.Option(
            "--startup-timeout", parser=seconds, help="Seconds to wait for the agent and for every node."
        ),
    ] = 120.0,
    debug: DebugOpt = False,
) -> None:
    """Run PROGRAM across a Slurm allocation: srun --ntasks-per-node=1 art-mega slurm ... (one per node)."""

    def body() -> int:
        from art_mega.launch.program import load_program, parse_program
        from art_mega.launch.skypilot import run_skypilot
        from art_mega.launch.slurm import launch_id_for_job, prepare

        if not 1 <= port <= 65534:
            raise UserError(f"--port {port} is out of range; use 1..65534 (node 0 also listens on PORT+1)")
        node, secret = prepare(os.environ)
        ref = parse_program(program)
        if node.rank == 0:
            print(
                f"art-mega slurm: job {node.job_id}, {node.num_nodes} nodes ({node.names[0]} is the controller), "
                f"submitted from {node.submit_dir or '?'}",
                file=sys.stderr,
                flush=True,
            )
        with _reading_ahead():  # before the program imports art-mega's modules
            main = load_program(ref)
            return asyncio.run(
                run_skypilot(
                    main,
                    ref,
                    node.as_group(),
                    secret,
                    port,
                    startup_timeout,
                    debug,
                    launch_id=launch_id_for_job(secret, node),
                )
            )

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
        from art_mega.launch.context import default_cache_root
        from art_mega.readahead import listing_path, read_ahead

        listing = str(listing_path(default_cache_root(), "agent", sys.executable))
        read_ahead(listing)  # before the agent's own modules are imported; listed at its shutdown

        from art_mega.agent.app import agent_main
        from art_mega.agent.auth import load_secret
        from art_mega.agent.lease import parse_controller_lease
        from art_mega.launch.agent_services import AGENT_SERVICES

        _check_address("--address", address)
        if exit_on_stdin_eof:
            _refuse_loopback_bind(address)
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
        from_env = os.environ.get("ART_MEGA_LAUNCH_ID")
        if launch_id is None and from_env:
            _check_launch_id(from_env, "ART_MEGA_LAUNCH_ID")
        chosen = launch_id or from_env or secrets.token_hex(8)
        return agent_main(address, chosen, secret, AGENT_SERVICES, exit_on_stdin_eof, lease_s, listing)

    raise typer.Exit(_guarded(debug, body))


@app.command()
def report(
    run_dir: Annotated[str, typer.Argument(help="A model's run directory (it holds history.jsonl).")],
    debug: DebugOpt = False,
) -> None:
    """Write PNG plots of RUN_DIR (reward, loss, KL when logged, grad norm, step time) and print a summary."""

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


def fraction(value: str | float) -> float:
    """An option's number in (0, 1], ASCII digits (`--gpu-memory-utilization`).

    Raises:
        ValueError: anything else (one line, exit 2).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif _SECONDS.fullmatch(str(value)):
        number = float(str(value))
    else:
        raise ValueError(f"{value!r} is not a number written in ASCII digits; give e.g. 0.9")
    if not 0 < number <= 1:
        raise ValueError(f"{value!r} is outside 0 < fraction <= 1; give e.g. 0.9")
    return number


def gib(value: str | float) -> float:
    """An option's GiB: a finite number > 0 in ASCII digits (`--gpu-memory-gib`).

    Raises:
        ValueError: anything else (one line, exit 2).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif _SECONDS.fullmatch(str(value)):
        number = float(str(value))
    else:
        raise ValueError(f"{value!r} is not a number of GiB written in ASCII digits; give e.g. 80")
    if not 0 < number <= 1 << 20:
        raise ValueError(f"{value!r} is outside 0 < GiB <= 1048576; give e.g. 80")
    return number


def positive(value: str | int) -> int:
    """An option's whole number >= 1 in ASCII digits (`integer`, then the bound).

    Raises:
        ValueError: anything else (one line, exit 2).
    """
    number = integer(value)
    if number < 1:
        raise ValueError(f"{value!r} is below 1; give e.g. 1")
    return number


def _size(flag: str, help_text: str, default_help: str = "") -> object:
    return typer.Option(flag, parser=positive, help=help_text + default_help)


@app.command()
def plan(
    model: Annotated[
        str,
        typer.Argument(help="A folder holding config.json, a model-cache name, or a Hugging Face repo id."),
    ],
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu", help="Every GPU's kind, e.g. H100-80GB, A100-40GB, H200-141GB (default: this machine's)."
        ),
    ] = None,
    gpu_memory_gib: Annotated[
        float | None,
        typer.Option("--gpu-memory-gib", parser=gib, help="Every GPU's memory in GiB, instead of --gpu."),
    ] = None,
    gpus: Annotated[
        int,
        typer.Option(
            "--gpus", parser=integer, help="GPUs a host (default: 8 with --gpu, 1 with --gpu-memory-gib)."
        ),
    ] = 0,
    hosts: Annotated[int, _size("--hosts", "Hosts.")] = 1,
    tp: Annotated[int, _size("--tp", "Trainer tensor parallel size.")] = 1,
    cp: Annotated[int, _size("--cp", "Trainer context parallel size.")] = 1,
    ep: Annotated[int, _size("--ep", "Trainer expert parallel size (MoE).")] = 1,
    pp: Annotated[int, _size("--pp", "Trainer pipeline parallel size (stages).")] = 1,
    recompute: Annotated[
        str,
        typer.Option("--recompute", help="Activation recomputation: none, selective or full (TrainerSpec.recompute)."),
    ] = "none",
    replicas: Annotated[int, _size("--replicas", "vLLM replicas (on host0's first GPUs).")] = 1,
    inference_tp: Annotated[
        int, _size("--inference-tp", "GPUs a vLLM replica (its tensor parallel size).")
    ] = 1,
    shared_gpus: Annotated[
        bool,
        typer.Option("--shared-gpus", help="Replicas share the trainer ranks' GPUs (vLLM sleeps in a step)."),
    ] = False,
    lora_rank: Annotated[int, _size("--lora-rank", "LoRA rank.")] = 8,
    seq_len: Annotated[int, _size("--seq-len", "Tokens a packed training row.")] = 4096,
    micro_batch_rows: Annotated[int, _size("--micro-batch-rows", "Rows a micro-batch.")] = 1,
    max_model_len: Annotated[
        int | None,
        typer.Option("--max-model-len", parser=positive, help="vLLM's context (default: --seq-len)."),
    ] = None,
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", parser=fraction, help="vLLM's share of a GPU.")
    ] = 0.9,
    debug: DebugOpt = False,
) -> None:
    """Print MODEL's memory a trainer rank and a vLLM replica on a layout, and the layouts that fit."""

    def body() -> int:
        from art_mega.launch.plan import plan_text, request_of

        if gpus < 0:
            raise UserError(f"--gpus {gpus} is below 0; give e.g. 8")
        print(
            plan_text(
                request_of(
                    model=model,
                    gpu=gpu,
                    gpu_memory_gib=gpu_memory_gib,
                    gpus=gpus,
                    hosts=hosts,
                    tp=tp,
                    cp=cp,
                    ep=ep,
                    pp=pp,
                    recompute=recompute,
                    replicas=replicas,
                    inference_tp=inference_tp,
                    shared_gpus=shared_gpus,
                    lora_rank=lora_rank,
                    seq_len=seq_len,
                    micro_batch_rows=micro_batch_rows,
                    max_model_len=max_model_len,
                    gpu_memory_utilization=gpu_memory_utilization,
                )
            ),
            flush=True,
        )
        return 0

    raise typer.Exit(_guarded(debug, body))


def _click_class(name: str) -> type[Exception]:
    # typer >= 0.2x vendors click as a private module and older typer uses click itself: take the
    # base classes from the MRO of typer's public BadParameter, which is right for both.
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


def _did_you_mean(exc: Exception, message: str) -> str:
    """click's "(Possible options: A, B)" of an unknown option as "(did you mean A?)", A the
    closest by difflib's ratio (click lists every option sharing a prefix, in no useful order);
    an unknown command's ". Did you mean 'local'?" alike, kept only when the names are close
    (difflib ratio >= 0.7: click's 0.6 offers `plan` for `launch`)."""
    import difflib

    def command(match: re.Match[str]) -> str:
        typed = re.search(r"No such command '([^']+)'", message)
        if typed and difflib.SequenceMatcher(None, typed.group(1), match.group(1)).ratio() < 0.7:
            return ""
        return f" (did you mean {match.group(1)}?)"

    message = re.sub(r"\. Did you mean '([^']+)'\?", command, message)
    option, possible = getattr(exc, "option_name", None), list(getattr(exc, "possibilities", None) or ())
    if not option or not possible:
        return message
    best = difflib.get_close_matches(option, possible, n=1, cutoff=0.0)[0]
    return re.sub(r"\(Possible options?: [^)]*\)", f"(did you mean {best}?)", message)


def main(args: Sequence[str] | None = None) -> None:
    """Console-script entry point: run the CLI, exit with its code.

    click's own refusals (an unknown option or command, a value its type refuses, a missing
    option) are printed as one line naming the command and pointing at its --help, exit 2,
    instead of typer's usage box.
    """
    usage_error, click_exception = _click_class("UsageError"), _click_class("ClickException")
    command = typer.main.get_command(app)
    try:
        code = command.main(args=args, prog_name="art-mega", standalone_mode=False)
    except typer.Abort:
        sys.exit(1)
    except click_exception as exc:
        message = " ".join(exc.format_message().split()).rstrip(".").replace(": Value error, ", ": ")
        if not message:  # no arguments at all: typer printed the help
            sys.exit(getattr(exc, "exit_code", 2))
        if isinstance(exc, usage_error):
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else "art-mega"
            message = _did_you_mean(exc, message)
            command_name = where.removeprefix("art-mega").strip()
            message = f"{command_name + ': ' if command_name else ''}{message}; see '{where} --help'"
        print(f"art-mega: error: {message}", file=sys.stderr, flush=True)
        sys.exit(getattr(exc, "exit_code", 2))
    sys.exit(code if isinstance(code, int) else 0)
