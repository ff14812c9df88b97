"""known_hosts files the first tests did not try, against a real sshd on loopback: an `ssh-dss`
line for the host (a key type paramiko no longer knows), a hashed `@revoked` line, a key revoked
for another host only, CRLF line ends with a malformed line in the middle, a known_hosts path that
is a directory, and a ProxyJump whose port is not a port.

Before: an `ssh-dss` line for the host escaped as paramiko's `UnknownKeyType` traceback, and a
ProxyJump port `٣` was taken as 3 (`abc`: "cannot connect (invalid literal for int())").
"""

from __future__ import annotations

import dataclasses

import paramiko
import pytest

from art_mega.errors import UserError
from tests.integration.test_ssh_known_hosts import _run_true, _spec, keys, sshd

__all__ = ["keys", "sshd"]  # module fixtures shared with test_ssh_known_hosts

DSS = "ssh-dss AAAAB3NzaC1kc3MAAACBAP1/U4EddRIpUt9KnC7s5Of2EbdSPO9EAMMeP4C2USZpRV1AIlH7WT2NWPq/xfW6MPbLm1Vs14E7gB00b/JmYLdrmVClpJ+f6AR7ECLCT7up1/63xhv4O1fnxqimFQ8E+4P208UewwI1VBNaFpEy9nXzrith1yrv8iIDGZ3RSAHHAAAAFQCXYFCPFSMLzLKSuYKi64QL8Fgc9QAAAIEA9+GghdabPd7LvKtcNrhXuXmUr7v6OuqC+VdMCz0HgmdRWVeOutRZT+ZxBxCBgLRJFnEj6EwoFhO3zwkyjMim4TwWeotUfI0o4KOuHiuzpnWRbqN/C/ohNWLx+2J6ASQ7zKTxvqhRkImog9/hWuWfBpKLZl6Ae1UlZAFMO/7PSSoAAACBAPAyDtxMW2BD4sbDtIQm/zfdhFPMJJV2kx76odH8SB8W1q9O3hU9M1EYMBWKQWe+P5QymzB2g8BjmeT7EXDTRhUJhHkX81tMsWz8L6HhhIAl6eMBPTZvyfZjbCkr2zvXnWVeGVtmaBgtL1NAAa+sSmG6bQ56LW4cpPRNspRvVufF"


@pytest.mark.parametrize("line_end", ["\n", "\r\n"])
def test_unusable_and_malformed_lines_are_skipped_as_openssh_skips_them(sshd, keys, tmp_path, line_end):
    name = f"[127.0.0.1]:{sshd.port}"
    known = tmp_path / "known_hosts"
    lines = [
        f"{name} {DSS}",  # paramiko cannot load ssh-dss keys
        f"{name} ssh-ed25519",  # too few fields
        f"{name} ssh-ed25519 !!notbase64!!",
        f"{name} {sshd.host_key_line}",
        f"@revoked other-host {sshd.host_key_line}",  # revoked for another host only
    ]
    known.write_bytes(line_end.join(lines).encode() + line_end.encode())
    assert _run_true(_spec(sshd.port, known, keys)) == 0


def test_a_hashed_revoked_line_refuses_the_key(sshd, keys, tmp_path):
    name = f"[127.0.0.1]:{sshd.port}"
    known = tmp_path / "known_hosts"
    known.write_text(
        f"{name} {sshd.host_key_line}\r\n@revoked {paramiko.HostKeys.hash_host(name)} {sshd.host_key_line}\r\n"
    )
    with pytest.raises(UserError, match=rf"is marked @revoked in {known} line 2; refusing it"):
        _run_true(_spec(sshd.port, known, keys, strict="accept-new"))


def test_a_known_hosts_path_that_is_a_directory_is_one_sentence(sshd, keys, tmp_path):
    with pytest.raises(UserError) as raised:
        _run_true(_spec(sshd.port, tmp_path, keys))
    assert (
        str(raised.value) == f"known_hosts file {tmp_path} cannot be read (Is a directory); fix or remove it"
    )


@pytest.mark.parametrize("port", ["abc", "٣", "0", "70000", ""])
def test_a_proxy_jump_port_that_is_not_a_port_is_one_sentence(sshd, keys, tmp_path, port):
    spec = dataclasses.replace(_spec(sshd.port, tmp_path / "none", keys), proxy_jump=f"root@bastion:{port}")
    with pytest.raises(UserError) as raised:
        _run_true(spec)
    assert str(raised.value) == (
        f"ssh box (root@127.0.0.1:{sshd.port}): ProxyJump 'root@bastion:{port}' has port {port!r}, not a port "
        "(1..65535 in ASCII digits); write it as [user@]host[:port], e.g. bastion:22"
    )
