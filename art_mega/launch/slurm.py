"""`art-mega slurm`: one process per node of a Slurm allocation, started by `srun`.

Like `art-mega skypilot` (whose rank-0 gathering and outcome protocol it reuses), the same
command runs on every node: node 0 of the job starts its agent, waits for the others' agents and
runs the program; the other nodes run only their agent and wait for node 0's outcome. The Slurm
variables are read once, validated (each malformed one is one sentence naming it, exit 2) and
removed, with the secret, before the program runs:

- SLURM_JOB_NODELIST: the allocation's nodes in Slurm's hostlist syntax (`expand_hostlist`);
  each name is resolved here (getaddrinfo, IPv4 first) to the address its agent listens on.
- SLURM_NODEID (this node's index in that list) and SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS:
  exactly one task per node (`srun --ntasks-per-node=1`), so node i is task i.
- SLURM_JOB_ID: part of the launch id, so two jobs never accept each other's agents.
- SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES (as Slurm sets them with --gpus*): checked to
  agree; CUDA_VISIBLE_DEVICES stays in the environment, so the agent's children see those GPUs.
- SLURM_SUBMIT_DIR: must be an absolute directory (where sbatch ran); reported at start.

The secret comes from ART_MEGA_SECRET in the task's environment, which srun propagates from the
batch script (its default `--export=ALL`): examples/multinode/slurm.sbatch generates it inside the
script, after the allocation exists, so it is in no argv, no file, not in sbatch's saved job
environment (slurmctld's StateSaveLocation keeps that for batch jobs) and reaches each node only in
the munge-authenticated step launch, readable there like any environment only by the job's user
and root. A file in a private directory would need a filesystem shared by every node and a
removal that a killed job skips.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from art_mega.agent.auth import SECRET_ENV, load_secret
from art_mega.errors import LoopbackAddressError, UserError
from art_mega.launch.skypilot import SkyPilotNode
from art_mega.preflight.netif import loopback_in_multi_host

SLURM_VARS = (
    "SLURM_JOB_NODELIST",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_JOB_NUM_NODES",
    "SLURM_JOB_ID",
    "SLURM_GPUS_ON_NODE",
    "SLURM_SUBMIT_DIR",
    "SLURMD_NODENAME",
)
"""The variables `art-mega slurm` reads; removed from the environment before the program runs
(CUDA_VISIBLE_DEVICES is read too and kept: the agent's children need it)."""

MAX_HOSTS = 65536
"""The most names one hostlist may expand to (Slurm's own MAX_RANGE is 64K)."""

_NAME = re.compile(r"[A-Za-z0-9._-]+")
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def expand_hostlist(expression: str) -> list[str]:
    """Expand a Slurm hostlist (`n[01-03,7],gpu-a[1-2]-b[3-4]`) into host names, in order.

    Slurm's rules (src/common/hostlist.c, checked against `scontrol show hostnames` by the
    tests): items are separated by commas outside brackets; an item is literal text with any
    number of bracket groups, each a comma-separated list of N or LO-HI ranges (LO <= HI, ASCII
    digits) whose names are zero-padded to the width of LO (`[01-10]` -> 01..10, `[9-11]` ->
    9, 10, 11); several groups in one item give their cartesian product, the first varying
    slowest. Empty items (`a,,b`) are skipped, as Slurm does.

    Returns:
        The names, duplicates kept (the caller decides).

    Raises:
        ValueError: unbalanced or nested brackets, an empty, reversed or non-numeric range,
            whitespace or another character a host name cannot hold, no names at all, or more
            than MAX_HOSTS names.
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(expression):
        if char == "[":
            if depth:
                raise ValueError(f"a '[' at position {i} opens inside another bracket")
            depth = 1
        elif char == "]":
            if not depth:
                raise ValueError(f"the ']' at position {i} closes no bracket")
            depth = 0
        elif char == "," and not depth:
            items.append(expression[start:i])
            start = i + 1
    if depth:
        raise ValueError("a '[' is never closed")
    items.append(expression[start:])
    names: list[str] = []
    for item in items:
        if item:
            names.extend(_expand_item(item))
            if len(names) > MAX_HOSTS:
                raise ValueError(f"it expands to more than {MAX_HOSTS} names")
    if not names:
        raise ValueError("it names no host")
    return names


def _expand_item(item: str) -> list[str]:
    parts = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., literal
    choices: list[list[str]] = []
    for index, part in enumerate(parts):
        if index % 2 == 0:
            if part and not _NAME.fullmatch(part):
                raise ValueError(
                    f"{part!r} holds a character a host name cannot (letters, digits, '.', '_', '-')"
                )
            choices.append([part])
            continue
        values: list[str] = []
        for piece in part.split(","):
            match = _RANGE.fullmatch(piece)
            if not match:
                raise ValueError(f"[{part}] holds {piece!r}, which is not N or LO-HI in ASCII digits")
            lo, hi = match.group(1), match.group(2) or match.group(1)
            if int(hi) < int(lo):
                raise ValueError(f"the range {piece!r} in [{part}] runs backwards")
            if int(hi) - int(lo) >= MAX_HOSTS:
                raise ValueError(f"the range {piece!r} holds more than {MAX_HOSTS} names")
            values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
        choices.append(values)
    names = [""]
    for values in choices:
        names = [prefix + value for prefix in names for value in values]
        if len(names) > MAX_HOSTS:
            raise ValueError(f"{item!r} expands to more than {MAX_HOSTS} names")
    return names


@dataclass(frozen=True)
class SlurmNode:
    """This node's place in the Slurm job.

    Attributes:
        job_id: SLURM_JOB_ID.
        rank: SLURM_NODEID, this node's index in `names`.
        names: the job's node names (SLURM_JOB_NODELIST expanded), in Slurm's order.
        addresses: each name resolved to the IP its agent listens on (same order).
        gpus: this node's GPUs as CUDA_VISIBLE_DEVICES lists them (() when none).
        submit_dir: SLURM_SUBMIT_DIR ("" when unset).
    """

    job_id: str
    rank: int
    names: tuple[str, ...]
    addresses: tuple[str, ...]
    gpus: tuple[str, ...] = ()
    submit_dir: str = ""

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    def as_group(self) -> SkyPilotNode:
        """The rank and addresses in the form the rank-0 gathering (`launch.skypilot`) takes."""
        return SkyPilotNode(rank=self.rank, node_ips=self.addresses)


def _digits(env: Mapping[str, str], name: str, fix: str) -> int | None:
    """SLURM integer variable `name` (None when unset), ASCII digits only."""
    raw = env.get(name)
    if raw is None:
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        raise UserError(f"{name}={raw!r} is not a non-negative integer in ASCII digits; {fix}")
    return int(text)


def resolve_ipv4_first(name: str) -> str:
    """The address `name` resolves to here: its first IPv4 address, else its first IPv6 one.

    Raises:
        OSError: it does not resolve.
    """
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    addresses = [str(info[4][0]) for info in infos]
    v4 = [a for a in addresses if ":" not in a]
    return (v4 or addresses)[0]


def read_slurm_env(env: Mapping[str, str], resolve=resolve_ipv4_first) -> SlurmNode:  # type: ignore[no-untyped-def]
    """Validate the Slurm variables of one `srun` task (the module docstring lists them).

    `resolve(name) -> address` turns a node name into its IP (default: `resolve_ipv4_first`).

    Raises:
        UserError: one sentence naming the variable, its value and the fix: a missing
            SLURM_JOB_NODELIST / SLURM_NODEID / SLURM_JOB_ID, a hostlist not in Slurm's syntax
            or listing a node twice, an index out of range, a second task on one node, a node
            name that does not resolve, GPU variables that disagree, a SLURM_SUBMIT_DIR that is
            not an absolute directory.
        LoopbackAddressError: a node name that resolves to a loopback address here while the job
            has two or more nodes (Debian's /etc/hosts maps a machine's own name to 127.0.1.1).
    """
    how = "run art-mega slurm through srun inside an sbatch or salloc allocation"
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODEID", "SLURM_JOB_ID"):
        if not env.get(name, "").strip():
            raise UserError(f"{name} is not set; {how}")
    raw_list = env["SLURM_JOB_NODELIST"]
    try:
        names = expand_hostlist(raw_list.strip())
    except ValueError as exc:
        raise UserError(
            f"SLURM_JOB_NODELIST={raw_list!r} is not a Slurm hostlist ({exc}); Slurm sets it: do not override it"
        ) from None
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise UserError(f"SLURM_JOB_NODELIST={raw_list!r} lists {twice} twice; Slurm lists each node once")
    dont = "Slurm sets it: do not override it"
    job_id = env["SLURM_JOB_ID"].strip()
    if not re.fullmatch(r"[0-9]+(?:_[0-9]+)?", job_id):
        raise UserError(f"SLURM_JOB_ID={env['SLURM_JOB_ID']!r} is not a Slurm job id (digits); {dont}")
    rank = _digits(env, "SLURM_NODEID", dont)
    assert rank is not None
    if rank >= len(names):
        raise UserError(
            f"SLURM_NODEID={rank} is out of range for the {len(names)} nodes of SLURM_JOB_NODELIST={raw_list!r}; {dont}"
        )
    count = _digits(env, "SLURM_JOB_NUM_NODES", dont)
    if count is not None and count != len(names):
        raise UserError(
            f"SLURM_JOB_NUM_NODES={count} but SLURM_JOB_NODELIST={raw_list!r} names {len(names)} nodes; {dont}"
        )
    own = env.get("SLURMD_NODENAME", "").strip()
    if own and own != names[rank]:
        raise UserError(
            f"SLURMD_NODENAME={own!r} is not node {rank} ({names[rank]}) of SLURM_JOB_NODELIST; run the step on "
            "every node of the allocation: srun --nodes=$SLURM_JOB_NUM_NODES --ntasks-per-node=1"
        )
    one_task = "art-mega slurm runs one process per node: srun --ntasks-per-node=1"
    local = _digits(env, "SLURM_LOCALID", dont)
    if local is not None and local != 0:
        raise UserError(f"SLURM_LOCALID={local} means a second task on node {names[rank]}; {one_task}")
    tasks = _digits(env, "SLURM_NTASKS", dont)
    if tasks is not None and tasks != len(names):
        raise UserError(f"SLURM_NTASKS={tasks} for {len(names)} nodes; {one_task}")
    procid = _digits(env, "SLURM_PROCID", dont)
    if procid is not None and procid != rank:
        raise UserError(f"SLURM_PROCID={procid} differs from SLURM_NODEID={rank}; {one_task}")
    gpus = _read_gpus(env)
    submit_dir = env.get("SLURM_SUBMIT_DIR", "")
    if submit_dir and not (os.path.isabs(submit_dir) and os.path.isdir(submit_dir)):
        raise UserError(
            f"SLURM_SUBMIT_DIR={submit_dir!r} is not an absolute directory on node {names[rank]}; submit from a "
            "directory every node mounts at the same path"
        )
    addresses = []
    for name in names:
        try:
            addresses.append(resolve(name))
        except OSError as exc:
            raise UserError(
                f"node {name} of SLURM_JOB_NODELIST does not resolve on {names[rank]} ({exc.strerror or exc}); "
                "every node name must resolve on every node (DNS or /etc/hosts)"
            ) from None
    for name, address in zip(names, addresses):
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise UserError(f"node {name} resolved to {address!r}, which is not an IP address") from None
    loopback = loopback_in_multi_host(list(zip(names, addresses)))
    if loopback is not None:
        raise LoopbackAddressError(
            f"node {loopback[0]} of SLURM_JOB_NODELIST resolves to {loopback[2]}, a loopback address, on "
            f"{names[rank]}, so the job's other nodes cannot reach its agent there; map every node name to its "
            "network address (Debian's /etc/hosts maps a machine's own name to 127.0.1.1)",
            loopback[0],
            loopback[2],
        )
    return SlurmNode(job_id, rank, tuple(names), tuple(addresses), gpus, submit_dir)


def _read_gpus(env: Mapping[str, str]) -> tuple[str, ...]:
    """This node's GPUs from CUDA_VISIBLE_DEVICES, checked against SLURM_GPUS_ON_NODE."""
    on_node = _digits(env, "SLURM_GPUS_ON_NODE", "Slurm sets it from --gpus*: do not override it")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus: tuple[str, ...] = ()
    if visible is not None and visible.strip():
        gpus = tuple(p.strip() for p in visible.split(","))
        bad = next((g for g in gpus if not re.fullmatch(r"[0-9]+|(?:GPU|MIG)-[A-Za-z0-9/-]+", g)), None)
        if bad is not None:
            raise UserError(
                f"CUDA_VISIBLE_DEVICES={visible!r} lists {bad!r}, which is not a GPU index or a GPU-/MIG- UUID; "
                "let Slurm set it (--gpus-per-node) or list indices such as 0,1"
            )
    if on_node is not None and on_node and len(gpus) != on_node:
        raise UserError(
            f"SLURM_GPUS_ON_NODE={on_node} but CUDA_VISIBLE_DEVICES={visible!r} lists {len(gpus)}; let Slurm set "
            "both (--gpus-per-node) or unset CUDA_VISIBLE_DEVICES' override"
        )
    return gpus


def launch_id_for_job(secret: bytes, node: SlurmNode) -> str:
    """The launch id every node derives alike from the secret, the job id and the node list."""
    import hashlib
    import hmac

    text = "|".join(("slurm-launch-id", node.job_id, *node.addresses))
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()[:16]


def prepare(environ: dict[str, str], resolve=resolve_ipv4_first) -> tuple[SlurmNode, bytes]:  # type: ignore[no-untyped-def]
    """Validate, then remove SLURM_* (the `SLURM_VARS`) and ART_MEGA_SECRET from `environ`.

    `resolve` as in `read_slurm_env`.

    Raises:
        UserError: a malformed Slurm variable (`read_slurm_env`) or no ART_MEGA_SECRET.
    """
    node = read_slurm_env(environ, resolve)
    try:
        secret = load_secret(environ.get(SECRET_ENV))
    except ValueError:
        raise UserError(
            f"{SECRET_ENV} is not set on node {node.names[node.rank]}; export it in the batch script before "
            f"srun (srun passes the script's environment to every node), e.g. export {SECRET_ENV}=$(python3 -c "
            "'import secrets; print(secrets.token_hex(32))')"
        ) from None
    for name in (*SLURM_VARS, SECRET_ENV):
        environ.pop(name, None)
    return node, secret


__all__ = ["SlurmNode", "expand_hostlist", "launch_id_for_job", "prepare", "read_slurm_env"]
