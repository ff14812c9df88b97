"""A real Slurm cluster for tests: Debian's slurmctld, slurmd and munged in network namespaces.

Layout (on top of `NetnsCluster(n + 1)`)::

    h0   "ctl": slurmctld on 10.231.X.1:6817, munged (its socket is a path: every namespace uses it)
    h1.. "n1".."nN": one slurmd each on 10.231.X.(i+1):6818 (`slurmd -N n<i>`, NodeAddr per node)

Every namespace sees the node names through `/etc/netns/<netns>/hosts`, which `ip netns exec`
bind-mounts over /etc/hosts (slurmd and the job steps it forks inherit that mount namespace), so
a job's SLURM_JOB_NODELIST (`n[1-3]`) resolves as on a real cluster. All daemons share one kernel
and cgroup tree: proctrack/linuxproc (a step's processes are found by parent pid), task/none, no
accounting, no cgroup plugin. The munge key, slurm.conf, spool, state and logs live in the
cluster's temp dir; `close()` kills every daemon (with the namespaces) and removes the hosts files.
Clients (sbatch, squeue, scancel) must run inside a namespace: `SlurmCluster.client(...)`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket as socket_mod
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.integration.netns import NetnsCluster, NetnsHost

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol")


def slurm_unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot run here (a binary missing), else None."""
    for name in DAEMONS:
        if shutil.which(name) is None and not os.access(f"/usr/sbin/{name}", os.X_OK):
            return f"{name} not found (apt-get install slurmctld slurmd munge slurm-client)"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """`nodes` Slurm compute nodes plus a controller; use as a context manager.

    Attributes after `start()`: `netns` (the NetnsCluster), `ctl` (h0), `nodes` (h1..), `conf`
    (slurm.conf path), `env` (SLURM_CONF for clients), `dir`.
    """

    def __init__(self, nodes: int = 3, *, kill_wait_s: int = 5) -> None:
        self.n = nodes
        self.kill_wait_s = kill_wait_s
        self.netns = NetnsCluster(nodes + 1)
        self.dir = Path()
        self.conf = Path()
        self.hosts_dirs: list[Path] = []
        self.env: dict[str, str] = {}

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def ctl(self) -> NetnsHost:
        return self.netns.hosts[0]

    @property
    def nodes(self) -> list[NetnsHost]:
        return self.netns.hosts[1:]

    def node_name(self, host: NetnsHost) -> str:
        return f"n{host.index}"

    def start(self, ready_timeout_s: float = 30.0) -> SlurmCluster:
        try:
            self.netns.start()
            self._setup(ready_timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise
        return self

    def _setup(self, ready_timeout_s: float) -> None:
        self.dir = self.netns.tmpdir / "slurm"
        for sub in ("munge", "state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, mode=0o700)
        os.chmod(self.netns.tmpdir, 0o755)  # munged refuses a key whose directories others can write
        os.chmod(self.dir, 0o755)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        socket = self.dir / "munge" / "munge.sock"
        hosts = ["127.0.0.1 localhost", f"{self.ctl.address} ctl"]
        hosts += [f"{h.address} {self.node_name(h)}" for h in self.nodes]
        for h in self.netns.hosts:
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            self.hosts_dirs.append(etc)
            (etc / "hosts").write_text("\n".join(hosts) + "\n")
        d = self.dir
        nodes = "".join(
            f"NodeName={self.node_name(h)} NodeAddr={h.address} CPUs=2 RealMemory=1000 State=UNKNOWN\n"
            for h in self.nodes
        )
        self.conf = d / "slurm.conf"
        self.conf.write_text(
            f"""ClusterName=artm
SlurmctldHost={socket_mod.gethostname().split(".")[0]}({self.ctl.address})
MailProg=/bin/true
AuthType=auth/munge
AuthInfo=socket={socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}/%n
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "spool"}/slurmd-%n.pid
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d / "log"}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait={self.kill_wait_s}
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
MinJobAge=300
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        )
        self.env = {"SLURM_CONF": str(self.conf)}
        log = open(d / "log" / "munged.out", "wb")
        self.ctl.exec(
            [
                _binary("munged"),
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={socket}",
                f"--pid-file={d / 'munge' / 'munged.pid'}",
                f"--log-file={d / 'log' / 'munged.log'}",
                f"--seed-file={d / 'munge' / 'munged.seed'}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while not socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.log('munged.out')}{self.log('munged.log')}")
            time.sleep(0.05)
        env = {**os.environ, **self.env}
        with open(d / "log" / "slurmctld.out", "wb") as out:
            self._daemon(
                self.ctl,
                [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        for h in self.nodes:
            (d / "spool" / self.node_name(h)).mkdir()
            with open(d / "log" / f"slurmd-{self.node_name(h)}.out", "wb") as out:
                self._daemon(
                    h,
                    [_binary("slurmd"), "-D", "-N", self.node_name(h), "-f", str(self.conf)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        self.wait_idle(ready_timeout_s)

    def _daemon(self, host: NetnsHost, argv: list[str], **kw: Any) -> subprocess.Popen:
        """Start a daemon in `host`'s network namespace, in a private mount namespace whose
        /etc/hosts names the nodes. Not `ip netns exec`: it mounts a fresh /sys, hiding
        /sys/fs/cgroup, and slurmd 22.05 refuses to start without a cgroup mount (its cgroup
        plugin initializes even with proctrack/linuxproc and task/none)."""
        hosts = Path("/etc/netns") / host.netns / "hosts"
        wrapped = [
            "nsenter",
            f"--net=/run/netns/{host.netns}",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'mount --bind {hosts} /etc/hosts && exec "$@"',
            "sh",
            *argv,
        ]
        proc = subprocess.Popen(wrapped, **kw)
        self.netns._procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.dir / "log" / name
        return f"--- {name} ---\n{path.read_text(errors='replace') if path.exists() else '(none)'}\n"

    def logs(self) -> str:
        return "".join(self.log(p.name) for p in sorted((self.dir / "log").glob("*")))

    def client(
        self, argv: list[str], host: NetnsHost | None = None, **kw: Any
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sbatch, squeue, ...) inside `host` (default: ctl)."""
        env = {**os.environ, **self.env, **kw.pop("env", {})}
        return (host or self.ctl).run(argv, env=env, **kw)

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until every node reports idle to slurmctld."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            result = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15)
            last = result.stdout + result.stderr
            states = dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)
            if len(states) == self.n and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {timeout_s} s: {last}\n{self.logs()}")

    def job_state(self, job_id: str) -> str:
        result = self.client(["scontrol", "show", "job", "-o", job_id], timeout=15)
        for word in result.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout_s: float) -> str:
        """Wait until the job leaves PENDING/RUNNING/COMPLETING; return its final state."""
        deadline = time.monotonic() + timeout_s
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                return state
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} still {state} after {timeout_s} s\n{self.logs()}")

    def close(self) -> None:
        try:
            self.netns.close()
        finally:
            for etc in self.hosts_dirs:
                shutil.rmtree(etc, ignore_errors=True)
