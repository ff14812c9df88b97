"""`--host` and `--ssh-arg` values for `art-mega ssh`, resolved against the user's ssh config.

Pure parsing and resolution (no network): what to connect to, as whom, with which keys, through
which proxy, and which host keys to trust (`KnownHosts`: OpenSSH known_hosts files read, never
written). Interactive prompts are never an option.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from art_mega.errors import UserError


@dataclass(frozen=True)
class HostTarget:
    """One `--host [USER@]SSH_TARGET[=WORKER_HOST]` value."""

    text: str
    target: str
    user: str | None = None
    worker_host: str | None = None


def _strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _check_host_part(text: str, value: str, what: str) -> None:
    if not value or any(c.isspace() for c in value) or "/" in value or "@" in value:
        raise UserError(f"--host {text!r}: {what} {value!r} is not a host name or address")


def parse_host(text: str) -> HostTarget:
    """Parse `[USER@]SSH_TARGET[=WORKER_HOST]`.

    Raises:
        UserError: an empty part, whitespace, or a malformed user or host.
    """
    raw = text.strip()
    if not raw:
        raise UserError("--host '' is empty; use [USER@]SSH_TARGET[=WORKER_HOST]")
    target_part, sep, worker = raw.partition("=")
    if sep and not worker:
        raise UserError(f"--host {text!r}: WORKER_HOST after '=' is empty; drop '=' or name the host")
    user = None
    if "@" in target_part:
        user, _, target_part = target_part.rpartition("@")
        if not user:
            raise UserError(f"--host {text!r}: the user before '@' is empty")
    target = _strip_brackets(target_part)
    _check_host_part(text, target, "SSH_TARGET")
    worker_host = _strip_brackets(worker) if worker else None
    if worker_host is not None:
        _check_host_part(text, worker_host, "WORKER_HOST")
    return HostTarget(text=text, target=target, user=user, worker_host=worker_host)


@dataclass(frozen=True)
class SshOptions:
    """Options from `--ssh-arg` (a subset of OpenSSH's: -F, -i, -p, -l, -J, -o KEY=VALUE)."""

    config_file: str | None = None
    identity_files: tuple[str, ...] = ()
    port: int | None = None
    user: str | None = None
    proxy_jump: str | None = None
    options: tuple[tuple[str, str], ...] = ()


_WITH_VALUE = {"-F", "-i", "-p", "-l", "-J", "-o"}
HONOURED_OPTIONS = {
    "hostname",
    "user",
    "port",
    "identityfile",
    "identitiesonly",
    "userknownhostsfile",
    "stricthostkeychecking",
    "proxycommand",
    "proxyjump",
    "connecttimeout",
}
"""ssh config keys `resolve` reads; an `-o` naming any other key would be silently ignored."""


def parse_ssh_args(args: list[str]) -> SshOptions:
    """Parse `--ssh-arg` values; each may hold one or more words (`-F cfg` or `-F`, `cfg`).

    Raises:
        UserError: an option we do not support, a missing value, or a bad port.
    """
    words: list[str] = []
    for arg in args:
        try:
            words.extend(shlex.split(arg))
        except ValueError as exc:
            raise UserError(f"--ssh-arg {arg!r}: {exc}; quote it like a shell word") from None
    config_file = port = user = jump = None
    identities: list[str] = []
    options: list[tuple[str, str]] = []
    i = 0
    while i < len(words):
        word = words[i]
        flag, value = word[:2], word[2:]
        if flag not in _WITH_VALUE:
            raise UserError(
                f"--ssh-arg {word!r} is not supported; use -F FILE, -i KEY, -p PORT, -l USER, -J JUMP or -o KEY=VALUE"
            )
        if not value:
            i += 1
            if i >= len(words):
                raise UserError(f"--ssh-arg {flag} needs a value")
            value = words[i]
        if flag == "-F":
            config_file = value
        elif flag == "-i":
            identities.append(value)
        elif flag == "-p":
            if not (value.isascii() and value.isdigit()) or not 0 < int(value) < 65536:
                raise UserError(f"--ssh-arg -p {value!r} is not a port (1..65535)")
            port = int(value)
        elif flag == "-l":
            user = value
        elif flag == "-J":
            jump = value
        else:
            key, sep, val = value.partition("=")
            if not sep:
                key, _, val = value.partition(" ")
            if not key or not val:
                raise UserError(f"--ssh-arg -o {value!r} must be KEY=VALUE")
            if key.strip().lower() not in HONOURED_OPTIONS:
                raise UserError(
                    f"--ssh-arg -o {key.strip()} is not honoured by art-mega's SSH client; use one of "
                    f"{', '.join(sorted(HONOURED_OPTIONS))}"
                )
            options.append((key.strip().lower(), val.strip()))
        i += 1
    return SshOptions(config_file, tuple(identities), port, user, jump, tuple(options))


@dataclass(frozen=True)
class ConnectSpec:
    """Everything needed to open one SSH connection without asking anyone anything."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    proxy_command: str | None = None
    proxy_jump: str | None = None
    known_hosts_files: tuple[str, ...] = ()
    strict_host_key_checking: str = "yes"
    connect_timeout_s: float = 10.0
    options: SshOptions = field(default_factory=SshOptions)


def _load_config(options: SshOptions):  # type: ignore[no-untyped-def]
    import paramiko

    path = options.config_file or os.path.expanduser("~/.ssh/config")
    if options.config_file and not Path(path).is_file():
        raise UserError(f"--ssh-arg -F {path}: no such ssh config file")
    if Path(path).is_file():
        return paramiko.SSHConfig.from_path(path)
    return paramiko.SSHConfig()


def resolve(alias: str, user: str | None, options: SshOptions) -> ConnectSpec:
    """Resolve `alias` through the ssh config, then apply `--ssh-arg` and `USER@` on top.

    Raises:
        UserError: a missing `-F` file, a bad Port, or an unreadable identity file.
    """
    found = dict(_load_config(options).lookup(alias))
    for key, value in options.options:
        found[key] = value
    hostname = found.get("hostname", alias)
    port_text = str(options.port or found.get("port", 22))
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise UserError(
            f"ssh config for {alias}: Port {port_text!r} is not a port (1..65535 in ASCII digits)"
        )
    port = int(port_text)
    chosen_user = user or options.user or found.get("user") or os.environ.get("USER") or "root"
    identities = list(options.identity_files) + list(found.get("identityfile", []))
    identities = [os.path.expanduser(p) for p in identities]
    for path in options.identity_files:
        if not Path(os.path.expanduser(path)).is_file():
            raise UserError(f"--ssh-arg -i {path}: no such key file")
    known = [os.path.expanduser("~/.ssh/known_hosts")]
    extra = found.get("userknownhostsfile")
    if extra:
        known.extend(os.path.expanduser(p) for p in str(extra).split())
    timeout_text = str(found.get("connecttimeout", 10))
    if not (timeout_text.isascii() and timeout_text.isdigit()) or int(timeout_text) == 0:
        raise UserError(
            f"ssh config for {alias}: ConnectTimeout {timeout_text!r} is not a positive whole number of "
            "seconds in ASCII digits (as OpenSSH takes it); give e.g. ConnectTimeout=10"
        )
    timeout = float(timeout_text)
    return ConnectSpec(
        alias=alias,
        hostname=hostname,
        port=port,
        user=chosen_user,
        identity_files=tuple(dict.fromkeys(identities)),
        identities_only=str(found.get("identitiesonly", "no")).lower() == "yes",
        proxy_command=found.get("proxycommand")
        if str(found.get("proxycommand", "")).lower() != "none"
        else None,
        proxy_jump=options.proxy_jump or found.get("proxyjump"),
        known_hosts_files=tuple(dict.fromkeys(known)),
        strict_host_key_checking=str(found.get("stricthostkeychecking", "yes")).lower(),
        connect_timeout_s=timeout,
        options=options,
    )


def worker_host_for(target: HostTarget, spec: ConnectSpec) -> str:
    """The address the agent binds: `=WORKER_HOST` if given, else the SSH target's host name."""
    return target.worker_host or spec.hostname


REVOKED = "@revoked"
CERT_AUTHORITY = "@cert-authority"


@dataclass(frozen=True)
class KnownHostLine:
    """One usable line of a known_hosts file.

    `marker` is "" (a host key), `REVOKED` (a key never to accept) or `CERT_AUTHORITY` (a CA
    whose host certificates are trusted); `patterns` are the comma-separated host patterns
    (`*`/`?` globs, `!` negations, `[host]:port`, hashed `|1|salt|hash`); `key_blob` is the key's
    decoded SSH wire form.
    """

    path: str
    lineno: int
    marker: str
    patterns: tuple[str, ...]
    key_type: str
    key_blob: bytes

    @property
    def where(self) -> str:
        return f"{self.path} line {self.lineno}"


def _glob(pattern: str, name: str) -> bool:
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, flags=re.IGNORECASE) is not None


def _hashed_match(pattern: str, name: str) -> bool:
    """`|1|base64(salt)|base64(HMAC-SHA1(salt, name))`, as `ssh-keygen -H` writes it."""
    _, _, salt_b64, digest_b64 = (pattern.split("|") + ["", "", "", ""])[:4]
    try:
        salt, digest = base64.b64decode(salt_b64), base64.b64decode(digest_b64)
    except binascii.Error:
        return False
    return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest)


def host_matches(patterns: tuple[str, ...], name: str) -> bool:
    """OpenSSH's rule: no negated pattern matches `name` and at least one plain pattern does."""
    matched = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        bare = pattern[1:] if negated else pattern
        hit = _hashed_match(bare, name) if bare.startswith("|1|") else _glob(bare, name)
        if hit and negated:
            return False
        matched = matched or hit
    return matched


def lookup_name(hostname: str, port: int) -> str:
    """The name known_hosts lists a host under: `HOST` on port 22, else `[HOST]:PORT`."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def _parse_line(path: str, lineno: int, text: str) -> KnownHostLine | None:
    fields = text.split()
    marker = ""
    if fields and fields[0].startswith("@"):
        marker, fields = fields[0], fields[1:]
        if marker not in (REVOKED, CERT_AUTHORITY):
            return None
    if len(fields) < 3:
        return None
    try:
        blob = base64.b64decode(fields[2], validate=True)
    except binascii.Error:
        return None
    return KnownHostLine(path, lineno, marker, tuple(fields[0].split(",")), fields[1], blob)


@dataclass(frozen=True)
class KnownHosts:
    """The known_hosts lines of some files, read once; nothing here ever writes a file.

    Blank lines, comments and lines OpenSSH would also skip (too few fields, a key that is not
    base64, an unknown `@` marker) are not kept.
    """

    lines: tuple[KnownHostLine, ...] = ()

    @classmethod
    def load(cls, paths: tuple[str, ...]) -> KnownHosts:
        """Read every file of `paths` that exists (a missing one adds nothing).

        Raises:
            UserError: a file that exists but cannot be read, or is not UTF-8 text.
        """
        lines: list[KnownHostLine] = []
        for path in paths:
            try:
                text = Path(path).read_text()
            except FileNotFoundError:
                continue
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or "not a UTF-8 text file"
                raise UserError(
                    f"known_hosts file {path} cannot be read ({reason}); fix or remove it"
                ) from None
            for lineno, raw in enumerate(text.splitlines(), 1):
                stripped = raw.strip()
                if stripped and not stripped.startswith("#"):
                    line = _parse_line(path, lineno, stripped)
                    if line is not None:
                        lines.append(line)
        return cls(tuple(lines))

    def for_host(self, name: str, marker: str = "") -> tuple[KnownHostLine, ...]:
        """The lines with `marker` whose patterns match the host's lookup name `name`."""
        return tuple(
            line for line in self.lines if line.marker == marker and host_matches(line.patterns, name)
        )

    def revoked(self, name: str, key_blob: bytes) -> KnownHostLine | None:
        """The `@revoked` line that refuses this key for host `name`, if any."""
        return next((line for line in self.for_host(name, REVOKED) if line.key_blob == key_blob), None)
