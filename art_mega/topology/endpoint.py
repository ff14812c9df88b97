"""A TCP endpoint (host and port) and the `tcp://HOST:PORT` form users write it in.

Knows whether an address is loopback or routable, which decides what other hosts can reach.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from pydantic import field_validator, model_validator

from art_mega.errors import UserError
from art_mega.topology.base import Port, SpecModel

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")
_EXAMPLE = "write it as tcp://HOST:PORT, e.g. tcp://10.0.0.5:22222 or tcp://[fd00::5]:22222"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _split_address(text: str) -> tuple[str, int]:
    """Split `tcp://HOST:PORT` (IPv6 in brackets) into host and port; `ValueError` otherwise."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() != "tcp":
        raise ValueError(f"address {text!r} must start with tcp://; {_EXAMPLE}")
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or not tail.startswith(":"):
            raise ValueError(f"address {text!r} needs [IPV6]:PORT after tcp://; {_EXAMPLE}")
        port_text = tail[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            raise ValueError(f"address {text!r} has no port; {_EXAMPLE}")
        if ":" in host:
            raise ValueError(f"address {text!r} has an IPv6 host without brackets; {_EXAMPLE}")
    if not host:
        raise ValueError(f"address {text!r} has an empty host; {_EXAMPLE}")
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"address {text!r} has port {port_text!r}, not a number; {_EXAMPLE}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"address {text!r} has port {port}, outside 0..65535; {_EXAMPLE}")
    return host, port


class EndpointSpec(SpecModel):
    """A TCP endpoint: `host` is a hostname or an IPv4/IPv6 literal (no brackets, no scheme).

    Accepts a `tcp://HOST:PORT` string wherever a model field expects an endpoint.
    Raises pydantic `ValidationError` for an empty host, whitespace, a scheme or a port outside
    0..65535.
    """

    host: str
    port: Port

    @model_validator(mode="before")
    @classmethod
    def _from_address(cls, data: Any) -> Any:
        if isinstance(data, str):
            host, port = _split_address(data)
            return {"host": host, "port": port}
        return data

    @field_validator("host")
    @classmethod
    def _check_host(cls, host: str) -> str:
        if _ip(host) is None and not _HOSTNAME.fullmatch(host):
            raise ValueError(
                f"host {host!r} must be a hostname or an IP address without scheme, port, "
                "brackets or whitespace, e.g. 'node-1' or '10.0.0.5'"
            )
        return host

    @classmethod
    def parse(cls, text: str) -> EndpointSpec:
        """Parse `tcp://HOST:PORT` or `tcp://[IPV6]:PORT`.

        Raises `UserError` (one sentence naming `text`) for a bad scheme, a missing or
        non-numeric port, a port outside 0..65535, an empty or malformed host.
        """
        try:
            host, port = _split_address(text)
        except ValueError as exc:
            raise UserError(f"{exc}.") from None
        try:
            return cls(host=host, port=port)
        except ValueError as exc:
            raise UserError(f"address {text!r} is invalid: {_first_message(exc)}.") from None

    @property
    def _bracketed_host(self) -> str:
        ip = _ip(self.host)
        return f"[{self.host}]" if ip is not None and ip.version == 6 else self.host

    @property
    def url(self) -> str:
        """`http://HOST:PORT`, IPv6 hosts in brackets (`http://[::1]:8000`)."""
        return f"http://{self._bracketed_host}:{self.port}"

    @property
    def address(self) -> str:
        """`tcp://HOST:PORT`, IPv6 hosts in brackets; `EndpointSpec.parse` reads it back."""
        return f"tcp://{self._bracketed_host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """True for 127.0.0.0/8, ::1 (also IPv4-mapped), `localhost` and `*.localhost`."""
        name = self.host.lower().rstrip(".")
        if name == "localhost" or name.endswith(".localhost"):
            return True
        ip = _ip(self.host)
        if ip is None:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback

    @property
    def is_routable(self) -> bool:
        """True if other hosts can reach it: not loopback, unspecified or link-local.

        Hostnames other than `localhost` count as routable (they are not resolved here).
        """
        if self.is_loopback:
            return False
        ip = _ip(self.host)
        if ip is None:
            return True
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return not (ip.is_unspecified or ip.is_link_local)

    def __str__(self) -> str:
        return self.address


def _first_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        items = errors(include_url=False)
        if items:
            return str(items[0].get("msg", exc)).removeprefix("Value error, ")
    return str(exc)
