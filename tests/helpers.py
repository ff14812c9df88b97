"""Builders shared by tests (importable as `helpers`)."""

from __future__ import annotations

from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, compile_topology


def loopback_cluster(n: int, cpu_slots: int = 1, tmp: str = "/tmp/art-mega-test", **kw) -> ClusterSpec:
    """A cluster of `n` hosts on 127.0.0.(i+1), port 0 (each agent picks a free port)."""
    hosts = tuple(
        HostSpec(
            host_id=f"host{i}",
            node_rank=i,
            worker_address=EndpointSpec(host=f"127.0.0.{i + 1}", port=0),
            cpu_slots=cpu_slots,
        )
        for i in range(n)
    )
    return ClusterSpec(
        hosts=hosts,
        controller_host_id="host0",
        artifact_root=f"{tmp}/artifacts",
        cache_root=f"{tmp}/cache",
        allow_shared_kernel=True,
        **kw,
    )


def loopback_topology(n: int, cpu_slots: int = 1, **kw):
    return compile_topology(loopback_cluster(n, cpu_slots, **kw))
