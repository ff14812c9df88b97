import base64

import paramiko
import pytest

from art_mega.errors import UserError
from art_mega.launch.ssh import plan_hosts
from art_mega.launch.ssh_target import (
    KnownHosts,
    host_matches,
    lookup_name,
    parse_host,
    parse_ssh_args,
    resolve,
)


def test_parse_host_forms():
    assert parse_host("gpu-a").target == "gpu-a"
    h = parse_host("ubuntu@gpu-a=10.0.0.5")
    assert (h.user, h.target, h.worker_host) == ("ubuntu", "gpu-a", "10.0.0.5")
    assert parse_host("root@[fd00::1]=[fd00::1]").worker_host == "fd00::1"


@pytest.mark.parametrize(
    "value,message",
    [
        ("", "empty"),
        ("a=", "WORKER_HOST after '=' is empty"),
        ("@a", "user before '@' is empty"),
        ("a b", "not a host"),
    ],
)
def test_parse_host_errors(value, message):
    with pytest.raises(UserError, match=message):
        parse_host(value)


def test_parse_ssh_args_forms():
    opts = parse_ssh_args(
        ["-F", "/tmp/cfg", "-i /k1", "-ik2", "-p 2200", "-l bob", "-J jump", "-o StrictHostKeyChecking=no"]
    )
    assert opts.config_file == "/tmp/cfg"
    assert opts.identity_files == ("/k1", "k2")
    assert (opts.port, opts.user, opts.proxy_jump) == (2200, "bob", "jump")
    assert opts.options == (("stricthostkeychecking", "no"),)


@pytest.mark.parametrize(
    "args,message",
    [
        (["-X"], "not supported"),
        (["-p"], "needs a value"),
        (["-p", "0"], "not a port"),
        (["-o", "Foo"], "KEY=VALUE"),
    ],
)
def test_parse_ssh_args_errors(args, message):
    with pytest.raises(UserError, match=message):
        parse_ssh_args(args)


def test_resolve_uses_config_then_command_line(tmp_path):
    cfg = tmp_path / "cfg"
    key = tmp_path / "key"
    key.write_text("x")
    cfg.write_text(
        "Host node1\n  HostName 10.1.2.3\n  User alice\n  Port 2201\n  IdentityFile /id/a\n"
        "  UserKnownHostsFile /kh/a\n  ProxyJump bastion\n  IdentitiesOnly yes\n"
    )
    opts = parse_ssh_args(["-F", str(cfg)])
    spec = resolve("node1", None, opts)
    assert (spec.hostname, spec.user, spec.port) == ("10.1.2.3", "alice", 2201)
    assert spec.identity_files == ("/id/a",) and spec.identities_only
    assert "/kh/a" in spec.known_hosts_files and spec.proxy_jump == "bastion"
    spec = resolve("node1", "root", parse_ssh_args(["-F", str(cfg), "-p", "22", "-i", str(key)]))
    assert (spec.user, spec.port, spec.identity_files[0]) == ("root", 22, str(key))
    with pytest.raises(UserError, match="no such ssh config file"):
        resolve("node1", None, parse_ssh_args(["-F", str(tmp_path / "missing")]))
    with pytest.raises(UserError, match="no such key file"):
        resolve("node1", None, parse_ssh_args(["-F", str(cfg), "-i", "/no/key"]))


def test_plan_hosts_binds_the_target_host_unless_told(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.write_text("Host a\n  HostName 10.0.0.1\nHost b\n  HostName 10.0.0.2\n")
    hosts = plan_hosts(["a", "b=10.9.9.9"], ["-F", str(cfg)], 22222)
    assert [h.endpoint.address for h in hosts] == ["tcp://10.0.0.1:22222", "tcp://10.9.9.9:22222"]
    with pytest.raises(UserError, match="SSH targets must be unique"):
        plan_hosts(["a", "a=10.0.0.3"], ["-F", str(cfg)], 22222)
    with pytest.raises(UserError, match="worker hosts must be unique"):
        plan_hosts(["a", "b=10.0.0.1"], ["-F", str(cfg)], 22222)
    with pytest.raises(UserError, match="--host is required"):
        plan_hosts([], [], 22222)
    with pytest.raises(UserError, match="--port 0"):
        plan_hosts(["a"], [], 0)


def test_unbalanced_quote_in_ssh_arg():
    with pytest.raises(UserError, match="No closing quotation; quote it like a shell word"):
        parse_ssh_args(['-F "unterminated'])


def test_unhonoured_ssh_options_are_refused_before_connecting():
    with pytest.raises(UserError, match="-o ForwardAgent is not honoured"):
        parse_ssh_args(["-o ForwardAgent=yes"])
    assert parse_ssh_args(["-o", "ConnectTimeout=3"]).options == (("connecttimeout", "3"),)


def test_known_hosts_lines_read_back(tmp_path):
    assert (lookup_name("gpu-a", 22), lookup_name("10.0.0.5", 2222)) == ("gpu-a", "[10.0.0.5]:2222")
    blob = base64.b64encode(b"\x00\x00\x00\x0bssh-ed25519").decode()
    path = tmp_path / "kh"
    path.write_text(f"a,b ssh-ed25519 {blob}\n@revoked c ssh-ed25519 {blob}\n@other d ssh-ed25519 {blob}\n")
    known = KnownHosts.load((str(path), str(tmp_path / "absent")))
    assert [(line.marker, line.patterns, line.lineno) for line in known.lines] == [
        ("", ("a", "b"), 1),
        ("@revoked", ("c",), 2),
    ]
    assert known.revoked("c", base64.b64decode(blob)) is known.lines[1]
    assert known.revoked("a", base64.b64decode(blob)) is None
    assert host_matches(("*.Example.com",), "gpu.example.COM") and not host_matches(
        ("*.example.com",), "example.com"
    )
    assert not host_matches(("10.0.0.*", "!10.0.0.5"), "10.0.0.5") and host_matches(("10.0.0.*",), "10.0.0.5")
    hashed = paramiko.HostKeys.hash_host("[gpu-a]:2222")  # as `ssh-keygen -H` writes a name
    assert host_matches((hashed,), "[gpu-a]:2222") and not host_matches((hashed,), "gpu-a")
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(
        UserError, match=f"known_hosts file {path} cannot be read \\(not a UTF-8 text file\\)"
    ):
        KnownHosts.load((str(path),))
