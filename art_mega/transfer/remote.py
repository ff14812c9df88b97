"""Getting each step's adapter to replicas whose host cannot read the exporter's artifact_root.

With `ClusterSpec.shared_artifact_root=False`, trainer rank 0's host (the exporter) offers the
adapter through its agent (bytes registered with NIXL, metadata in the launch's etcd); every
other host that runs a replica fetches it through its own agent with one UCX READ, writes it to
a new path under its own artifact_root and checks every file's sha256 before answering. Replicas
on the exporter's host read the exported folder itself. Copies of steps that left the
publisher's keep window are deleted on their hosts (`AdapterTransport.prune`). See
`art_mega.transfer.nixl`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from art_mega.errors import AdapterTransferError, UserError
from art_mega.transfer.protocol import (
    ADAPTERS_FETCH,
    ADAPTERS_OFFER,
    ADAPTERS_PRUNE,
    ADAPTERS_RELEASE,
    COPY_MARKER,
    FetchRequest,
    FetchResponse,
    MetadataStore,
    OfferRequest,
    OfferResponse,
    PruneRequest,
    ReleaseRequest,
)

if TYPE_CHECKING:
    from art_mega.agent.client import AgentClient
    from art_mega.agent.routes import Req, Resp, Route

DEFAULT_TIMEOUT_S = 120.0
TRANSFER_METRIC = "time/adapter_transfer_s"

log = logging.getLogger(__name__)


@dataclass
class TransferReport:
    """One step's transfer: seconds to offer, seconds per receiving host (metadata, READ, write,
    fsync and sha256 check), bytes per host, and the wall time of the whole stage."""

    step: int
    transfer_id: str
    offer_s: float = 0.0
    fetch_s: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    total_s: float = 0.0


class AdapterTransport:
    """Stages one step's adapter on every replica host; `await transport(step, adapter_dir)`
    returns replica name -> the absolute path that replica loads (see `AdapterPublisher`).

    Args:
        clients: the agents' signed clients by host id.
        exporter_host: the host whose artifact_root holds the exported adapter.
        replica_hosts: replica name -> the host its server runs on.
        artifact_root: the (host-local) artifact_root, the same path on every host.
        store: NIXL's metadata store (the launch's etcd) and key prefix.
        timeout_s: bound on each agent's offer and fetch (seconds).
        files: the names (relative to the adapter folder) to send, e.g. a checkpoint's
            `checkpoint.ADAPTER_FILES`; None sends every file under it.
    """

    def __init__(
        self,
        clients: Mapping[str, AgentClient],
        exporter_host: str,
        replica_hosts: Mapping[str, str],
        artifact_root: str,
        store: MetadataStore,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        files: tuple[str, ...] | None = None,
    ) -> None:
        missing = sorted({h for h in [exporter_host, *replica_hosts.values()] if h not in clients})
        if missing:
            raise ValueError(f"no agent client for hosts {missing}")
        self.clients = clients
        self.exporter_host = exporter_host
        self.replica_hosts = dict(replica_hosts)
        self.artifact_root = artifact_root
        self.store = store
        self.timeout_s = timeout_s
        self.files = files
        self.last: TransferReport | None = None
        self._copies: dict[int, dict[str, list[str]]] = {}  # step -> host -> received copies

    @property
    def receiving_hosts(self) -> list[str]:
        """Hosts that get a copy: every replica host but the exporter, each once, sorted."""
        return sorted({h for h in self.replica_hosts.values() if h != self.exporter_host})

    async def _call(self, host: str, route: Route[Req, Resp], body: Req) -> Resp:
        # the agent's own bound covers NIXL; the HTTP bound adds a margin for file I/O
        return await self.clients[host].call(route, body, timeout_s=self.timeout_s + 30)

    async def __call__(self, step: int, adapter_dir: str | os.PathLike[str]) -> dict[str, str]:
        """Copy `adapter_dir` (absolute, under artifact_root on the exporter) to every other
        replica host as `<adapter_dir>.nixl-<transfer id>`; returns replica -> path to load.

        Raises:
            AdapterTransferError: the offer or a fetch failed (names the host and, for a
                sha256 mismatch, the file). Copies that did arrive stay on their hosts.
            AgentError: the exporter's agent did not answer the offer (or its NIXL process died).
        """
        source = os.fspath(adapter_dir)
        paths = {name: source for name, host in self.replica_hosts.items() if host == self.exporter_host}
        receivers = self.receiving_hosts
        if not receivers:
            return paths
        started = time.monotonic()
        transfer_id = f"step{step:04d}-{secrets.token_hex(6)}"
        report = TransferReport(step=step, transfer_id=transfer_id)
        offered: OfferResponse = await self._call(
            self.exporter_host,
            ADAPTERS_OFFER,
            OfferRequest(
                host=self.exporter_host,
                root=self.artifact_root,
                path=source,
                transfer_id=transfer_id,
                store=self.store,
                timeout_s=self.timeout_s,
                files=self.files,
            ),
        )
        if not offered.ok or offered.offer is None:
            raise AdapterTransferError(step, offered.error)
        report.offer_s = time.monotonic() - started
        dest = os.path.relpath(f"{source}{COPY_MARKER}{transfer_id}", self.artifact_root)
        try:
            replies: list[FetchResponse | BaseException] = await asyncio.gather(
                *(
                    self._call(
                        host,
                        ADAPTERS_FETCH,
                        FetchRequest(
                            host=host,
                            root=self.artifact_root,
                            dest=dest,
                            offer=offered.offer,
                            store=self.store,
                            timeout_s=self.timeout_s,
                        ),
                    )
                    for host in receivers
                ),
                return_exceptions=True,
            )
        finally:
            await self._release(transfer_id)
        errors = []
        received: dict[str, str] = {}
        for host, reply in zip(receivers, replies):
            if isinstance(reply, BaseException):
                errors.append(f"host {host}: {reply}")
            elif not reply.ok:
                errors.append(reply.error)
            else:
                received[host] = reply.path
                report.fetch_s[host], report.bytes[host] = reply.seconds, reply.bytes
                self._copies.setdefault(step, {}).setdefault(host, []).append(reply.path)
        if errors:
            raise AdapterTransferError(
                step, "the adapter did not reach every replica host: " + "; ".join(errors)
            )
        paths.update({name: received[host] for name, host in self.replica_hosts.items() if host in received})
        report.total_s = time.monotonic() - started
        self.last = report
        return paths

    def copies(self) -> dict[int, dict[str, list[str]]]:
        """Step -> receiving host -> the received copies not yet pruned (absolute paths)."""
        return {step: {h: list(p) for h, p in hosts.items()} for step, hosts in self._copies.items()}

    async def prune(self, keep: Collection[int]) -> dict[str, list[str]]:
        """Delete, on every receiving host, the copies of each step not in `keep` (the steps some
        replica may still load: the publisher's window and whatever a replica still holds), and
        each such copy's step folder when it is left empty. Returns host -> removed paths.

        Best effort: a host that refuses or does not answer is logged and its copies stay
        recorded, so the next `prune` tries again; nothing is raised.
        """
        doomed: dict[str, list[str]] = {}
        for step in sorted(set(self._copies) - set(keep)):
            for host, paths in self._copies[step].items():
                doomed.setdefault(host, []).extend(paths)
        if not doomed:
            return {}
        hosts = sorted(doomed)
        replies = await asyncio.gather(
            *(
                self._call(
                    host,
                    ADAPTERS_PRUNE,
                    PruneRequest(host=host, root=self.artifact_root, paths=tuple(doomed[host])),
                )
                for host in hosts
            ),
            return_exceptions=True,
        )
        removed: dict[str, list[str]] = {}
        for host, reply in zip(hosts, replies):
            if isinstance(reply, BaseException):
                log.warning("pruning adapter copies on host %s: %s", host, reply)
                continue
            if reply.error:
                log.warning("%s", reply.error)
            removed[host] = list(reply.removed)
        for step in sorted(set(self._copies) - set(keep)):
            left = {
                host: [p for p in paths if p not in removed.get(host, ())]
                for host, paths in self._copies[step].items()
            }
            self._copies[step] = {host: paths for host, paths in left.items() if paths}
            if not self._copies[step]:
                del self._copies[step]
        return removed

    async def _release(self, transfer_id: str) -> None:
        try:
            await self._call(self.exporter_host, ADAPTERS_RELEASE, ReleaseRequest(transfer_id=transfer_id))
        except Exception:  # the exporter's agent frees it at shutdown anyway
            pass


def adapter_transport_for(
    runtime: Any, timeout_s: float = DEFAULT_TIMEOUT_S, files: tuple[str, ...] | None = None
) -> AdapterTransport | None:
    """The transport a runtime's replicas need: None when artifact_root is shared (replicas read
    the exported folder) or every replica runs on trainer rank 0's host. `files`: see
    `AdapterTransport`.

    Raises:
        UserError: artifact_root is host-local and a replica runs on another host, but the
            runtime was started without a metadata store (`metadata_store=False`).
    """
    topology = runtime.topology
    cluster = topology.cluster
    if cluster.shared_artifact_root or not topology.trainer_ranks:
        return None
    exporter = topology.trainer_ranks[0].host_id
    replica_hosts = {r.process_name: r.host_ids[0] for r in topology.replicas}
    if all(h == exporter for h in replica_hosts.values()):
        return None
    endpoint = runtime.preflight.metadata_store if runtime.preflight is not None else None
    if endpoint is None:
        raise UserError(
            "ArtRuntime.start(metadata_store=False) leaves NIXL without a metadata store, but "
            "ClusterSpec.shared_artifact_root=False and replicas run off trainer rank 0's host "
            f"{exporter}; pass metadata_store=None (or True) so adapters can reach them"
        )
    store = MetadataStore(endpoint=endpoint, namespace=f"/art-mega/{runtime.launch_id}/nixl")
    return AdapterTransport(
        runtime.clients, exporter, replica_hosts, cluster.artifact_root, store, timeout_s, files
    )


def transfer_metrics(transport: AdapterTransport | None, step: int) -> dict[str, float]:
    """`{"time/adapter_transfer_s": seconds}` (the `TransferReport.total_s`: offer, every host's
    fetch, release) when `transport` carried `step`'s adapter to some host; {} otherwise (no
    transport, no receiving host, or the last transfer was of another step)."""
    report = transport.last if transport is not None else None
    if report is None or report.step != step:
        return {}
    return {TRANSFER_METRIC: report.total_s}
