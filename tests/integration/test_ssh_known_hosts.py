"""known_hosts as OpenSSH writes it, against real sshds on loopback: comments, hashed names, `[host]:port`,
`@revoked` (refused, named) and `@cert-authority` (named when it is a host's only trust) lines, a file
that is never written, and a port that does not speak SSH (one sentence, no paramiko traceback)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import paramiko
import pytest

from art_mega.agent.ports import free_port
from art_mega.errors import UserError
from art_mega.launch.ssh_session import connect
from art_mega.launch.ssh_target import ConnectSpec
from tests.conftest import REPO, cli_env
from tests.integration.netns import sshd_path


@dataclass
class Sshd:
    port: int
    host_key_line: str  # "ssh-ed25519 AAAA..." of the key it offers
    process: subprocess.Popen[bytes]


@dataclass
class Keys:
    dir: Path
    client_key: Path
    ca_line: str  # "ssh-ed25519 AAAA..." of the CA that signed the certificate-only host
    unrelated_line: str


def _keygen(path: Path, *extra: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path), *extra], check=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


def _start_sshd(dir: Path, name: str, client_pub: Path, extra: Callable[[Path], list[str]]) -> Sshd:
    """An sshd on 127.0.0.1 (a free port) with a fresh ed25519 host key; `extra(host_key)` adds config lines."""
    host_key = dir / f"{name}_host_key"
    line = _keygen(host_key)
    port = free_port()
    config = dir / f"{name}_sshd_config"
    config.write_text(
        "\n".join(
            [
                "ListenAddress 127.0.0.1",
                f"Port {port}",
                f"HostKey {host_key}",
                f"PidFile {dir / name}.pid",
                f"AuthorizedKeysFile {client_pub}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "UsePAM no",
                "StrictModes no",
                "UseDNS no",
                *extra(host_key),
                "",
            ]
        )
    )
    process = subprocess.Popen(
        [sshd_path() or "sshd", "-D", "-e", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                if sock.recv(64).startswith(b"SSH-"):
                    return Sshd(port, line, process)
        except OSError:
            time.sleep(0.02)
    process.kill()
    raise AssertionError(f"sshd {name} did not start on 127.0.0.1:{port}")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    if os.geteuid() != 0 or not sshd_path():
        pytest.skip("needs root and sshd (openssh-server)")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    dir = tmp_path_factory.mktemp("sshd")
    client = dir / "id_ed25519"
    _keygen(client)
    ca_line = _keygen(dir / "ca")
    return Keys(dir, client, ca_line, _keygen(dir / "unrelated"))


@pytest.fixture(scope="module")
def sshd(keys) -> Iterator[Sshd]:
    server = _start_sshd(keys.dir, "plain", keys.client_key.with_suffix(".pub"), lambda _: [])
    yield server
    server.process.kill()
    server.process.wait()


@pytest.fixture(scope="module")
def cert_only_sshd(keys) -> Iterator[Sshd]:
    """An sshd that offers nothing but a host certificate signed by the test CA."""

    def certified(host_key: Path) -> list[str]:
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-s",
                str(keys.dir / "ca"),
                "-I",
                "host",
                "-h",
                "-n",
                "127.0.0.1",
                str(host_key),
            ],
            check=True,
        )
        return [f"HostCertificate {host_key}-cert.pub", "HostKeyAlgorithms ssh-ed25519-cert-v01@openssh.com"]

    server = _start_sshd(keys.dir, "cert", keys.client_key.with_suffix(".pub"), certified)
    yield server
    server.process.kill()
    server.process.wait()


def _spec(port: int, known_hosts: Path, keys: Keys, strict: str = "yes") -> ConnectSpec:
    return ConnectSpec(
        alias="box",
        hostname="127.0.0.1",
        port=port,
        user="root",
        identity_files=(str(keys.client_key),),
        identities_only=True,
        known_hosts_files=(str(known_hosts),),
        strict_host_key_checking=strict,
        connect_timeout_s=5.0,
    )


def _run_true(spec: ConnectSpec) -> int:
    client = connect(spec, "box")
    try:
        _, out, _ = client.exec_command("true")
        return out.channel.recv_exit_status()
    finally:
        client.close()


def test_comments_markers_hashed_and_unknown_lines_are_read_and_the_file_is_never_written(
    sshd, keys, tmp_path
):
    name = f"[127.0.0.1]:{sshd.port}"
    known = tmp_path / "known_hosts"
    known.write_text(
        "# hosts of the lab; keep this comment\n"
        f"@cert-authority *.example.com {keys.ca_line} lab CA\n"
        f"@revoked * {keys.unrelated_line}\n"
        "gpu-a,10.0.0.5 sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29t\n"
        "bad line\n"
        f"{paramiko.HostKeys.hash_host(name)} {sshd.host_key_line}\n"
    )
    before = known.read_bytes()
    assert _run_true(_spec(sshd.port, known, keys)) == 0
    assert known.read_bytes() == before

    patterned = tmp_path / "patterned"
    patterned.write_text(f"[127.0.0.?]:{sshd.port},!{name} {sshd.host_key_line}\n")
    with pytest.raises(UserError, match="is not in known_hosts"):  # a negated pattern wins
        _run_true(_spec(sshd.port, patterned, keys))
    patterned.write_text(f"[127.0.0.?]:{sshd.port},other {sshd.host_key_line}\n")
    assert _run_true(_spec(sshd.port, patterned, keys)) == 0
    patterned.write_text(f"[127.0.0.1]:{sshd.port} {keys.unrelated_line}\n")
    with pytest.raises(UserError, match="the host key does not match known_hosts"):  # a changed key
        _run_true(_spec(sshd.port, patterned, keys, strict="no"))


def test_a_revoked_host_key_is_refused_naming_the_host_and_the_file(sshd, keys, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {sshd.host_key_line}\n@revoked * {sshd.host_key_line}\n")
    message = rf"^ssh box \(root@127\.0\.0\.1:{sshd.port}\): its host key \(ssh-ed25519 SHA256:\S+\) is marked @revoked in {known} line 2; refusing it"
    with pytest.raises(UserError, match=message):
        _run_true(_spec(sshd.port, known, keys))
    with pytest.raises(UserError, match=message):  # accepting new keys never accepts a revoked one
        _run_true(_spec(sshd.port, known, keys, strict="accept-new"))


def test_a_host_trusted_only_through_a_cert_authority_is_one_sentence(sshd, cert_only_sshd, keys, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(f"# CA only\n@cert-authority [127.0.0.1]:* {keys.ca_line}\n")
    with pytest.raises(UserError) as info:
        _run_true(_spec(sshd.port, known, keys))
    assert str(info.value) == (
        f"ssh box (root@127.0.0.1:{sshd.port}): the host is trusted only through @cert-authority "
        f"({known} line 2), which art-mega's SSH client (paramiko) cannot check; add the host's own key "
        f"to known_hosts (ssh-keyscan -p {sshd.port} 127.0.0.1)"
    )
    with pytest.raises(
        UserError, match="the host offers only a host certificate and is trusted only through"
    ):
        _run_true(_spec(cert_only_sshd.port, known, keys))
    known.write_text(
        f"@cert-authority [127.0.0.1]:* {keys.ca_line}\n[127.0.0.1]:{cert_only_sshd.port} {cert_only_sshd.host_key_line}\n"
    )
    assert _run_true(_spec(cert_only_sshd.port, known, keys)) == 0  # its certificate's key is pinned


def test_accept_new_accepts_for_this_launch_and_never_rewrites_known_hosts(sshd, keys, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    user_known = home / ".ssh" / "known_hosts"
    user_known.write_text(
        f"# my hosts\n@cert-authority *.corp {keys.ca_line}\nold-box {keys.unrelated_line} note\n"
    )
    before = user_known.read_bytes()
    monkeypatch.setenv("HOME", str(home))
    spec = _spec(sshd.port, user_known, keys, strict="accept-new")
    assert _run_true(spec) == 0
    assert user_known.read_bytes() == before and sorted(p.name for p in (home / ".ssh").iterdir()) == [
        "known_hosts"
    ]
    with pytest.raises(UserError, match="is not in known_hosts"):  # nothing was remembered for later
        _run_true(_spec(sshd.port, user_known, keys))


def _line_server(answer: bytes, wait_for_line: bool) -> int:
    """A TCP server on 127.0.0.1 that sends `answer` (after the client's first line when
    `wait_for_line`, as an HTTP server answers a request; at once, as an SMTP server greets)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                if wait_for_line:
                    conn.makefile("rb").readline()
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


@pytest.fixture(scope="module")
def http_port() -> int:
    return _line_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", True)


def test_a_port_that_does_not_speak_ssh_is_one_sentence(keys, http_port, tmp_path, caplog):
    known = tmp_path / "known_hosts"
    with pytest.raises(UserError) as info:
        _run_true(_spec(http_port, known, keys))
    assert str(info.value).startswith(
        f"ssh box (root@127.0.0.1:{http_port}): port {http_port} does not speak SSH (it answered 'HTTP/1.1 400 Bad Request'); "
    )
    assert str(info.value).endswith("check the host's SSH port (Port in the ssh config or --ssh-arg=-p)")
    smtp = _line_server(b"220 mail.example.com ESMTP ready\r\n", False)
    with pytest.raises(
        UserError, match=r"does not speak SSH \(it answered '220 mail\.example\.com ESMTP ready'\)"
    ):
        _run_true(_spec(smtp, known, keys))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does) and never says a word
    spec = dataclasses.replace(_spec(silent.getsockname()[1], known, keys), connect_timeout_s=1.0)
    with pytest.raises(UserError, match=r"does not speak SSH \(no SSH banner came back\)"):
        _run_true(spec)
    silent.close()
    assert not [r for r in caplog.records if r.name.startswith("paramiko.transport")]


def test_the_cli_prints_one_sentence_for_a_non_ssh_port(keys, http_port, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host box\n  HostName 127.0.0.1\n  User root\n  IdentityFile {keys.client_key}\n")
    argv = [sys.executable, "-m", "art_mega", "ssh", "--host", "box", f"--ssh-arg=-F {config}"]
    argv += [
        f"--ssh-arg=-p {http_port}",
        "--port",
        str(free_port()),
        "--program",
        "examples/multinode/program.py:main",
    ]
    result = subprocess.run(argv, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "paramiko" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and f"port {http_port} does not speak SSH (it answered 'HTTP/1.1 400 Bad Request')" in lines[0]
    ), lines
