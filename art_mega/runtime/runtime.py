"""ArtRuntime: connects to (or starts) the agents of a compiled topology and sequences services.

`start` only sequences: connect and check every agent, then hand out services (rollout
executors now; admission, FS probe, etcd, preflight, trainer and replicas as they land).
`close` undoes everything it started, in reverse order, each step bounded by rpc_timeout_s.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from art_mega.errors import UserError
from art_mega.runtime.client import AgentClient, AgentError
from art_mega.runtime.executor import RolloutExecutor, start_executor
from art_mega.runtime.local_agent import LocalAgent, start_local_agent
from art_mega.runtime.monitor import AgentMonitor, HostLostError
from art_mega.runtime.preflight import CollectiveReport
from art_mega.runtime.protocol import HealthResponse, HostFacts
from art_mega.topology import CompiledTopology, EndpointSpec


@dataclass(frozen=True)
class PreflightReport:
    """What the cluster proof measured: seconds per phase, the metadata store's URL if any."""

    phases_s: dict[str, float] = field(default_factory=dict)
    metadata_store: str | None = None
    collective: CollectiveReport | None = None


class LaunchInfo(Protocol):
    """What the runtime needs from a launch context (see `art_mega.launch.ArtLaunchContext`)."""

    @property
    def worker_addresses(self) -> tuple[str, ...]: ...

    @property
    def launch_id(self) -> str: ...

    @property
    def sys_path(self) -> tuple[str, ...]: ...

    def _secret_bytes(self) -> bytes: ...


class ArtRuntime:
    """The running services of one launch over a compiled topology. Use `start` or `start_local`."""

    def __init__(
        self,
        topology: CompiledTopology,
        clients: dict[str, AgentClient],
        launch_id: str,
        sys_path: tuple[str, ...] = (),
        owned_agents: Sequence[LocalAgent] = (),
    ) -> None:
        self.topology = topology
        self.launch_id = launch_id
        self._clients = clients
        self._sys_path = sys_path
        self._owned_agents = list(owned_agents)
        self._executors: list[RolloutExecutor] = []
        self._monitor: AgentMonitor | None = None
        self._closed = False
        self.lost: HostLostError | None = None
        self._etcd_host: str | None = None
        self._etcd_endpoint: str | None = None
        self.host_facts: dict[str, HostFacts] = {}
        self.preflight: PreflightReport | None = None

    @property
    def clients(self) -> dict[str, AgentClient]:
        """The signed client of every host's agent, by host id."""
        return dict(self._clients)

    @property
    def rpc_timeout_s(self) -> float:
        return self.topology.cluster.rpc_timeout_s

    @classmethod
    async def start(
        cls,
        launch: LaunchInfo,
        topology: CompiledTopology,
        *,
        metadata_store: bool | None = None,
        collective: bool | None = None,
    ) -> ArtRuntime:
        """Attach to the launch's agents, then prove the cluster before anything is allocated.

        Proof, in order (see `prove`): every agent answers with this launch's id; host admission;
        the artifact_root probe; the metadata store when needed (`metadata_store=None`: when
        artifact_root is host-local on several hosts or an explicit store is configured); the
        preflight collective when needed (`collective=None`: when trainer ranks or a replica span
        two or more hosts; True runs it over every host).

        Raises:
            UserError: the topology's worker addresses are not the launch's (names both).
            PreflightError: a proof failed; the message names the host and the cause.
            AgentError: an agent does not answer or belongs to another launch.
        """
        hosts = topology.cluster.hosts
        wanted = tuple(h.worker_address.address for h in hosts)
        given = tuple(EndpointSpec.parse(a).address for a in launch.worker_addresses)
        if sorted(wanted) != sorted(given):
            raise UserError(
                f"ClusterSpec.hosts worker addresses {list(wanted)} differ from the launch's workers "
                f"{list(given)}; build the cluster with launch.homogeneous_cluster(...) or the same addresses"
            )
        secret = launch._secret_bytes()
        timeout = topology.cluster.rpc_timeout_s
        clients = {
            h.host_id: AgentClient(h.host_id, h.worker_address.address, h.worker_address.url, secret, timeout)
            for h in hosts
        }
        runtime = cls(topology, clients, launch.launch_id, tuple(launch.sys_path))
        register = getattr(launch, "_register", None)
        if register is not None:
            register(runtime)
        try:
            await runtime._check_agents()
            await runtime.prove(metadata_store, collective)
        except BaseException:
            await runtime.close()
            raise
        return runtime

    @classmethod
    async def start_local(
        cls,
        topology: CompiledTopology,
        sys_path: Sequence[str] = (),
        *,
        metadata_store: bool | None = None,
        collective: bool | None = None,
    ) -> ArtRuntime:
        """Start one agent per host of `topology` on this machine, then attach to them.

        Every host's worker address must be a loopback address (127.0.0.0/8 or ::1); port 0
        picks a free port. The agents live until `close()` and are watched by heartbeats.

        Raises:
            UserError: a non-loopback worker address, or an address that already has a listener.
            AgentStartError: an agent did not become ready within startup_timeout_s seconds.
        """
        cluster = topology.cluster
        for host in cluster.hosts:
            if not host.worker_address.is_loopback:
                raise UserError(
                    f"host {host.host_id} worker_address {host.worker_address.address} is not loopback; "
                    "start_local only starts agents on this machine (use 127.0.0.x)"
                )
        launch_id = secrets.token_hex(8)
        secret = secrets.token_hex(32).encode()
        started = await asyncio.gather(
            *(
                start_local_agent(h.host_id, h.worker_address, launch_id, secret, cluster.startup_timeout_s)
                for h in cluster.hosts
            ),
            return_exceptions=True,
        )
        agents = [a for a in started if isinstance(a, LocalAgent)]
        errors = [a for a in started if isinstance(a, BaseException)]
        if errors:
            await asyncio.gather(*(a.stop(2.0) for a in agents))
            raise errors[0]
        clients = {
            a.host_id: AgentClient(
                a.host_id, a.endpoint.address, a.endpoint.url, secret, cluster.rpc_timeout_s
            )
            for a in agents
        }
        runtime = cls(topology, clients, launch_id, tuple(sys_path), owned_agents=agents)
        expected = {a.host_id: (launch_id, a.pid) for a in agents}
        runtime._monitor = AgentMonitor(list(clients.values()), expected, runtime._on_lost)
        runtime._monitor.start()
        try:
            await runtime.prove(metadata_store, collective)
        except BaseException:
            await runtime.close()
            raise
        return runtime

    def needs_metadata_store(self, requested: bool | None) -> bool:
        """Whether a metadata store is part of this runtime (see `start`)."""
        cluster = self.topology.cluster
        if requested is not None:
            return requested
        if cluster.nixl_transport.metadata_store is not None:
            return True
        return not cluster.shared_artifact_root and len(cluster.hosts) > 1

    def collective_hosts(self, requested: bool | None) -> tuple[str, ...]:
        """Hosts of the preflight collective, in node order (empty: no collective)."""
        topology = self.topology
        if requested is False:
            return ()
        if requested:
            return topology.cluster.host_ids
        spanning = {r.host_id for r in topology.trainer_ranks}
        if len(spanning) < 2:
            spanning = set()
        for replica in topology.replicas:
            if len(replica.host_ids) > 1:
                spanning.update(replica.host_ids)
        return tuple(h for h in topology.cluster.host_ids if h in spanning)

    async def prove(
        self, metadata_store: bool | None = None, collective: bool | None = None
    ) -> PreflightReport:
        """Admission, artifact_root probe, metadata store, collective; results in `self.preflight`.

        A proof that fails stops the warm preflight probes it started (each holds torch in memory
        and would otherwise wait `preflight_probe.WARM_IDLE_S` seconds on its agent). Proving
        again (e.g. after a host was replaced) re-checks the managed etcd this runtime started
        from every host instead of starting a second one; `close` stops it.
        """
        self._check_usable()
        hosts_in_collective = self.collective_hosts(collective)
        warm_hosts = hosts_in_collective if len(hosts_in_collective) > 1 else ()
        # Warm probes import torch while admission, the FS probe and etcd run (a failed prepare
        # only means that host's probe starts cold).
        warming = asyncio.gather(
            *(self._clients[h].preflight_prepare() for h in warm_hosts), return_exceptions=True
        )
        try:
            return await self._prove(metadata_store, hosts_in_collective, warming)
        except BaseException:
            await warming  # no probe may start after the discard
            await asyncio.gather(
                *(self._clients[h].preflight_discard() for h in warm_hosts), return_exceptions=True
            )
            raise

    async def _prove(
        self, metadata_store: bool | None, hosts_in_collective: tuple[str, ...], warming: asyncio.Future
    ) -> PreflightReport:
        from art_mega.runtime.admission import admit
        from art_mega.runtime.etcd import check_from_every_host, start_metadata_store
        from art_mega.runtime.fs_probe import probe_artifact_root
        from art_mega.runtime.preflight import run_collective

        loop = asyncio.get_running_loop()
        cluster = self.topology.cluster
        phases: dict[str, float] = {}
        started = loop.time()
        hosts = list(self._clients)
        facts = await asyncio.gather(*(self._clients[h].facts() for h in hosts))
        self.host_facts = dict(zip(hosts, facts))
        admit(self.topology, self.host_facts)
        phases["admission"] = loop.time() - started
        phases["fs_probe"] = await probe_artifact_root(
            self._clients,
            cluster.artifact_root,
            cluster.shared_artifact_root,
            cluster.controller_host_id,
            self.launch_id,
        )
        endpoint = None
        if self.needs_metadata_store(metadata_store):
            started = loop.time()
            explicit = cluster.nixl_transport.metadata_store
            if explicit is not None:
                endpoint = explicit.url
                await check_from_every_host(self._clients, endpoint, self.launch_id)
            else:
                endpoint = await self._recheck_managed_etcd()
            if endpoint is None:
                controller = cluster.controller
                reply = await start_metadata_store(
                    self._clients,
                    controller.host_id,
                    controller.worker_address.host,
                    self.launch_id,
                    timeout_s=cluster.startup_timeout_s,
                )
                self._etcd_host, self._etcd_endpoint = controller.host_id, reply.endpoint
                endpoint = reply.endpoint
            phases["metadata_store"] = loop.time() - started
        report = None
        await warming
        if len(hosts_in_collective) > 1:
            first = cluster.host(hosts_in_collective[0])
            on_gpu = (
                all(cluster.host(h).gpu_ids for h in hosts_in_collective)
                and cluster.nccl_transport is not None
            )
            report = await run_collective(
                self._clients,
                hosts_in_collective,
                first.worker_address.host,
                cluster.startup_timeout_s,
                backend="nccl" if on_gpu else "gloo",
                nccl_net=cluster.nccl_transport.net_name if cluster.nccl_transport else None,
                log_dir=cluster.artifact_root,
            )
            phases["collective"] = report.seconds
        self.preflight = PreflightReport(phases_s=phases, metadata_store=endpoint, collective=report)
        return self.preflight

    async def _recheck_managed_etcd(self) -> str | None:
        """On a proof again: this runtime's managed etcd, checked from every host, or None when
        there is none or it no longer serves (then it is stopped, and the caller starts another)."""
        from art_mega.runtime.etcd import check_from_every_host
        from art_mega.runtime.preflight import PreflightError

        if self._etcd_endpoint is None:
            return None
        try:
            await check_from_every_host(self._clients, self._etcd_endpoint, self.launch_id)
            return self._etcd_endpoint
        except PreflightError:
            host, self._etcd_host, self._etcd_endpoint = self._etcd_host, None, None
            if host is not None:
                await self._clients[host].etcd_stop()
            return None

    def _on_lost(self, exc: HostLostError) -> None:
        self.lost = exc

    async def _check_agents(self) -> None:
        replies = await asyncio.gather(*(c.health() for c in self._clients.values()))
        for client, health in zip(self._clients.values(), replies):
            if health.launch_id != self.launch_id:
                raise AgentError(
                    client.host,
                    client.address,
                    f"the agent there belongs to launch {health.launch_id}, not {self.launch_id}",
                )

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this ArtRuntime is closed")
        if self.lost is not None:
            raise self.lost

    async def health(self) -> dict[str, HealthResponse]:
        """Signed health of every agent, by host id. Raises `AgentError` naming a silent host."""
        self._check_usable()
        replies = await asyncio.gather(*(c.health() for c in self._clients.values()))
        return dict(zip(self._clients, replies))

    async def rollout_executor(
        self,
        callables: Callable[..., Any] | Sequence[Callable[..., Any]],
        target_workers: int | None = None,
    ) -> RolloutExecutor:
        """Start rollout worker processes on the topology's rollout hosts.

        Args:
            callables: the async rollout function(s) workers must import and hash-check before
                they count as started; other top-level async functions can still be run later.
            target_workers: total worker processes, spread round-robin over the rollout hosts up
                to each host's cpu_slots; None = every slot.

        Raises:
            UserError: a lambda, closure or non-async callable; target_workers out of range; a
                worker refused the callable (its module cannot be imported or changed since hashed).
        """
        self._check_usable()
        fns = [callables] if callable(callables) else list(callables)
        slots = [(h, self.topology.cluster.host(h).cpu_slots) for h in self.topology.rollout_host_ids]
        executor = await start_executor(self._clients, slots, fns, target_workers, self._sys_path)
        self._executors.append(executor)
        return executor

    async def close(self) -> None:
        """Stop what this runtime started, in reverse order; idempotent; each step bounded."""
        if self._closed:
            return
        self._closed = True
        timeout = self.rpc_timeout_s
        if self._monitor is not None:
            await self._monitor.stop()
        for executor in reversed(self._executors):
            await executor.close(timeout)
        if self._etcd_host is not None and self._etcd_host in self._clients:
            try:
                await asyncio.wait_for(self._clients[self._etcd_host].etcd_stop(), timeout)
            except (TimeoutError, AgentError):
                pass
        if self._owned_agents:
            by_host = {a.host_id: a for a in self._owned_agents}

            async def shut(client: AgentClient) -> None:
                try:
                    await client.shutdown(timeout_s=timeout)
                except AgentError:
                    pass
                await by_host[client.host].stop(grace_s=min(timeout, 5.0))

            await asyncio.gather(*(shut(self._clients[h]) for h in by_host if h in self._clients))
        await asyncio.gather(*(c.aclose() for c in self._clients.values()), return_exceptions=True)

    async def __aenter__(self) -> ArtRuntime:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
