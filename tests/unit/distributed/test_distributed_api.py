"""`art_mega.distributed` refuses bad arguments in one sentence, before anything starts."""

import pytest

import art_mega as art
from art_mega.distributed import (
    ArtLaunchContext,
    ArtRuntime,
    HostMesh,
    InstalledAsyncCallable,
    RolloutExecutor,
    compile_topology,
)
from art_mega.errors import TopologyError, UserError
from tests.helpers import loopback_cluster
from tests.integration import distributed_for_tests as d


def _executor(target_workers=2, callables=(d.where,)) -> RolloutExecutor:
    """An executor planned over one host with 2 slots (no agent: nothing here starts it)."""
    return RolloutExecutor({}, [("host0", 2)], list(callables), target_workers)


def _one_sentence(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message, message
    return message


def test_the_names_are_arts():
    assert art.distributed.ArtRuntime is ArtRuntime
    assert {"ArtLaunchContext", "ArtRuntime", "InstalledAsyncCallable", "compile_topology"} <= set(
        dir(art.distributed)
    )
    from art_mega.distributed import ClusterSpec, NcclTransportSpec
    from art_mega.topology import ClusterSpec as TopologyClusterSpec

    assert ClusterSpec is TopologyClusterSpec and NcclTransportSpec(net_name="IB").net_name == "IB"


def test_host_mesh_is_the_launchs_agents_and_registers_runtimes_with_the_launch():
    launch = ArtLaunchContext(("tcp://127.0.0.1:7001", "tcp://127.0.0.2:7001"), "abc", sys_path=("/p",))
    mesh = launch.host_mesh
    assert isinstance(mesh, HostMesh)
    assert (mesh.worker_addresses, mesh.launch_id, mesh.sys_path) == (launch.worker_addresses, "abc", ("/p",))
    mesh._register("runtime")
    assert launch._runtimes == ["runtime"]  # the launcher closes what a program left open


async def test_start_refuses_what_is_not_a_host_mesh_or_a_compiled_topology():
    launch = ArtLaunchContext(("tcp://127.0.0.1:7001",), "abc")
    cluster = loopback_cluster(1)
    with pytest.raises(UserError) as caught:
        await ArtRuntime.start(launch.host_mesh, cluster)
    assert _one_sentence(caught.value) == (
        "ArtRuntime.start(topology=ClusterSpec) needs a CompiledTopology; pass "
        "compile_topology(cluster=launch.homogeneous_cluster(...))"
    )
    with pytest.raises(
        UserError, match=r"^ArtRuntime.start\(launch=str\) needs the launch's agents; pass launch.host_mesh"
    ):
        await ArtRuntime.start("tcp://127.0.0.1:7001", compile_topology(cluster=cluster))
    with pytest.raises(
        UserError, match=r"^ArtRuntime.start_local\(topology=ClusterSpec\) needs a CompiledTopology"
    ):
        await ArtRuntime.start_local(cluster)


def test_compile_topology_takes_a_cluster_spec():
    assert compile_topology(cluster=loopback_cluster(2)).cluster.host_ids == ("host0", "host1")
    with pytest.raises(TopologyError) as caught:
        compile_topology(cluster={"hosts": []})
    assert _one_sentence(caught.value).startswith("compile_topology(cluster=dict) needs a ClusterSpec; pass ")
    assert caught.value.field == "cluster"


def test_from_callable_takes_a_plain_async_def_or_its_reference_and_refuses_copies():
    installed = InstalledAsyncCallable.from_callable(d.where)
    assert (installed.module, installed.qualname) == ("tests.integration.distributed_for_tests", "where")
    assert InstalledAsyncCallable.from_callable(installed) is installed
    with pytest.raises(UserError) as caught:
        InstalledAsyncCallable.from_callable(d.Greeter().greet)
    assert _one_sentence(caught.value) == (
        "rollout Greeter.greet is not what tests.integration.distributed_for_tests.Greeter.greet names, so "
        "workers would import something else; pass the module-level function itself (not a bound method "
        "or a copy)"
    )
    with pytest.raises(UserError, match="is a lambda"):
        InstalledAsyncCallable.from_callable(lambda: None)


def test_rollout_executor_refuses_a_target_that_is_not_a_worker_count():
    for bad in ("2", 2.0, True):
        with pytest.raises(UserError) as caught:
            _executor(target_workers=bad)
        assert _one_sentence(caught.value) == (
            f"target_workers={bad!r} is not a number of worker processes; pass an int 1..2 or None for every cpu_slot"
        )
    with pytest.raises(UserError, match="target_workers=3 is out of range"):
        _executor(target_workers=3)
    assert _executor(target_workers=None).target_workers == 2
    assert _executor(callables=[InstalledAsyncCallable.from_callable(d.where)]).worker_ids == (0, 1)


def test_set_workers_refuses_ids_it_cannot_map_and_keeps_the_previous_assignment():
    executor = _executor()
    cases = [
        ("01", "set_workers(worker_ids='01') takes a tuple of int worker ids; pass e.g. tuple(range(2))"),
        ((0.0,), "set_workers(worker_ids=(0.0,)) takes a tuple of int worker ids; pass e.g. tuple(range(2))"),
        (
            (True,),
            "set_workers(worker_ids=(True,)) takes a tuple of int worker ids; pass e.g. tuple(range(2))",
        ),
        ((4, 4), "set_workers(worker_ids=(4, 4)) names worker 4 more than once; give each id once"),
        (
            (0, 1, 2),
            "set_workers(worker_ids=(0, 1, 2)) names 3 workers, but the executor has target_workers=2 "
            "processes; pass at most 2 ids or raise target_workers",
        ),
    ]
    for ids, message in cases:
        with pytest.raises(UserError) as caught:
            executor.set_workers(ids)
        assert str(caught.value) == message
    assert executor.worker_ids == (0, 1)
    executor.set_workers([7, 3])
    assert executor._assigned == {7: 1, 3: 0}  # new ids ascending take the processes in order
    executor.set_workers((7, 9))
    assert executor._assigned == {7: 1, 9: 0}


async def test_run_refuses_an_unknown_worker_before_starting_anything():
    executor = _executor()
    with pytest.raises(UserError) as caught:
        await executor.run(5, d.where)
    assert str(caught.value) == (
        "worker=5 is not a worker of this executor; use a worker id (0..1, as set_workers gives them) "
        "or one of executor.workers"
    )
    with pytest.raises(UserError, match="workers are not started yet"):
        _ = executor.workers
    executor.set_workers(())
    with pytest.raises(UserError, match=r"submit has no worker to run on: set_workers\(\(\)\) named none"):
        await executor.submit(d.where)
    await executor.close()
    with pytest.raises(RuntimeError, match="closed"):
        await executor.start()
