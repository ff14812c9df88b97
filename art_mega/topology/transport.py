"""How hosts move tensors to each other: the NCCL network for collectives and NIXL for transfers.

Pure declarations; `compile_topology` decides when a transport is required or refused.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from art_mega.topology.base import SpecModel, check_identifier
from art_mega.topology.endpoint import EndpointSpec


def _check_env_text(value: str, what: str) -> str:
    if not value or value != value.strip() or any(c in value for c in "\x00\r\n"):
        raise ValueError(
            f"{what} {value!r} must be non-empty, with no surrounding whitespace, NUL or line breaks"
        )
    return value


class NcclTransportSpec(SpecModel):
    """The NCCL network between hosts, exported to GPU processes as `NCCL_NET`.

    `net_name` is the NCCL net plugin name (e.g. "IB", or an AWS OFI plugin name).
    `socket_ifname`, when set, becomes `NCCL_SOCKET_IFNAME` (the bootstrap interface).
    "Socket" is accepted here but `compile_topology` refuses it for multi-host GPU work, where
    TCP sockets are far too slow for gradient and weight traffic.
    """

    net_name: str
    socket_ifname: str | None = None

    @field_validator("net_name")
    @classmethod
    def _check_net_name(cls, value: str) -> str:
        return _check_env_text(value, "net_name")

    @field_validator("socket_ifname")
    @classmethod
    def _check_ifname(cls, value: str | None) -> str | None:
        return None if value is None else _check_env_text(value, "socket_ifname")

    @property
    def is_socket(self) -> bool:
        """True when NCCL would fall back to plain TCP sockets."""
        return self.net_name.lower() == "socket"


class NixlTransportSpec(SpecModel):
    """NIXL transfers between hosts and the etcd store that holds NIXL's agent metadata.

    `metadata_store` None means art-mega runs a managed etcd on the controller host; an explicit
    store must be routable from every host (not loopback, unspecified or link-local), else a
    `ValidationError`. `backend` is the NIXL backend plugin name (default "UCX").
    """

    metadata_store: EndpointSpec | None = None
    backend: str = Field(default="UCX")

    @field_validator("metadata_store")
    @classmethod
    def _check_store(cls, store: EndpointSpec | None) -> EndpointSpec | None:
        if store is not None and store.port == 0:
            raise ValueError(
                f"metadata_store {store.address!r} has port 0, which no server listens on; give etcd's "
                "client port, e.g. tcp://10.0.0.9:2379, or None for a managed etcd"
            )
        if store is not None and not store.is_routable:
            raise ValueError(
                f"metadata_store {store.address!r} is not reachable from other hosts "
                "(loopback, unspecified or link-local); give a routable address or None for "
                "a managed etcd"
            )
        return store

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        return check_identifier(value, "backend")
