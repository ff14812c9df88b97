"""EndpointSpec: host and port rules, tcp:// parsing, URL forms, loopback and routability."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from art_mega.errors import UserError
from art_mega.topology import EndpointSpec


@pytest.mark.parametrize("host", ["node-1", "gpu.example.com", "10.0.0.5", "::1", "fd00::5"])
def test_valid_hosts(host: str) -> None:
    assert EndpointSpec(host=host, port=22222).host == host


@pytest.mark.parametrize("host", ["", "a b", "http://node", "[::1]", "node:22", "-bad", "x\n"])
def test_invalid_hosts_name_the_value(host: str) -> None:
    with pytest.raises(ValidationError, match="must be a hostname") as info:
        EndpointSpec(host=host, port=1)
    assert info.value.errors()[0]["loc"] == ("host",)
    assert repr(host) in str(info.value)


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_port_bounds_pass(port: int) -> None:
    assert EndpointSpec(host="h", port=port).port == port


@pytest.mark.parametrize("port", [-1, 65536])
def test_port_bounds_fail(port: int) -> None:
    with pytest.raises(ValidationError) as info:
        EndpointSpec(host="h", port=port)
    assert info.value.errors()[0]["loc"] == ("port",)
    assert info.value.errors()[0]["input"] == port


def test_url_and_address_bracket_ipv6() -> None:
    v6 = EndpointSpec(host="::1", port=8000)
    assert v6.url == "http://[::1]:8000"
    assert v6.address == "tcp://[::1]:8000"
    v4 = EndpointSpec(host="10.0.0.5", port=8000)
    assert v4.url == "http://10.0.0.5:8000"
    assert v4.address == "tcp://10.0.0.5:8000"
    assert str(v4) == "tcp://10.0.0.5:8000"


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("tcp://10.0.0.5:22222", "10.0.0.5", 22222),
        ("tcp://node-1:1", "node-1", 1),
        ("TCP://node-1:65535", "node-1", 65535),
        ("tcp://[fd00::5]:8000", "fd00::5", 8000),
    ],
)
def test_parse_accepts(text: str, host: str, port: int) -> None:
    endpoint = EndpointSpec.parse(text)
    assert (endpoint.host, endpoint.port) == (host, port)
    assert EndpointSpec.parse(endpoint.address) == endpoint


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("http://node:1", "must start with tcp://"),
        ("node:1", "must start with tcp://"),
        ("tcp://node", "has no port"),
        ("tcp://node:", "not a number"),
        ("tcp://node:http", "not a number"),
        ("tcp://node:65536", "outside 0..65535"),
        ("tcp://:22", "empty host"),
        ("tcp://[]:22", "empty host"),
        ("tcp://fd00::5:22", "without brackets"),
        ("tcp://[fd00::5]22", r"\[IPV6\]:PORT"),
        ("tcp://no de:22", "must be a hostname"),
    ],
)
def test_parse_rejects_with_one_sentence_naming_the_value(text: str, reason: str) -> None:
    with pytest.raises(UserError, match=reason) as info:
        EndpointSpec.parse(text)
    message = str(info.value)
    assert repr(text) in message
    assert "\n" not in message
    assert message.endswith(".")


def test_fields_accept_an_address_string() -> None:
    assert EndpointSpec.model_validate("tcp://[::1]:9") == EndpointSpec(host="::1", port=9)
    with pytest.raises(ValidationError, match="has no port"):
        EndpointSpec.model_validate("tcp://node")


@pytest.mark.parametrize(
    ("host", "loopback", "routable"),
    [
        ("127.0.0.1", True, False),
        ("127.3.2.1", True, False),
        ("::1", True, False),
        ("::ffff:127.0.0.1", True, False),
        ("localhost", True, False),
        ("LOCALHOST", True, False),
        ("0.0.0.0", False, False),
        ("::", False, False),
        ("169.254.1.2", False, False),
        ("fe80::1", False, False),
        ("10.0.0.5", False, True),
        ("fd00::5", False, True),
        ("node-1", False, True),
        ("etcd.example.com", False, True),
    ],
)
def test_loopback_and_routable(host: str, loopback: bool, routable: bool) -> None:
    endpoint = EndpointSpec(host=host, port=2379)
    assert endpoint.is_loopback is loopback
    assert endpoint.is_routable is routable


def test_frozen_and_forbids_extra_fields() -> None:
    endpoint = EndpointSpec(host="h", port=1)
    with pytest.raises(ValidationError):
        endpoint.port = 2  # type: ignore[misc]
    with pytest.raises(ValidationError, match="scheme"):
        EndpointSpec(host="h", port=1, scheme="tcp")  # type: ignore[call-arg]
    assert hash(endpoint) == hash(EndpointSpec(host="h", port=1))
