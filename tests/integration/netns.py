"""Real "hosts" for tests: Linux network namespaces on one L2 segment, each with a private sshd.

Layout of one cluster (all of it outside the root network namespace but one route)::

    artm-<pid>-<k>-sw     switch namespace: bridge br0 plus one veth end vh<i> per host
    artm-<pid>-<k>-<i>    host namespace i: lo up, eth0 = 10.231.X.(i+1)/24, sshd on eth0:22
    root namespace        `unreachable 10.231.X.0/24`: nothing for the subnet leaves the machine

`X` is claimed per cluster under /run/artm-netns so concurrently existing clusters never share a
subnet. Hosts talk to each other over the bridge (no routing, no IPv4 forwarding involved; the
root namespace is no hop). The root namespace cannot reach them: its route for the subnet is
`unreachable`, a blackhole whose senders get EHOSTUNREACH at once (a plain `blackhole` route
answers EINVAL), so a request sent from outside the namespaces by mistake fails fast instead of
leaving through the default route. Anything that talks to a host must itself run inside one of
the cluster's namespaces (`NetnsHost.exec` / `NetnsHost.run`).

Every cluster writes a client key, a `known_hosts` with every host key and an OpenSSH `ssh_config`
with one alias per host (`h0`, `h1`, ...), usable by OpenSSH, paramiko and asyncssh alike.

Teardown (`NetnsCluster.close`) SIGKILLs every process in every namespace of the cluster, deletes
the namespaces (which destroys the veths and the bridge), removes the root namespace's route,
releases the subnet and removes the temp dir; it is idempotent, runs when setup fails midway, and
is registered with atexit as a fallback. `reap_stale_namespaces` removes what a killed test
process left behind (routes of subnets nobody living claims included).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

IP = shutil.which("ip") or "/usr/sbin/ip"
NETNS_DIR = Path("/run/netns")
CLAIM_DIR = Path("/run/artm-netns")
SUBNET_PREFIX = "10.231"
TMP_PREFIX = "artm-netns-"
NAME_RE = re.compile(r"^artm-(\d+)-")

_counter = itertools.count()
_live: set[NetnsCluster] = set()


class NetnsError(RuntimeError):
    """Setting up or tearing down a namespace cluster failed."""


def sshd_path() -> str | None:
    """The sshd binary, or None when openssh-server is not installed."""
    found = shutil.which("sshd")
    if found:
        return found
    return "/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None


def _ip(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip ARGS` (optionally `ip ... -batch -` fed from `stdin`); raise NetnsError on failure."""
    proc = subprocess.run([IP, *args], input=stdin, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        detail = f"\n--- batch ---\n{stdin}" if stdin else ""
        raise NetnsError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}{detail}")
    return proc


def netns_pids(netns: str) -> list[int]:
    """Pids of the live processes inside `netns` (`ip netns pids`); [] when it does not exist."""
    proc = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def kill_netns_processes(
    netns: str,
    sig: int = signal.SIGKILL,
    keep: frozenset[int] | set[int] = frozenset(),
    timeout_s: float = 5.0,
) -> list[int]:
    """Send `sig` to every process in `netns` except `keep`; with SIGKILL, repeat until none is left.

    Returns every pid signalled. Raises NetnsError when SIGKILLed processes outlive `timeout_s`.
    """
    signalled: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [p for p in netns_pids(netns) if p not in keep]
        if not pids or (sig != signal.SIGKILL and signalled):
            return signalled
        if time.monotonic() > deadline:
            raise NetnsError(f"processes in {netns} survived SIGKILL: {pids}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        signalled.extend(p for p in pids if p not in signalled)
        time.sleep(0.01)


def netns_list() -> list[str]:
    """Names in `ip netns list` (the first word of each line)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_namespaces() -> list[str]:
    """Delete what dead test processes left: `artm-<pid>-...` namespaces, subnet claims, temp dirs.

    Only namespaces and claims whose creating pid is gone are touched; returns the namespace names.
    """
    reaped = []
    for name in netns_list():
        match = NAME_RE.match(name)
        if not match or _pid_running(int(match.group(1))):
            continue
        with contextlib.suppress(NetnsError):
            kill_netns_processes(name)
            _ip("netns", "del", name)
            reaped.append(name)
    for claim in CLAIM_DIR.glob(f"{SUBNET_PREFIX}.*"):
        owner, tmpdir = _read_claim(claim)
        if owner and _pid_running(owner):
            continue
        if tmpdir and Path(tmpdir).name.startswith(TMP_PREFIX):
            shutil.rmtree(tmpdir, ignore_errors=True)
        with contextlib.suppress(OSError):
            claim.unlink()
    for subnet in root_unreachable_routes():
        # a claim is written before its route is added and removed after it is deleted, so a
        # route without a living claim belongs to nobody
        owner, _ = _read_claim(CLAIM_DIR / subnet.rsplit(".", 1)[0])
        if not (owner and _pid_running(owner)):
            _ip("route", "del", "unreachable", subnet, check=False)
    return reaped


def root_unreachable_routes() -> list[str]:
    """The `10.231.X.0/24` subnets with an `unreachable` route in the root namespace."""
    out = _ip("-4", "route", "show", "type", "unreachable", check=False).stdout
    found = []
    for line in out.splitlines():
        words = line.split()
        subnet = words[1] if len(words) > 1 and words[0] == "unreachable" else (words[0] if words else "")
        if re.fullmatch(rf"{re.escape(SUBNET_PREFIX)}\.\d+\.0/24", subnet):
            found.append(subnet)
    return found


@functools.cache
def netns_unavailable_reason() -> str | None:
    """Why namespace clusters cannot run here (not root, no sshd, `ip netns add` refused), else None.

    Probes once per process by adding and deleting a throwaway namespace; also reaps stale ones.
    """
    if os.geteuid() != 0:
        return f"needs root (network namespaces); running as uid {os.geteuid()}"
    if not sshd_path():
        return "sshd not found (install openssh-server)"
    if not os.access(IP, os.X_OK):
        return "`ip` not found (install iproute2)"
    probe = f"artm-{os.getpid()}-probe"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` not permitted: {added.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    reap_stale_namespaces()
    return None


def _read_claim(claim: Path) -> tuple[int, str]:
    """(owner pid, temp dir) recorded in a subnet claim file; (0, "") when unreadable."""
    try:
        pid, _, tmpdir = claim.read_text().partition("\n")
        return int(pid), tmpdir.strip()
    except (OSError, ValueError):
        return 0, ""


def _claim_subnet(tmpdir: Path) -> int:
    """Claim a free third octet X for 10.231.X.0/24: a file under /run/artm-netns with our pid and tmpdir."""
    CLAIM_DIR.mkdir(parents=True, exist_ok=True)
    with open(CLAIM_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        start = (os.getpid() * 7 + next(_counter)) % 254
        for step in range(254):
            octet = 1 + (start + step) % 254
            claim = CLAIM_DIR / f"{SUBNET_PREFIX}.{octet}"
            owner, _ = _read_claim(claim)
            if owner and _pid_running(owner):
                continue
            claim.write_text(f"{os.getpid()}\n{tmpdir}\n")
            return octet
    raise NetnsError(f"no free {SUBNET_PREFIX}.X.0/24 subnet (claims in {CLAIM_DIR})")


def _release_subnet(octet: int) -> None:
    with contextlib.suppress(OSError):
        (CLAIM_DIR / f"{SUBNET_PREFIX}.{octet}").unlink()


def _new_ed25519(path: Path) -> str:
    """Write a fresh OpenSSH-format ed25519 private key to `path` (mode 600); return the public line."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return pub.decode()


_PROBE = r"""
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
pending = sys.argv[2:]
while pending and time.monotonic() < deadline:
    for addr in list(pending):
        try:
            with socket.create_connection((addr, 22), timeout=0.5) as s:
                s.settimeout(0.5)
                if s.recv(256).startswith(b"SSH-"):  # read the whole banner: no RST
                    pending.remove(addr)
        except OSError:
            pass
    if pending:
        time.sleep(0.01)
print(" ".join(pending))
sys.exit(1 if pending else 0)
"""


class NetnsHost:
    """One host: a network namespace with `eth0` on the cluster's segment and a private sshd."""

    def __init__(self, cluster: NetnsCluster, index: int, netns: str, address: str) -> None:
        self.cluster = cluster
        self.index = index
        self.name = f"h{index}"
        self.ssh_alias = self.name
        self.netns = netns
        self.address = address
        self.switch_port = f"vh{index}"
        self.dir = cluster.tmpdir / self.name
        self.sshd_config = self.dir / "sshd_config"
        self.sshd_log = self.dir / "sshd.log"
        self.host_key = self.dir / "ssh_host_ed25519_key"
        self.host_public_key = ""
        self.sshd: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"NetnsHost({self.name}, {self.address}, netns={self.netns})"

    @property
    def sshd_pid(self) -> int | None:
        """Pid of this host's sshd listener (None before start)."""
        return self.sshd.pid if self.sshd else None

    def argv(self, argv: list[str] | tuple[str, ...]) -> list[str]:
        """`argv` prefixed with `ip netns exec NETNS`."""
        return [IP, "netns", "exec", self.netns, *map(str, argv)]

    def exec(self, argv: list[str] | tuple[str, ...], **popen_kwargs: Any) -> subprocess.Popen:
        """Start `argv` inside this namespace; the Popen is killed and reaped at cluster close."""
        proc = subprocess.Popen(self.argv(argv), **popen_kwargs)
        self.cluster._procs.append(proc)
        return proc

    def run(self, argv: list[str] | tuple[str, ...], **kw: Any) -> subprocess.CompletedProcess:
        """Run `argv` inside this namespace to completion (captures text output unless told otherwise)."""
        if not any(k in kw for k in ("stdout", "stderr", "capture_output")):
            kw["capture_output"] = True
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(self.argv(argv), **kw)

    def pids(self) -> list[int]:
        """Pids of every live process in this namespace (sshd included)."""
        return netns_pids(self.netns)

    def kill_processes(self, *, include_sshd: bool = False, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process in the namespace (except the sshd listener unless `include_sshd`)."""
        keep = set() if include_sshd or self.sshd_pid is None else {self.sshd_pid}
        return kill_netns_processes(self.netns, sig=sig, keep=keep)

    def set_link(self, up: bool) -> None:
        """Plug (`up=True`) or unplug this host's cable at the switch: packets to/from it are dropped."""
        _ip("-n", self.cluster.switch_netns, "link", "set", self.switch_port, "up" if up else "down")

    def ssh(self, target: NetnsHost | str, command: str, **kw: Any) -> subprocess.CompletedProcess:
        """Run the OpenSSH client inside this host against `target` (a host or alias) with the cluster config."""
        return self.run(self.cluster.ssh_argv(target, command), **kw)


class NetnsCluster:
    """`n` namespace hosts on one bridge, each with its own sshd; use as a context manager.

    Attributes after `start()` / `__enter__`: `hosts`, `tmpdir`, `key_path` (client private key),
    `public_key`, `known_hosts`, `ssh_config`, `subnet`, `switch_netns`.
    """

    def __init__(self, n: int = 3, *, ready_timeout_s: float = 10.0, tmp_root: str | None = None) -> None:
        if not 1 <= n <= 250:
            raise ValueError(f"n must be in 1..250, got {n}")
        self.n = n
        self.ready_timeout_s = ready_timeout_s
        self.tmp_root = tmp_root
        self.hosts: list[NetnsHost] = []
        self.tmpdir = Path()
        self.key_path = Path()
        self.public_key = ""
        self.known_hosts = Path()
        self.ssh_config = Path()
        self.subnet = ""
        self.switch_netns = ""
        self.prefix = ""
        self._octet: int | None = None
        self._route = False
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._started = False
        self._closed = False

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NetnsCluster({self.prefix or '?'}, {self.subnet or '?'}, n={self.n})"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this cluster created (hosts and switch)."""
        return list(self._created)

    def host(self, name_or_index: str | int) -> NetnsHost:
        """The host called `h<i>` (or with index i)."""
        if isinstance(name_or_index, int):
            return self.hosts[name_or_index]
        return next(h for h in self.hosts if name_or_index in (h.name, h.ssh_alias, h.address, h.netns))

    def ssh_argv(self, target: NetnsHost | str, command: str | None = None) -> list[str]:
        """OpenSSH client argv for `target` using this cluster's ssh_config (run it inside a host)."""
        alias = target.ssh_alias if isinstance(target, NetnsHost) else target
        return ["ssh", "-F", str(self.ssh_config), alias, *([command] if command is not None else [])]

    def kill_host_processes(self, host: NetnsHost | str | int, *, include_sshd: bool = False) -> list[int]:
        """SIGKILL every process inside `host` (its sshd listener too only with `include_sshd`)."""
        if not isinstance(host, NetnsHost):
            host = self.host(host)
        return host.kill_processes(include_sshd=include_sshd)

    # -- setup -----------------------------------------------------------------------------------

    def start(self) -> NetnsCluster:
        """Create namespaces, bridge, addresses, keys and sshds; wait until every sshd answers."""
        if self._started:
            return self
        self._started = True
        _live.add(self)
        try:
            self._setup()
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise
        return self

    def _setup(self) -> None:
        sshd = sshd_path()
        if not sshd:
            raise NetnsError("sshd not found (install openssh-server)")
        self.tmpdir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=self.tmp_root))
        self._octet = _claim_subnet(self.tmpdir)
        self.subnet = f"{SUBNET_PREFIX}.{self._octet}.0/24"
        _ip("route", "replace", "unreachable", self.subnet)  # replace: a dead owner's may remain
        self._route = True
        pid = os.getpid()
        while True:
            self.prefix = f"artm-{pid}-{next(_counter)}"
            names = [f"{self.prefix}-{i}" for i in range(self.n)] + [f"{self.prefix}-sw"]
            if not any((NETNS_DIR / name).exists() for name in names):
                break
        self.switch_netns = names[-1]
        self.hosts = [
            NetnsHost(self, i, names[i], f"{SUBNET_PREFIX}.{self._octet}.{i + 1}") for i in range(self.n)
        ]

        for name in names:  # one at a time, so close() knows exactly which exist
            _ip("netns", "add", name)
            self._created.append(name)
        switch = ["link set lo up", "link add br0 type bridge", "link set br0 up"]
        for h in self.hosts:
            switch += [
                f"link add {h.switch_port} type veth peer name eth0 netns {h.netns}",
                f"link set {h.switch_port} master br0 up",
            ]
        _ip("-n", self.switch_netns, "-batch", "-", stdin="\n".join(switch) + "\n")
        for h in self.hosts:
            batch = ["link set lo up", f"addr add {h.address}/24 dev eth0", "link set eth0 up"]
            _ip("-n", h.netns, "-batch", "-", stdin="\n".join(batch) + "\n")

        self._write_keys_and_configs()
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        for h in self.hosts:
            with open(h.sshd_log, "wb") as log:
                h.sshd = h.exec(
                    [sshd, "-D", "-e", "-f", str(h.sshd_config)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        self._wait_ready()

    def _write_keys_and_configs(self) -> None:
        self.key_path = self.tmpdir / "id_ed25519"
        self.public_key = _new_ed25519(self.key_path)
        (self.tmpdir / "id_ed25519.pub").write_text(self.public_key + "\n")
        authorized = self.tmpdir / "authorized_keys"
        authorized.write_text(self.public_key + "\n")
        self.known_hosts = self.tmpdir / "known_hosts"
        self.ssh_config = self.tmpdir / "ssh_config"
        known, config = [], []
        for h in self.hosts:
            h.dir.mkdir()
            h.host_public_key = _new_ed25519(h.host_key)
            known.append(f"{h.address} {h.host_public_key}")
            h.sshd_config.write_text(
                "\n".join(
                    [
                        f"ListenAddress {h.address}",
                        "Port 22",
                        f"HostKey {h.host_key}",
                        f"PidFile {h.dir / 'sshd.pid'}",
                        f"AuthorizedKeysFile {authorized}",
                        "PubkeyAuthentication yes",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "AuthenticationMethods publickey",
                        "PermitRootLogin prohibit-password",
                        "UsePAM no",
                        "StrictModes no",
                        "UseDNS no",
                        "PrintMotd no",
                        "PrintLastLog no",
                        "MaxStartups 100:30:200",
                        "MaxSessions 100",
                        "LoginGraceTime 20",
                        "",
                    ]
                )
            )
            config += [
                f"Host {h.ssh_alias}",
                f"    HostName {h.address}",
                "    User root",
                "    Port 22",
                f"    IdentityFile {self.key_path}",
                f"    UserKnownHostsFile {self.known_hosts}",
                "    GlobalKnownHostsFile /dev/null",
                "    StrictHostKeyChecking yes",
                "    IdentitiesOnly yes",
                "    BatchMode yes",
                "    ConnectTimeout 5",
                "    KexAlgorithms curve25519-sha256",  # sntrup761 (default) costs ~0.2 s per connect
                "",
            ]
        self.known_hosts.write_text("\n".join(known) + "\n")
        self.ssh_config.write_text("\n".join(config))

    def _wait_ready(self) -> None:
        """Wait until every sshd sends its banner to a client in h0's namespace (proves the bridge too)."""
        probe = self.hosts[0].exec(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                _PROBE,
                str(self.ready_timeout_s),
                *(h.address for h in self.hosts),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        while probe.poll() is None:
            for h in self.hosts:
                if h.sshd is not None and h.sshd.poll() is not None:
                    probe.kill()
                    probe.communicate()
                    raise NetnsError(
                        f"sshd of {h} exited with {h.sshd.returncode}:\n{h.sshd_log.read_text(errors='replace')}"
                    )
            time.sleep(0.005)
        out = probe.communicate()[0].decode(errors="replace").strip()
        if probe.returncode != 0:
            logs = "\n".join(
                f"--- {h.name} ---\n{h.sshd_log.read_text(errors='replace')}" for h in self.hosts
            )
            raise NetnsError(
                f"sshd not reachable from {self.hosts[0].name} after {self.ready_timeout_s}s: {out}\n{logs}"
            )

    # -- teardown --------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the cluster's namespaces, delete them, free the subnet, remove tmpdir.

        Idempotent. Every step runs even when an earlier one fails; failures are raised at the end.
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        errors: list[str] = []
        for name in self._created:
            try:
                kill_netns_processes(name)
            except Exception as e:  # keep tearing down
                errors.append(str(e))
        for proc in self._procs:
            with contextlib.suppress(Exception):
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=5)
        for name in reversed(self._created):
            result = _ip("netns", "del", name, check=False)
            if result.returncode != 0 and name in netns_list():
                errors.append(f"ip netns del {name}: {result.stderr.strip()}")
        if self._route:
            result = _ip("route", "del", "unreachable", self.subnet, check=False)
            if result.returncode != 0 and self.subnet in root_unreachable_routes():
                errors.append(f"ip route del unreachable {self.subnet}: {result.stderr.strip()}")
        if self._octet is not None:
            _release_subnet(self._octet)
        if self.tmpdir != Path():
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        if errors:
            raise NetnsError(f"teardown of {self!r} incomplete: {'; '.join(errors)}")


@atexit.register
def _close_all_at_exit() -> None:
    """Fallback: tear down clusters a crashed test or fixture left open."""
    for cluster in list(_live):
        try:
            cluster.close()
        except Exception as e:
            print(f"netns teardown at exit: {e}", file=sys.stderr)
