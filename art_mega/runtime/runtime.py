"""ArtRuntime: connects to (or starts) the agents of a compiled topology and sequences services.

`start` only sequences: connect and check every agent, prove the cluster (the `Phase`s, in
order), then hand out services (rollout executors; the backend starts trainer and replicas).
`close` undoes everything it started, in reverse order, each step bounded by rpc_timeout_s.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from art_mega.agent.client import AgentClient
from art_mega.agent.protocol import HealthResponse
from art_mega.errors import AgentError, HostLostError, PreflightError, UserError
from art_mega.preflight.collective import CollectiveReport
from art_mega.preflight.protocol import (
    ETCD_STOP,
    FACTS,
    PREFLIGHT_DISCARD,
    PREFLIGHT_PREPARE,
    HostFacts,
    PreflightPrepareRequest,
)
from art_mega.rollouts.installed import InstalledAsyncCallable
from art_mega.rollouts.remote import RolloutExecutor
from art_mega.runtime.local_agent import LocalAgent, start_local_agent
from art_mega.runtime.monitor import AgentMonitor
from art_mega.runtime.open_ports import choose_ports_on_agents
from art_mega.topology import CompiledTopology, EndpointSpec


class Phase(enum.StrEnum):
    """The phases of the cluster proof (`ArtRuntime.prove`), in the order they run.

    Each value is the phase's name in `PreflightReport.phases_s` and in what is printed or
    recorded from it (benchmark figures, JSON): a `StrEnum`, so a member is equal to, hashes
    like and formats as that string.
    """

    ADMISSION = "admission"
    """Every agent's host facts read and checked against the topology (`preflight.admission`)."""
    FS_PROBE = "fs_probe"
    """artifact_root checked on every host: writable, and when shared, one host's file seen by
    every other (`preflight.fs_probe`)."""
    METADATA_STORE = "metadata_store"
    """The NIXL metadata store (etcd) started or checked from every host; only when needed."""
    COLLECTIVE = "collective"
    """The preflight collective in every environment that needs it (cached ones cost 0 s)."""


@dataclass(frozen=True)
class PreflightReport:
    """What the cluster proof measured: seconds per phase (only the phases that ran), the
    metadata store's URL if any, and the collective of every proved environment (`collective`:
    the trainer's, else the first)."""

    phases_s: dict[Phase, float] = field(default_factory=dict)
    metadata_store: str | None = None
    collective: CollectiveReport | None = None
    collectives: tuple[CollectiveReport, ...] = ()


@dataclass(frozen=True)
class ProofEnvironment:
    """One Python environment the preflight collective runs in, and the hosts (in node order)."""

    names: tuple[str, ...]
    """Whose it is: "trainer" and/or inference spec names (one environment can serve several)."""
    python: str | None
    """Its interpreter: None for each agent's own (the trainer's), else an `InferenceSpec.python`."""
    host_ids: tuple[str, ...]


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
        self._proved: dict[tuple[Any, ...], CollectiveReport] = {}
        """Passed collectives by (interpreter, hosts, backend, network, the hosts' facts)."""

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

        `launch` is ART's `launch.host_mesh` (the launch's agents) or the `ArtLaunchContext`
        itself; `topology` is `compile_topology(cluster=...)`'s result.

        Proof, in order (see `prove`): every agent answers with this launch's id; host admission;
        the artifact_root probe; the metadata store when needed (`metadata_store=None`: when
        artifact_root is host-local on several hosts or an explicit store is configured); the
        preflight collective in every environment that needs it (see `proof_environments`).
        Between the agents' answer and admission, every port the topology leaves open
        (`TrainerSpec.master_port` or `InferenceSpec.api_port` None) is asked of the agent of the
        host that binds it (`runtime.open_ports`): `runtime.topology` is the topology with those
        ports, the one the backend, the trainer ranks and the replica router use.

        Raises:
            UserError: `launch` is not a host mesh or launch context, `topology` is not a
                `CompiledTopology`, or the topology's worker addresses are not the launch's
                (names both).
            PreflightError: a proof failed; the message names the host and the cause.
            AgentError: an agent does not answer or belongs to another launch.
        """
        if not all(hasattr(launch, name) for name in ("worker_addresses", "launch_id", "_secret_bytes")):
            raise UserError(
                f"ArtRuntime.start(launch={type(launch).__name__}) needs the launch's agents; pass "
                "launch.host_mesh (or launch) of the ArtLaunchContext your main(launch) received"
            )
        if not isinstance(topology, CompiledTopology):
            raise UserError(
                f"ArtRuntime.start(topology={type(topology).__name__}) needs a CompiledTopology; pass "
                "compile_topology(cluster=launch.homogeneous_cluster(...))"
            )
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
            runtime.topology = await choose_ports_on_agents(topology, clients)
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
        Open ports are chosen by the agents and the cluster is proved as in `start`.

        Raises:
            UserError: `topology` is not a `CompiledTopology`; a non-loopback worker address, or an
                address that already has a listener.
            AgentStartError: an agent did not become ready within startup_timeout_s seconds.
        """
        if not isinstance(topology, CompiledTopology):
            raise UserError(
                f"ArtRuntime.start_local(topology={type(topology).__name__}) needs a CompiledTopology; "
                "pass compile_topology(cluster=...)"
            )
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
            runtime.topology = await choose_ports_on_agents(topology, clients)
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

    def proof_environments(self, requested: bool | None) -> tuple[ProofEnvironment, ...]:
        """The environments the preflight collective runs in, each on the hosts it will use.

        The trainer's (each agent's own interpreter) on its ranks' hosts, and each inference
        spec's `python` on the hosts of its replicas. `requested=None`: the trainer's when it
        uses two or more hosts (the agents already run its interpreter) and every replica
        environment, on one host too (a world-size-1 probe: the interpreter imports
        torch.distributed and forms a group); True: every one (the trainer's over every host,
        even without a trainer); False: none. An inference spec without `python` runs under the
        backend's vLLM interpreter (`MegatronBackend(vllm_python=...)`), which the runtime does
        not know at start: a replica of it that spans hosts has the network proved in the
        agents' environment, and the backend proves its interpreter with `prove_replicas`
        before it starts any replica. An environment whose interpreter and hosts another one
        covers (same interpreter, a superset of hosts) is proved once, named for both.
        """
        if requested is False:
            return ()
        topology = self.topology
        order = topology.cluster.host_ids
        agents_hosts = set(order) if requested else {r.host_id for r in topology.trainer_ranks}
        if len(agents_hosts) < 2 and not requested:
            agents_hosts = set()
        own: list[ProofEnvironment] = []
        for spec in topology.inference:
            replicas = [r for r in topology.replicas if r.name == spec.name]
            hosts = {h for r in replicas for h in r.host_ids}
            if spec.python is None:
                agents_hosts.update(h for r in replicas if len(r.host_ids) > 1 for h in r.host_ids)
            elif hosts:
                own.append(ProofEnvironment((spec.name,), spec.python, tuple(h for h in order if h in hosts)))
        wanted = own
        if requested or agents_hosts:
            trainer = ProofEnvironment(("trainer",), None, tuple(h for h in order if h in agents_hosts))
            wanted = [trainer, *own]
        merged: list[ProofEnvironment] = []
        for environment in wanted:
            for i, other in enumerate(merged):
                small, big = sorted((other, environment), key=lambda e: len(e.host_ids))
                if other.python == environment.python and set(small.host_ids) <= set(big.host_ids):
                    merged[i] = ProofEnvironment(other.names + environment.names, other.python, big.host_ids)
                    break
            else:
                merged.append(environment)
        return tuple(merged)

    def _collective_backend(self, host_ids: Sequence[str]) -> tuple[Literal["gloo", "nccl"], str | None]:
        """(backend, NCCL net) of a collective over `host_ids`: NCCL with the cluster's network
        when every host has GPUs, there are two or more and an NCCL transport is set; else gloo."""
        cluster = self.topology.cluster
        on_gpu = (
            len(host_ids) > 1
            and all(cluster.host(h).gpu_ids for h in host_ids)
            and cluster.nccl_transport is not None
        )
        if on_gpu and cluster.nccl_transport is not None:
            return "nccl", cluster.nccl_transport.net_name
        return "gloo", None

    def _proof_key(self, environment: ProofEnvironment) -> tuple[Any, ...] | None:
        """The cache key of `environment`'s collective under the current host facts (None: a
        host has no facts yet)."""
        if any(h not in self.host_facts for h in environment.host_ids):
            return None
        facts = tuple(self.host_facts[h].model_dump_json() for h in environment.host_ids)
        return (
            environment.python,
            environment.host_ids,
            self._collective_backend(environment.host_ids),
            facts,
        )

    async def prove(
        self, metadata_store: bool | None = None, collective: bool | None = None
    ) -> PreflightReport:
        """Admission, artifact_root probe, metadata store, collectives; results in `self.preflight`.

        The collective runs in every environment of `proof_environments(collective)`, one after
        the other, the trainer's first; a passed one is kept per (interpreter, hosts, backend and
        network, the hosts' facts) and not run again by a later proof of this runtime while
        those stay the same. A proof that fails stops the warm preflight probes it started (each
        holds torch in memory and would otherwise wait `preflight.probe.WARM_IDLE_S` seconds on
        its agent). Proving again (e.g. after a host was replaced) re-checks the managed etcd
        this runtime started from every host instead of starting a second one; `close` stops it.
        """
        self._check_usable()
        environments = self.proof_environments(collective)
        # Warm probes import torch while admission, the FS probe and etcd run (a failed prepare
        # only means that host's probe starts cold); none for what the last facts say is proved.
        warm = {
            (h, e.python) for e in environments if self._proof_key(e) not in self._proved for h in e.host_ids
        }
        warming = asyncio.gather(
            *(
                self._clients[h].call(PREFLIGHT_PREPARE, PreflightPrepareRequest(python=python))
                for h, python in sorted(warm, key=str)
            ),
            return_exceptions=True,
        )
        used: set[tuple[str, str | None]] = set()
        try:
            report = await self._prove(metadata_store, environments, warming, used)
        except BaseException:
            await warming  # no probe may start after the discard
            await asyncio.gather(
                *(self._clients[h].call(PREFLIGHT_DISCARD) for h in {h for h, _ in warm}),
                return_exceptions=True,
            )
            raise
        # warm probes of environments found proved after all would wait for nothing: stop them
        idle = {h for h, _ in warm - used}
        await asyncio.gather(
            *(self._clients[h].call(PREFLIGHT_DISCARD) for h in idle), return_exceptions=True
        )
        return report

    async def _prove(
        self,
        metadata_store: bool | None,
        environments: tuple[ProofEnvironment, ...],
        warming: asyncio.Future,
        used: set[tuple[str, str | None]],
    ) -> PreflightReport:
        from art_mega.preflight.admission import admit
        from art_mega.preflight.collective import run_collective
        from art_mega.preflight.etcd import check_from_every_host, start_metadata_store
        from art_mega.preflight.fs_probe import probe_artifact_root

        loop = asyncio.get_running_loop()
        cluster = self.topology.cluster
        phases: dict[Phase, float] = {}
        started = loop.time()
        hosts = list(self._clients)
        facts = await asyncio.gather(*(self._clients[h].call(FACTS) for h in hosts))
        self.host_facts = dict(zip(hosts, facts))
        admit(self.topology, self.host_facts)
        phases[Phase.ADMISSION] = loop.time() - started
        phases[Phase.FS_PROBE] = await probe_artifact_root(
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
            phases[Phase.METADATA_STORE] = loop.time() - started
        await warming
        reports: list[CollectiveReport] = []
        ran_s = 0.0
        for environment in environments:
            key = self._proof_key(environment)
            report = self._proved.get(key) if key is not None else None
            if report is None:
                backend, nccl_net = self._collective_backend(environment.host_ids)
                used.update((h, environment.python) for h in environment.host_ids)
                report = await run_collective(
                    self._clients,
                    environment.host_ids,
                    cluster.host(environment.host_ids[0]).worker_address.host,
                    cluster.startup_timeout_s,
                    backend=backend,
                    nccl_net=nccl_net,
                    python=environment.python,
                    log_dir=cluster.artifact_root,
                    environment=", ".join(environment.names),
                )
                ran_s += report.seconds
                if key is not None:
                    self._proved[key] = report
            reports.append(report)
        if environments:
            phases[Phase.COLLECTIVE] = ran_s
        trainer = next((r for r, e in zip(reports, environments) if "trainer" in e.names), None)
        self.preflight = PreflightReport(
            phases_s=phases,
            metadata_store=endpoint,
            collective=trainer or (reports[0] if reports else None),
            collectives=tuple(reports),
        )
        return self.preflight

    async def prove_replicas(self, python: str) -> CollectiveReport | None:
        """Prove `python`, the interpreter replicas will run under, on every replica host.

        For the backend, before it starts any replica: an `InferenceSpec` without `python` runs
        under the backend's vLLM interpreter, which `prove` did not know. One collective over
        the replicas' hosts (node order, world size 1 on one host), named for the inference
        specs; cached like `prove`'s, so an interpreter `prove` already proved on those hosts
        costs nothing. None when the topology has no replicas; `prove` must have run.

        Raises:
            PreflightError: a CPU replica host's VLLM_PLUGINS leaves out art-mega's plugin, or
                the interpreter cannot be run, cannot import torch.distributed or
                cannot join (names the host and the interpreter); nothing is left running.
            RuntimeError: the runtime is closed, or was never proved.
            HostLostError: a host was lost.
        """
        from art_mega.preflight.collective import run_collective

        self._check_usable()
        if not self.host_facts:
            raise RuntimeError("prove_replicas needs a proved runtime (ArtRuntime.start or prove first)")
        topology = self.topology
        hosts = {h for r in topology.replicas for h in r.host_ids}
        if not hosts:
            return None
        names = tuple(dict.fromkeys(r.name for r in topology.replicas))
        host_ids = tuple(h for h in topology.cluster.host_ids if h in hosts)
        self._check_replica_plugins()
        environment = ProofEnvironment(names, python, host_ids)
        key = self._proof_key(environment)
        if key in self._proved:
            return self._proved[key]
        backend, nccl_net = self._collective_backend(host_ids)
        cluster = topology.cluster
        report = await run_collective(
            self._clients,
            host_ids,
            cluster.host(host_ids[0]).worker_address.host,
            cluster.startup_timeout_s,
            backend=backend,
            nccl_net=nccl_net,
            python=python,
            log_dir=cluster.artifact_root,
            environment=", ".join(names),
        )
        if key is not None:
            self._proved[key] = report
        return report

    def _check_replica_plugins(self) -> None:
        """Raise `PreflightError` when the agent on a CPU replica's host has a VLLM_PLUGINS that
        leaves out art-mega's vLLM plugin (`inference.replica.plugins_problem`): the replica
        inherits it, and its spawn would be refused after the trainer ranks started."""
        from art_mega.inference.replica import plugins_problem

        for replica in self.topology.replicas:
            if any(gpus for _, gpus in replica.gpu_ids):
                continue
            for host in replica.host_ids:
                problem = plugins_problem(
                    self.host_facts[host].env, where=f"the agent's environment on host {host}"
                )
                if problem is not None:
                    raise PreflightError(f"replica {replica.process_name}: {problem}", (host,))

    async def _recheck_managed_etcd(self) -> str | None:
        """On a proof again: this runtime's managed etcd, checked from every host, or None when
        there is none or it no longer serves (then it is stopped, and the caller starts another)."""
        from art_mega.errors import PreflightError
        from art_mega.preflight.etcd import check_from_every_host

        if self._etcd_endpoint is None:
            return None
        try:
            await check_from_every_host(self._clients, self._etcd_endpoint, self.launch_id)
            return self._etcd_endpoint
        except PreflightError:
            host, self._etcd_host, self._etcd_endpoint = self._etcd_host, None, None
            if host is not None:
                await self._clients[host].call(ETCD_STOP)
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

    def rollout_executor(
        self,
        callables: Callable[..., Any]
        | InstalledAsyncCallable
        | Sequence[Callable[..., Any] | InstalledAsyncCallable],
        target_workers: int | None = None,
    ) -> RolloutExecutor:
        """A rollout executor over the topology's rollout hosts, returned at once (as ART's).

        Its worker processes start on `await executor` (so `await runtime.rollout_executor(...)`
        returns it started), else on its first `run` or `submit`; `close` stops them.

        Args:
            callables: the async rollout function(s), or their `InstalledAsyncCallable`s, that
                workers import and hash-check before they count as started; other top-level
                async functions can still be run later.
            target_workers: total worker processes, spread round-robin over the rollout hosts up
                to each host's cpu_slots; None = every slot.

        Raises:
            UserError: a lambda, closure, non-async or not module-level callable; target_workers
                not an int or out of range. (A worker refusing a callable is raised by the start.)
            RuntimeError: the runtime is closed.
            HostLostError: a host was lost.
        """
        self._check_usable()
        fns = list(callables) if isinstance(callables, (list, tuple)) else [callables]
        slots = [(h, self.topology.cluster.host(h).cpu_slots) for h in self.topology.rollout_host_ids]
        executor = RolloutExecutor(self._clients, slots, fns, target_workers, self._sys_path)
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
                await asyncio.wait_for(self._clients[self._etcd_host].call(ETCD_STOP), timeout)
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
