"""Ports left None (`TrainerSpec.master_port`, `InferenceSpec.api_port`) compile to open listeners
that the runtime chooses on the host that binds them; the chosen port is what every consumer sees
(each rank's MASTER_PORT and RankConfig, the replica's URL and vLLM's --port). Ports that are set
keep being used as given, checked against each other at compile time and refused when busy."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from art_mega.errors import PreflightError, ReplicaStartError, TopologyError, format_validation_error
from art_mega.inference.protocol import ReplicaLaunch
from art_mega.inference.replica import check_port_free, vllm_argv
from art_mega.inference.router import ReplicaEndpoint
from art_mega.runtime.open_ports import ASKS_PER_PORT, choose_ports
from art_mega.topology import (
    ClusterSpec,
    CompiledTopology,
    EndpointSpec,
    HostSpec,
    InferenceSpec,
    TrainerSpec,
    compile_topology,
)
from art_mega.topology.open_ports import OpenPort, open_ports, ports_in_use, with_ports
from art_mega.trainer.remote import TrainerService


def two_hosts(*, shared_address: bool = False) -> ClusterSpec:
    """h0 at 127.0.0.1:22222 and h1 at 127.0.0.2:22223 (or 127.0.0.1:22223: one machine)."""
    second = "127.0.0.1" if shared_address else "127.0.0.2"
    return ClusterSpec(
        hosts=(
            HostSpec(host_id="h0", node_rank=0, worker_address=EndpointSpec(host="127.0.0.1", port=22222)),
            HostSpec(host_id="h1", node_rank=1, worker_address=EndpointSpec(host=second, port=22223)),
        ),
        controller_host_id="h0",
        artifact_root="/tmp/art-mega-open-ports/artifacts",
        cache_root="/tmp/art-mega-open-ports/cache",
        allow_shared_kernel=True,
    )


def open_topology(**cluster: bool) -> CompiledTopology:
    """Two CPU ranks per host, three replicas spread over both hosts; no port set."""
    return compile_topology(
        two_hosts(**cluster), trainer=TrainerSpec(cpu_ranks_per_host=2), inference=InferenceSpec(replicas=3)
    )


def launch() -> ReplicaLaunch:
    return ReplicaLaunch(model="/models/q", served_model_name="q", log_dir="/tmp/logs")


def answers(*ports: int):
    """An `ask` that answers `ports` in turn, recording who asked."""
    asked: list[OpenPort] = []
    left: Iterator[int] = iter(ports)

    async def ask(listener: OpenPort) -> int:
        asked.append(listener)
        return next(left)

    return ask, asked


def test_ports_left_none_compile_to_open_listeners() -> None:
    topology = open_topology()
    assert [(p.process, p.host_id, p.bind_host, p.field) for p in open_ports(topology)] == [
        ("trainer-0", "h0", "127.0.0.1", "TrainerSpec.master_port"),
        ("vllm-0", "h0", "127.0.0.1", "InferenceSpec(name='vllm').api_port"),
        ("vllm-1", "h1", "127.0.0.2", "InferenceSpec(name='vllm').api_port"),
        ("vllm-2", "h0", "127.0.0.1", "InferenceSpec(name='vllm').api_port"),
    ]
    assert topology.trainer is not None and topology.trainer.master_port is None
    assert all("MASTER_PORT" not in p.environ for p in topology.processes if p.role == "trainer")
    assert [r.endpoint.port for r in topology.replicas] == [0, 0, 0]
    assert [p.ports for p in topology.processes if p.role in ("trainer", "inference")] == [()] * 7
    assert ports_in_use(topology) == {"127.0.0.1": {22222}, "127.0.0.2": {22223}}


def test_set_ports_are_not_open_and_still_collide_at_compile_time() -> None:
    topology = compile_topology(
        two_hosts(),
        trainer=TrainerSpec(master_port=29511),
        inference=InferenceSpec(replicas=2, api_port=8311),
    )
    assert open_ports(topology) == ()
    assert [r.endpoint.url for r in topology.replicas] == ["http://127.0.0.1:8311", "http://127.0.0.2:8311"]
    assert topology.process("trainer-0").environ["MASTER_PORT"] == "29511"
    with pytest.raises(TopologyError) as info:
        compile_topology(
            two_hosts(), trainer=TrainerSpec(master_port=8311), inference=InferenceSpec(api_port=8311)
        )
    assert str(info.value) == (
        "port 8311 at 127.0.0.1 is taken by both TrainerSpec.master_port (host 'h0') and "
        "InferenceSpec(name='vllm').api_port (replica 0) (host 'h0'); change one of them."
    )


def test_an_open_spec_beside_a_set_one_compiles() -> None:
    set_spec = InferenceSpec(name="policy", replicas=2, api_port=8000)
    topology = compile_topology(
        two_hosts(), trainer=TrainerSpec(), inference=[set_spec, InferenceSpec(name="judge")]
    )
    assert [(r.process_name, r.endpoint.port) for r in topology.replicas] == [
        ("policy-0", 8000),
        ("policy-1", 8000),
        ("judge-0", 0),
    ]
    assert [p.process for p in open_ports(topology)] == ["trainer-0", "judge-0"]


async def test_chosen_ports_are_what_every_consumer_sees(tmp_path) -> None:
    ask, asked = answers(20000, 20001, 20002, 20003)
    topology = await choose_ports(open_topology(), ask)
    assert [(a.process, a.bind_host) for a in asked] == [
        ("trainer-0", "127.0.0.1"),
        ("vllm-0", "127.0.0.1"),
        ("vllm-1", "127.0.0.2"),
        ("vllm-2", "127.0.0.1"),
    ]
    assert open_ports(topology) == ()
    assert topology.trainer is not None and topology.trainer.master_port == 20000
    trainers = [p for p in topology.processes if p.role == "trainer"]
    assert [p.environ["MASTER_PORT"] for p in trainers] == ["20000"] * 4
    assert [p.ports for p in trainers] == [(20000,), (), (), ()]
    config = TrainerService({}, topology, tmp_path).rank_config(None)
    assert (config.master_addr, config.master_port) == ("127.0.0.1", 20000)
    assert [ReplicaEndpoint.from_spec(r).url for r in topology.replicas] == [
        "http://127.0.0.1:20001",
        "http://127.0.0.2:20002",
        "http://127.0.0.1:20003",
    ]
    assert [topology.process(f"vllm-{i}").ports for i in range(3)] == [(20001,), (20002,), (20003,)]
    argv = vllm_argv(topology.replicas[1], launch())
    assert argv[argv.index("--host") + 1 : argv.index("--port") + 2] == ["127.0.0.2", "--port", "20002"]
    assert topology.inference[0].api_port is None  # the spec stays as written


async def test_a_port_the_machine_already_uses_is_asked_again() -> None:
    # h0 and h1 share 127.0.0.1 (two agents, one machine): an answer equal to an agent's port, a
    # set replica port or a port chosen for an earlier listener there is not taken
    topology = compile_topology(
        two_hosts(shared_address=True),
        trainer=TrainerSpec(),
        inference=[
            InferenceSpec(name="policy", api_port=8000),
            InferenceSpec(name="judge", host_ids=("h1",)),
        ],
    )
    ask, asked = answers(22223, 8000, 20000, 20000, 20001)
    chosen = await choose_ports(topology, ask)
    assert [a.process for a in asked] == ["trainer-0"] * 3 + ["judge-0"] * 2
    assert chosen.trainer is not None and chosen.trainer.master_port == 20000
    assert chosen.process("judge-0").ports == (20001,)
    assert [r.endpoint.url for r in chosen.replicas] == ["http://127.0.0.1:8000", "http://127.0.0.1:20001"]


async def test_a_port_chosen_on_another_address_is_asked_again() -> None:
    # 127.0.0.1 and 127.0.0.2 may be one kernel, where rank 0's wildcard TCPStore bind takes the
    # port on every address: no two open listeners of a run share a port
    ask, asked = answers(20000, 20000, 20000, 20001)
    chosen = await choose_ports(
        compile_topology(two_hosts(), trainer=TrainerSpec(), inference=InferenceSpec(host_ids=("h1",))), ask
    )
    assert [a.process for a in asked] == ["trainer-0", "vllm-0", "vllm-0", "vllm-0"]
    assert chosen.trainer is not None and chosen.trainer.master_port == 20000
    assert [r.endpoint.url for r in chosen.replicas] == ["http://127.0.0.2:20001"]


async def test_a_topology_without_open_ports_is_returned_as_is() -> None:
    topology = compile_topology(two_hosts(), trainer=TrainerSpec(master_port=29511))
    ask, asked = answers()
    assert await choose_ports(topology, ask) is topology
    assert asked == []


async def test_an_agent_that_keeps_answering_taken_ports_is_named() -> None:
    topology = compile_topology(two_hosts(), trainer=TrainerSpec())
    ask, _ = answers(*[22222] * ASKS_PER_PORT)
    with pytest.raises(PreflightError) as info:
        await choose_ports(topology, ask)
    assert str(info.value) == (
        f"host h0's agent answered {ASKS_PER_PORT} free ports for TrainerSpec.master_port (trainer-0) "
        "that other listeners at 127.0.0.1 already take; set that port yourself"
    )
    assert info.value.hosts == ("h0",)


@pytest.mark.parametrize(
    ("chosen", "message"),
    [
        (
            {"trainer-0": 20000},
            "ports were chosen for ['trainer-0'] but the topology's open listeners are ['trainer-0', "
            "'vllm-0', 'vllm-1', 'vllm-2']; choose one port for each open listener.",
        ),
        (
            {"trainer-0": 70000, "vllm-0": 20001, "vllm-1": 20002, "vllm-2": 20003},
            "the port chosen for TrainerSpec.master_port (trainer-0 on host 'h0') is 70000, not a TCP "
            "port in 1..65535; choose a port the host can bind.",
        ),
        (
            {"trainer-0": 20000, "vllm-0": True, "vllm-1": 20002, "vllm-2": 20003},
            "the port chosen for InferenceSpec(name='vllm').api_port (vllm-0 on host 'h0') is True, not "
            "a TCP port in 1..65535; choose a port the host can bind.",
        ),
        (
            {"trainer-0": 20000, "vllm-0": 20001, "vllm-1": 20002, "vllm-2": 20001},
            "the port 20001 chosen for InferenceSpec(name='vllm').api_port (vllm-2 on host 'h0') is "
            "already taken at 127.0.0.1 by another listener of the topology; choose another.",
        ),
    ],
)
def test_with_ports_refuses_a_wrong_choice(chosen: dict[str, int], message: str) -> None:
    with pytest.raises(TopologyError) as info:
        with_ports(open_topology(), chosen)
    assert str(info.value) == message


def test_an_open_topology_cannot_start_ranks_or_replicas(tmp_path) -> None:
    topology = open_topology()
    with pytest.raises(ValueError) as info:
        TrainerService({}, topology, tmp_path)
    assert str(info.value) == (
        "the topology's TrainerSpec.master_port is None, a port chosen when the runtime starts; "
        "pass the started runtime's runtime.topology, which holds it"
    )
    with pytest.raises(ReplicaStartError) as refused:
        check_port_free(topology.replicas[0])
    assert str(refused.value) == (
        "replica vllm-0 has no port yet (its InferenceSpec.api_port is None, a port chosen when the "
        "runtime starts); start it from the started runtime's runtime.topology"
    )


def test_a_set_port_that_is_busy_is_refused() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        topology = compile_topology(two_hosts(), inference=InferenceSpec(api_port=port))
        with pytest.raises(ReplicaStartError) as info:
            check_port_free(topology.replicas[0])
    assert str(info.value).startswith(f"replica vllm-0: port {port} on host 127.0.0.1 cannot be bound (")
    assert str(info.value).endswith(
        "another process holds it; choose another InferenceSpec.api_port or stop that process"
    )


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_a_port_out_of_range_is_refused_at_the_edge(port: int) -> None:
    for spec, field in ((InferenceSpec, "api_port"), (TrainerSpec, "master_port")):
        with pytest.raises(ValidationError) as info:
            spec(**{field: port})
        assert format_validation_error(info.value, spec.__name__).startswith(
            f"{spec.__name__}.{field}={port} is invalid: Input should be"
        )
    assert (InferenceSpec(api_port=None).api_port, TrainerSpec(master_port=None).master_port) == (None, None)
