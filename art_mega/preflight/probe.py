"""The preflight collective's per-host process: rendezvous, all-reduce, all-gather, bandwidth.

Run by each participating host's agent, in the Python environment the trainer (or the vLLM
replica) will use, as `python -m art_mega.preflight.probe CONFIG_JSON`. It prints one JSON
line (`PREFLIGHT_RESULT {...}`) and exits 0 on success, 1 on failure (a config that is not JSON
or has a wrong field included: the result names it). Arrival is recorded in the TCPStore before
the process group forms, so a rank that never arrives is named, not waited for.

`python -m art_mega.preflight.probe --stdin` is the warm form: it imports torch and
torch.distributed first (2-4 s of the collective's wall time on a loaded CPU host), then reads
the config as one JSON line from stdin. Agents start it when the controller begins proving the
cluster, so the import overlaps admission, the artifact_root probe and etcd. It exits 0 without
doing anything on EOF or after `WARM_IDLE_S` seconds without a config.

In another environment (a replica's `InferenceSpec.python`, which need not have art-mega
installed) the agent runs it through `probe_command`: this package is loaded from its own folder
without adding anything else to that interpreter's path, so the probe proves that
environment's torch, not the agent's. A torch that cannot be imported, lacks the backend, or
(rank 0 compares) differs in version between the ranks is the probe's answer, not a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from art_mega.preflight.netif import gloo_interface_for, local_interface

RESULT_PREFIX = "PREFLIGHT_RESULT "
CONFIG_READ = "PREFLIGHT_CONFIG_READ"
"""Printed (one line) once the probe holds a valid config: an agent whose warm probe ended
without it knows the probe never started its rank, so a cold probe can take the rank over."""
RECORD_BYTES = 512
WARM_FLAG = "--stdin"
WARM_IDLE_S = 600.0
"""Seconds a warm probe waits for its config before exiting on its own."""
MODULE = "art_mega.preflight.probe"
FOREIGN_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""The agent's own environment variables, dropped for another interpreter (as for its replicas)."""
_BOOTSTRAP = """\
import importlib.util, runpy, sys
folder = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location(
    "art_mega", folder + "/__init__.py", submodule_search_locations=[folder])
package = importlib.util.module_from_spec(spec)
sys.modules["art_mega"] = package
spec.loader.exec_module(package)
runpy.run_module("art_mega.preflight.probe", run_name="__main__", alter_sys=True)
"""


def probe_command(
    python: str, args: list[str], environ: Mapping[str, str]
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run this probe with `args` under interpreter `python`.

    The agent's own interpreter runs `-m art_mega.preflight.probe`. Another one (whose
    environment may lack art-mega) gets this package's folder loaded as `art_mega` by a short
    bootstrap, and the environment without `FOREIGN_ENV`: nothing of the agent's environment
    leaks onto its path. The launch secret is never passed on.
    """
    env = {k: v for k, v in environ.items() if k != "ART_MEGA_SECRET"}
    if python == sys.executable:
        return [python, "-m", MODULE, *args], env
    for name in FOREIGN_ENV:
        env.pop(name, None)
    folder = str(Path(__file__).resolve().parent.parent)
    return [python, "-c", _BOOTSTRAP, folder, *args], env


def check_nccl_log(text: str, expected: str, rank: int, host: str) -> None:
    """Prove from an NCCL debug log that this rank selected network `expected`.

    NCCL (INIT,NET subsystems at INFO) prints one `NCCL INFO Using network <name>` line per
    communicator init; exactly one must appear and name `expected` (case-insensitive).

    Raises:
        RuntimeError: naming the rank, host, and what was selected instead.
    """
    import re

    found = re.findall(r"NCCL INFO Using network (\S+)", text)
    if len(found) != 1:
        raise RuntimeError(
            f"expected one selected-network line naming {expected}, rank {rank} on host {host} logged {len(found)}: {found}"
        )
    if found[0].lower() != expected.lower():
        raise RuntimeError(f"expected network {expected}, rank {rank} on host {host} selected {found[0]}")


def _encode(record: dict[str, Any]):  # type: ignore[no-untyped-def]
    import torch

    raw = json.dumps(record).encode()[:RECORD_BYTES]
    buffer = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    buffer[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buffer


def _decode(buffer) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    raw = bytes(buffer.tolist()).rstrip(b"\0")
    return json.loads(raw)


_PHASE = {"name": "start"}


def _watchdog(config: dict[str, Any]) -> None:
    """After timeout_s, report the phase this rank is stuck in and exit: hangs are bounded."""
    import threading

    def fire() -> None:
        result = {
            "ok": False,
            "rank": config.get("rank"),
            "host": config.get("host_id"),
            "phase": _PHASE["name"],
            "timed_out": True,
            "error": f"timed out after {config['timeout_s']} s in phase {_PHASE['name']}",
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        os._exit(1)

    timer = threading.Timer(float(config["timeout_s"]) + 2.0, fire)
    timer.daemon = True
    timer.start()


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Do the collective described by `config`; return this rank's result (raises on failure)."""
    import torch
    import torch.distributed as dist

    rank, world = int(config["rank"]), int(config["world_size"])
    host = config["host_id"]
    timeout = timedelta(seconds=float(config["timeout_s"]))
    backend = config.get("backend", "gloo")
    available = dist.is_available() and (
        dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    )
    if not available:
        raise RuntimeError(f"torch {torch.__version__} of {sys.executable} has no {backend} backend")
    if world > 1:
        gloo_interface_for(config["master_host"])
    if backend == "gloo":
        _check_gloo_interfaces(os.environ.get("GLOO_SOCKET_IFNAME", ""))
    if backend == "nccl":
        log = Path(config["log_dir"]) / f"nccl-preflight-rank{rank}.log"
        os.environ.update(
            NCCL_NET=config["nccl_net"],
            NCCL_DEBUG="INFO",
            NCCL_DEBUG_SUBSYS="INIT,NET",
            NCCL_DEBUG_FILE=str(log),
        )
    try:
        store = dist.TCPStore(
            config["master_host"],
            int(config["master_port"]),
            world,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as exc:
        if rank == 0:
            raise
        # rank 0's store never answered: this rank did not arrive (the others name it so)
        return {
            "ok": False,
            "rank": rank,
            "host": host,
            "phase": "start",
            "error": f"the rendezvous store {config['master_host']}:{config['master_port']} did not answer: {exc}",
        }
    _PHASE["name"] = "rendezvous"
    store.set(f"arrived/{rank}", host)
    keys = [f"arrived/{r}" for r in range(world)]
    try:
        store.wait(keys, timeout)
    except Exception:  # a timeout, or rank 0's store gone after its own: name who is missing
        waited = {"ok": False, "rank": rank, "host": host, "phase": "rendezvous", "timed_out": True}
        try:
            missing = [r for r in range(world) if not store.check([f"arrived/{r}"])]
        except Exception as exc:  # waiting for others is never this rank's own failure
            return {**waited, "error": f"the rendezvous store went away while this rank waited ({exc})"}
        return {**waited, "missing_ranks": missing, "error": "rendezvous timed out"}
    _PHASE["name"] = "init_process_group"
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world, timeout=timeout
    )
    _PHASE["name"] = "collectives"
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    try:
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        expected = world * (world + 1) / 2
        if value.item() != expected:
            raise RuntimeError(f"all-reduce of rank+1 gave {value.item()}, expected {expected}")
        interface, local_ip = local_interface(config["master_host"]) if world > 1 else ("lo", "127.0.0.1")
        record = {
            "host": host,
            "rank": rank,
            "backend": backend,
            "interface": interface,
            "ip": local_ip,
            "warm": bool(config.get("warm")),
            "torch": torch.__version__,
        }
        gathered = [torch.zeros(RECORD_BYTES, dtype=torch.uint8, device=device) for _ in range(world)]
        dist.all_gather(gathered, _encode(record).to(device))
        members = [_decode(g.cpu()) for g in gathered]
        _PHASE["name"] = "bandwidth"
        bandwidth = _bandwidth(rank, world, int(config.get("bandwidth_bytes", 8 << 20)), device)
        if backend == "nccl":
            check_nccl_log(
                Path(os.environ["NCCL_DEBUG_FILE"]).read_text(errors="replace"),
                config["nccl_net"],
                rank,
                host,
            )
        return {"ok": True, "rank": rank, "host": host, "members": members, "bandwidth_gbps": bandwidth}
    finally:
        dist.destroy_process_group()


def _check_gloo_interfaces(value: str) -> None:
    """Fail before the rendezvous when GLOO_SOCKET_IFNAME names an interface this host lacks
    (gloo would fail only inside init_process_group, after every rank has arrived)."""
    if not value:
        return
    names = sorted(name for _, name in socket.if_nameindex())
    missing = [name for name in value.split(",") if name not in names]
    if missing:
        raise RuntimeError(
            f"GLOO_SOCKET_IFNAME={value!r} names {missing[0]!r}, which this host does not have "
            f"(it has {', '.join(names)})"
        )


def _bandwidth(rank: int, world: int, nbytes: int, device) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """GB/s per link i-j (i < j), measured on rank i as 2 x bytes / round-trip seconds."""
    import torch
    import torch.distributed as dist

    results: dict[str, float] = {}
    if nbytes <= 0:
        return results
    payload = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    scratch = torch.empty_like(payload)
    for i in range(world):
        for j in range(i + 1, world):
            dist.barrier()
            if rank == i:
                started = time.perf_counter()
                dist.send(payload, j)
                dist.recv(scratch, j)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - started
                results[f"{i}-{j}"] = 2 * nbytes / elapsed / 1e9
            elif rank == j:
                dist.recv(scratch, i)
                dist.send(payload, i)
    return results


_REQUIRED: dict[str, tuple[type, ...]] = {
    "rank": (int,),
    "world_size": (int,),
    "host_id": (str,),
    "master_host": (str,),
    "master_port": (int,),
    "timeout_s": (int, float),
}
_OPTIONAL: dict[str, tuple[type, ...]] = {
    "backend": (str,),
    "bandwidth_bytes": (int,),
    "nccl_net": (str, type(None)),
    "log_dir": (str,),
}


def check_config(config: Any) -> dict[str, Any]:
    """`config` when it is a JSON object with the fields `run` reads, of the right types.

    Raises:
        ValueError: naming the field, the value and what it must be (a probe given this prints
            it as its result instead of dying with a traceback).
    """
    if not isinstance(config, dict):
        raise ValueError(
            f"preflight config is {type(config).__name__} {config!r:.80}, expected a JSON object"
        )
    for fields, required in ((_REQUIRED, True), (_OPTIONAL, False)):
        for name, types in fields.items():
            if name not in config:
                if required:
                    raise ValueError(f"preflight config has no field {name!r}")
                continue
            value = config[name]
            if isinstance(value, bool) or not isinstance(value, types):
                wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
                raise ValueError(f"preflight config field {name!r} is {value!r:.80}, expected {wanted}")
    if not 0 <= config["rank"] < config["world_size"]:
        raise ValueError(
            f"preflight config field 'rank' is {config['rank']}, expected 0 <= rank < world_size={config['world_size']}"
        )
    if not 0 < config["master_port"] < 65536 or not config["timeout_s"] > 0:
        raise ValueError(
            f"preflight config fields master_port={config['master_port']} and timeout_s={config['timeout_s']} "
            "must be a TCP port and a positive number of seconds"
        )
    if config.get("backend", "gloo") not in ("gloo", "nccl"):
        raise ValueError(
            f"preflight config field 'backend' is {config['backend']!r}, expected 'gloo' or 'nccl'"
        )
    return config


def _read_config_when_warm() -> dict[str, Any] | None:
    """Import torch, then wait for one JSON line on stdin (None: EOF or `WARM_IDLE_S` passed).

    Raises:
        ValueError: the line is not JSON (`json.JSONDecodeError`) or not a valid config.
    """
    import select

    try:
        import torch.distributed  # noqa: F401  (the point of the warm form)
    except Exception:  # a broken torch is this rank's answer once its config (rank) is known: `main`
        pass
    ready, _, _ = select.select([sys.stdin], [], [], WARM_IDLE_S)
    line = sys.stdin.readline() if ready else ""
    return _parse(line) if line.strip() else None


def _read_config(args: list[str]) -> dict[str, Any] | None:
    """The config from argv (cold) or stdin (warm; None: nothing came). Raises `ValueError`."""
    if len(args) != 1:
        raise ValueError(f"usage: preflight_probe CONFIG_JSON | {WARM_FLAG} (got arguments {args})")
    if args[0] == WARM_FLAG:
        warm = _read_config_when_warm()
        return None if warm is None else {**warm, "warm": True}
    return _parse(args[0])


def _parse(text: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"preflight config is not JSON ({exc}): {text.strip()!r:.80}") from None
    return check_config(config)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `CONFIG_JSON` (cold) or `--stdin` (warm); returns the exit code.

    The result carries `run_s`: seconds from (config in hand and torch imported) to the result,
    i.e. rendezvous, process group, collectives and bandwidth, without the interpreter's start.
    A config that is not JSON or lacks a field gives a failed result naming it (exit 1).
    """
    args = sys.argv[1:] if argv is None else argv
    try:
        config = _read_config(args)
    except ValueError as exc:
        print(RESULT_PREFIX + json.dumps({"ok": False, "phase": "config", "error": f"{exc}"}), flush=True)
        return 1
    if config is None:
        return 0
    print(CONFIG_READ, flush=True)
    _watchdog(config)
    try:
        import torch.distributed  # noqa: F401  (imported before the clock starts)
    except Exception as exc:  # the environment cannot join any collective: say so, at once
        result = {
            "ok": False,
            "rank": config.get("rank"),
            "host": config.get("host_id"),
            "phase": "import",
            "error": f"cannot import torch.distributed ({type(exc).__name__}: {exc})",
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 1
    started = time.monotonic()
    try:
        result = run(config)
        result["run_s"] = round(time.monotonic() - started, 4)
    except Exception as exc:
        result = {
            "ok": False,
            "rank": config.get("rank"),
            "host": config.get("host_id"),
            "error": f"{type(exc).__name__}: {exc}",
        }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
