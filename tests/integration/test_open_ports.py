"""Two runs on one machine, neither setting a port: each runtime's agent chooses the trainer's
rendezvous port and the replicas' ports, all different and free, and the started runtime's
topology carries them to every rank's MASTER_PORT and RankConfig and to the replica URLs.
(Ranks and replicas meeting on chosen ports are run by every test whose program leaves the
ports out: tests/integration/programs, the examples under test_train_over_ssh and e2e.)"""

from __future__ import annotations

import socket

from art_mega import ArtRuntime, InferenceSpec, TrainerSpec, compile_topology
from art_mega.inference.replica import check_port_free
from art_mega.inference.router import ReplicaEndpoint
from art_mega.trainer.remote import TrainerService
from tests.helpers import loopback_cluster


def binds(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


async def test_two_runs_without_ports_get_their_own(tmp_path):
    runtimes = []
    try:
        for run in ("a", "b"):
            topology = compile_topology(
                loopback_cluster(1, tmp=str(tmp_path / run)),
                trainer=TrainerSpec(cpu_ranks_per_host=2),
                inference=InferenceSpec(replicas=2),
            )
            assert topology.trainer is not None and topology.trainer.master_port is None
            assert [r.endpoint.port for r in topology.replicas] == [0, 0]
            runtimes.append(await ArtRuntime.start_local(topology, collective=False))
        ports = []
        for runtime in runtimes:
            chosen = runtime.topology
            assert chosen.trainer is not None
            master = chosen.trainer.master_port
            assert [p.environ["MASTER_PORT"] for p in chosen.processes if p.role == "trainer"] == [
                str(master)
            ] * 2
            assert TrainerService(runtime.clients, chosen, tmp_path).rank_config(None).master_port == master
            replica_ports = [r.endpoint.port for r in chosen.replicas]
            assert [ReplicaEndpoint.from_spec(r).url for r in chosen.replicas] == [
                f"http://127.0.0.1:{port}" for port in replica_ports
            ]
            for replica in chosen.replicas:
                check_port_free(replica)
            ports += [master, *replica_ports]
        assert len(set(ports)) == 6
        assert all(binds(port) for port in ports), ports

    finally:
        for runtime in runtimes:
            await runtime.close()
