"""One SSH connection (paramiko) that runs one host's agent and watches it for its whole life.

The launch secret goes over the channel's stdin, never argv; closing the channel (stdin EOF)
stops the remote agent, which stops its children. Blocking paramiko calls run in threads.
"""

from __future__ import annotations

import collections
import json
import shlex
import sys
import threading
from typing import Any

from art_mega.errors import UserError
from art_mega.launch.ssh_target import ConnectSpec, SshOptions, resolve
from art_mega.runtime.protocol import READY_PREFIX


def _policy(strict: str):  # type: ignore[no-untyped-def]
    import paramiko

    if strict in ("no", "off", "accept-new"):
        return paramiko.AutoAddPolicy()
    return paramiko.RejectPolicy()


def connect(spec: ConnectSpec, label: str, depth: int = 0):  # type: ignore[no-untyped-def]
    """Open an authenticated `paramiko.SSHClient` to `spec` (through ProxyJump/ProxyCommand).

    Raises:
        UserError: one sentence for a refused key, an encrypted key without an agent, an unknown
            or changed host key, or an unreachable host (art-mega never prompts).
    """
    import paramiko

    where = f"ssh {label} ({spec.user}@{spec.hostname}:{spec.port})"
    if depth > 4:
        raise UserError(f"{where}: ProxyJump chain is deeper than 4 hops")
    sock: Any = None
    jump_client = None
    try:
        if spec.proxy_jump:
            jump = spec.proxy_jump.split(",")[0]
            jump_user, _, jump_host = jump.rpartition("@")
            jump_port = None
            if ":" in jump_host and not jump_host.startswith("["):
                jump_host, _, jump_port_text = jump_host.partition(":")
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
        client = paramiko.SSHClient()
        client.load_system_host_keys()
        for path in spec.known_hosts_files:
            try:
                client.load_host_keys(path)
            except OSError:
                continue
        client.set_missing_host_key_policy(_policy(spec.strict_host_key_checking))
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
    except UserError:
        raise
    except paramiko.PasswordRequiredException:
        raise UserError(
            f"{where}: the private key is encrypted; load it into ssh-agent (art-mega never prompts for a passphrase)"
        ) from None
    except paramiko.BadHostKeyException:
        raise UserError(
            f"{where}: the host key does not match known_hosts; check the host or fix known_hosts"
        ) from None
    except paramiko.AuthenticationException:
        raise UserError(
            f"{where}: authentication failed; the key was refused (check IdentityFile, -i or ssh-agent; "
            "passwords are never prompted for)"
        ) from None
    except paramiko.SSHException as exc:
        if "known_hosts" in str(exc) or "not found in" in str(exc):
            raise UserError(
                f"{where}: the host key is not in known_hosts; add it (e.g. ssh-keyscan) or set StrictHostKeyChecking"
            ) from None
        raise UserError(f"{where}: {exc}") from None
    except (TimeoutError, OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(f"{where}: cannot connect ({reason}); check the host is up and reachable") from None
    client._art_mega_jump = jump_client  # keep the jump connection alive with the client
    return client


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
