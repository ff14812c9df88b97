"""One SSH connection (paramiko) that runs one host's agent and watches it for its whole life.

The launch secret goes over the channel's stdin, never argv; closing the channel (stdin EOF)
stops the remote agent, which stops its children. Blocking paramiko calls run in threads.
"""

from __future__ import annotations

import collections
import json
import logging
import shlex
import socket
import sys
import threading
from typing import Any

from art_mega.agent.protocol import READY_PREFIX
from art_mega.errors import UserError
from art_mega.launch.ssh_target import (
    CERT_AUTHORITY,
    REVOKED,
    ConnectSpec,
    KnownHosts,
    SshOptions,
    lookup_name,
    resolve,
)

ACCEPT_NEW_KEYS = ("no", "off", "accept-new")
"""StrictHostKeyChecking values under which an unknown host key is accepted (for this launch
only: known_hosts is never written)."""


class _KnownHostsPolicy:
    """paramiko's hook for a host key that no known_hosts line lists for the host as a plain key.

    Refuses a key marked `@revoked` (always), accepts it in memory when StrictHostKeyChecking
    allows new keys, and otherwise refuses it in one sentence (naming the `@cert-authority` line
    when the host is only trusted through one, which paramiko cannot check).
    """

    def __init__(self, known: KnownHosts, spec: ConnectSpec, where: str) -> None:
        self.known = known
        self.spec = spec
        self.where = where

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        offered = f"{key.get_name()} {key.fingerprint}"
        revoked = self.known.revoked(hostname, key.asbytes())
        if revoked is not None:
            raise UserError(
                f"{self.where}: its host key ({offered}) is marked {REVOKED} in {revoked.where}; "
                "refusing it (the host needs a new key, then a new known_hosts line)"
            )
        if self.spec.strict_host_key_checking in ACCEPT_NEW_KEYS:
            client.get_host_keys().add(hostname, key.get_name(), key)
            return
        authorities = self.known.for_host(hostname, CERT_AUTHORITY)
        if authorities:
            certificate = client.get_transport().host_key_type.endswith("-cert-v01@openssh.com")
            offers = "offers only a host certificate and " if certificate else ""
            port = f"-p {self.spec.port} " if self.spec.port != 22 else ""
            raise UserError(
                f"{self.where}: the host {offers}is trusted only through {CERT_AUTHORITY} "
                f"({authorities[0].where}), which art-mega's SSH client (paramiko) cannot check; "
                f"add the host's own key to known_hosts (ssh-keyscan {port}{self.spec.hostname})"
            )
        raise UserError(
            f"{self.where}: the host key ({offered}) is not in known_hosts; add it (e.g. ssh-keyscan) "
            "or set StrictHostKeyChecking"
        )


def _quiet_paramiko() -> None:
    """paramiko's transport thread logs every failed handshake with a traceback (through the
    logging last-resort handler when nothing is configured); `connect` says it in one sentence."""
    logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)


def _first_line_from(host: str, port: int, timeout_s: float) -> str | None:
    """What a non-SSH server at HOST:PORT answers to an SSH banner (its first line), or None."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"SSH-2.0-art-mega-probe\r\n")
            data = sock.recv(256)
    except OSError:
        return None
    line = data.decode(errors="replace").splitlines()[0].strip() if data.strip() else ""
    return line[:80] or None


def _not_ssh(spec: ConnectSpec, where: str, direct: bool) -> UserError:
    answered = (
        _first_line_from(spec.hostname, spec.port, min(spec.connect_timeout_s, 2.0)) if direct else None
    )
    said = f"it answered {answered!r}" if answered else "no SSH banner came back"
    return UserError(
        f"{where}: port {spec.port} does not speak SSH ({said}); check the host's SSH port "
        "(Port in the ssh config or --ssh-arg=-p)"
    )


def connect(spec: ConnectSpec, label: str, depth: int = 0):  # type: ignore[no-untyped-def]
    """Open an authenticated `paramiko.SSHClient` to `spec` (through ProxyJump/ProxyCommand).

    Host keys come from `spec.known_hosts_files` (read with `KnownHosts`, never written): a
    plain line must match the host's key, a `@revoked` key is refused, `@cert-authority` lines
    are not checked (paramiko cannot) and are named when they are the host's only trust.

    Raises:
        UserError: one sentence for a refused key, an encrypted key without an agent, an unknown,
            changed or revoked host key, a port that does not speak SSH, or an unreachable host
            (art-mega never prompts).
    """
    import paramiko

    _quiet_paramiko()
    where = f"ssh {label} ({spec.user}@{spec.hostname}:{spec.port})"
    if depth > 4:
        raise UserError(f"{where}: ProxyJump chain is deeper than 4 hops")
    known = KnownHosts.load(spec.known_hosts_files)
    name = lookup_name(spec.hostname, spec.port)
    sock: Any = None
    jump_client = None
    client = paramiko.SSHClient()
    try:
        if spec.proxy_jump:
            jump = spec.proxy_jump.split(",")[0]
            jump_user, _, jump_host = jump.rpartition("@")
            jump_port = None
            if ":" in jump_host and not jump_host.startswith("["):
                jump_host, _, jump_port_text = jump_host.partition(":")
                if (
                    not (jump_port_text.isascii() and jump_port_text.isdigit())
                    or not 0 < int(jump_port_text) < 65536
                ):
                    raise UserError(
                        f"{where}: ProxyJump {jump!r} has port {jump_port_text!r}, not a port (1..65535 in "
                        "ASCII digits); write it as [user@]host[:port], e.g. bastion:22"
                    )
                jump_port = int(jump_port_text)
            jump_spec = resolve(
                jump_host, jump_user or None, SshOptions(config_file=spec.options.config_file, port=jump_port)
            )
            jump_client = connect(jump_spec, f"{label} via jump {jump}", depth + 1)
            sock = jump_client.get_transport().open_channel(
                "direct-tcpip", (spec.hostname, spec.port), ("127.0.0.1", 0), timeout=spec.connect_timeout_s
            )
        elif spec.proxy_command:
            sock = paramiko.ProxyCommand(spec.proxy_command)
        host_keys = client.get_host_keys()
        for line in known.for_host(name):
            if known.revoked(name, line.key_blob) is not None:
                continue  # listed and revoked: revoked wins, the policy refuses it if offered
            try:
                key = paramiko.PKey.from_type_string(line.key_type, line.key_blob)
            except (paramiko.SSHException, paramiko.pkey.UnknownKeyType, ValueError):
                continue  # a key type paramiko cannot use (ssh-dss, sk-ssh-ed25519), as OpenSSH skips unknown ones
            host_keys.add(name, key.get_name(), key)
        client.set_missing_host_key_policy(_KnownHostsPolicy(known, spec, where))
        client.connect(
            spec.hostname,
            port=spec.port,
            username=spec.user,
            key_filename=list(spec.identity_files) or None,
            look_for_keys=not spec.identities_only,
            allow_agent=True,
            timeout=spec.connect_timeout_s,
            banner_timeout=spec.connect_timeout_s,
            auth_timeout=spec.connect_timeout_s,
            sock=sock,
            passphrase=None,
        )
    except BaseException as exc:
        transport = client.get_transport()
        # connected, but no "SSH-" banner came back: whatever paramiko raised next (a banner
        # error, "No existing session" when its threads race), the port does not speak SSH
        no_banner = transport is not None and not transport.remote_version
        client.close()
        if jump_client is not None:
            jump_client.close()
        raise _user_error(exc, spec, where, direct=sock is None, no_banner=no_banner) from None
    client._art_mega_jump = jump_client  # keep the jump connection alive with the client
    return client


def _user_error(
    exc: BaseException, spec: ConnectSpec, where: str, direct: bool, no_banner: bool
) -> BaseException:
    """The one sentence for a failed connect (`exc` itself when it is not a connection failure).

    `direct`: no proxy between us and the host; `no_banner`: the TCP connection was made but the
    host never sent an SSH banner.
    """
    import paramiko

    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, paramiko.PasswordRequiredException):
        return UserError(
            f"{where}: the private key is encrypted; load it into ssh-agent (art-mega never prompts for a passphrase)"
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return UserError(
            f"{where}: the host key does not match known_hosts; check the host or fix known_hosts"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return UserError(
            f"{where}: authentication failed; the key was refused (check IdentityFile, -i or ssh-agent; "
            "passwords are never prompted for)"
        )
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if no_banner or "protocol banner" in text or "Indecipherable protocol version" in text:
            return _not_ssh(spec, where, direct)
        return UserError(f"{where}: {text}")
    if isinstance(exc, (TimeoutError, OSError, ValueError)):
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return UserError(f"{where}: cannot connect ({reason}); check the host is up and reachable")
    return exc


class AgentSession:
    """Runs `art-mega worker` over one SSH connection and reports what it prints."""

    def __init__(self, label: str, client: Any) -> None:
        self.label = label
        self._client = client
        self._channel: Any = None
        self._ready = threading.Event()
        self.ready: dict[str, Any] | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._threads: list[threading.Thread] = []

    def start(self, command: str, secret: bytes) -> None:
        """Run `command` on the host and write the secret line to its stdin (blocking)."""
        transport = self._client.get_transport()
        self._channel = transport.open_session()
        self._channel.exec_command(command)
        self._channel.sendall(secret + b"\n")
        for target, name in ((self._read_stdout, "stdout"), (self._read_stderr, "stderr")):
            thread = threading.Thread(target=target, name=f"ssh-{self.label}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _read_stdout(self) -> None:
        stream = self._channel.makefile("rb")
        for raw in stream:
            line = raw.decode(errors="replace").strip()
            if self.ready is None and line.startswith(READY_PREFIX):
                try:
                    self.ready = json.loads(line[len(READY_PREFIX) :])
                except ValueError:
                    continue
                self._ready.set()
        self._ready.set()

    def _read_stderr(self) -> None:
        stream = self._channel.makefile_stderr("rb")
        for raw in stream:
            line = raw.decode(errors="replace").rstrip()
            self._stderr_tail.append(line)
            print(f"[{self.label}] {line}", file=sys.stderr, flush=True)

    def wait_ready(self, timeout_s: float) -> dict[str, Any] | None:
        """Block until the ready line (returned) or the command ends (None); None on timeout."""
        self._ready.wait(timeout_s)
        return self.ready

    def wait_exit(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` seconds for the remote command to end; True if it did."""
        return self._channel is not None and self._channel.status_event.wait(timeout_s)

    def exited(self) -> bool:
        return self._channel is not None and self._channel.exit_status_ready()

    def exit_status(self) -> int | None:
        return self._channel.recv_exit_status() if self.exited() else None

    def stderr_tail(self) -> str:
        return " | ".join(line for line in self._stderr_tail if line.strip())[-600:]

    def transport_active(self) -> bool:
        transport = self._client.get_transport()
        return transport is not None and transport.is_active()

    def stop(self, grace_s: float, pid: int | None) -> None:
        """Close stdin (the agent stops), wait up to `grace_s` s, then kill it over SSH; close."""
        try:
            if self._channel is not None and not self._channel.closed:
                self._channel.shutdown_write()
                self._channel.status_event.wait(grace_s)
            if (
                pid is not None
                and self._channel is not None
                and not self.exited()
                and self.transport_active()
            ):
                _, out, _ = self._client.exec_command(
                    f"kill -TERM -- -{pid} {pid} 2>/dev/null; sleep 2; kill -KILL -- -{pid} {pid} 2>/dev/null; true",
                    timeout=grace_s + 5,
                )
                out.channel.recv_exit_status()
        except Exception:  # the connection may already be gone; closing below is all that is left
            pass
        finally:
            self.close()

    def close(self) -> None:
        try:
            if self._channel is not None:
                self._channel.close()
        finally:
            self._client.close()
            jump = getattr(self._client, "_art_mega_jump", None)
            if jump is not None:
                jump.close()


def agent_command(
    python: str, address: str, launch_id: str, cwd: str | None, controller_lease_s: float | None = None
) -> str:
    """The remote shell command that starts an agent reading its secret from stdin."""
    worker = [python, "-m", "art_mega", "worker", "--address", address, "--launch-id", launch_id]
    worker += ["--secret-stdin", "--exit-on-stdin-eof"]
    if controller_lease_s is not None:
        worker += ["--controller-lease", repr(controller_lease_s)]
    prefix = f"cd {shlex.quote(cwd)} 2>/dev/null; " if cwd else ""
    return prefix + "exec " + " ".join(shlex.quote(w) for w in worker)
