import pytest

from art_mega.errors import HostMismatchError, PreflightError
from art_mega.preflight.admission import admit
from art_mega.preflight.protocol import GpuInfo, HostFacts
from art_mega.topology import ClusterSpec, HostSpec, NcclTransportSpec, compile_topology


def facts(
    boot="b0", files="f" * 64, gpus=(), env=None, version="0.1.0", torch=None, interfaces=("eth0", "lo")
) -> HostFacts:
    packages = {"art-mega": version}
    if torch:
        packages["torch"] = torch
    return HostFacts(
        hostname="h",
        boot_id=boot,
        python_version="3.11.7",
        python_executable="/usr/bin/python3",
        art_mega_version=version,
        art_mega_files_sha256=files,
        packages=packages,
        env=env or {},
        gpus=gpus,
        interfaces=interfaces,
    )


def gpu(index, uuid, pci, parent=None, name="H200"):
    return GpuInfo(
        index=index,
        uuid=uuid,
        pci_bus_id=pci,
        name=name,
        memory_bytes=1,
        mig_mode=parent is not None,
        parent_uuid=parent,
    )


def topology(n=3, gpu_ids=None, shared_kernel=False, nccl=None, nccl_ifname=None):
    hosts = tuple(
        HostSpec(
            host_id=f"host{i}",
            node_rank=i,
            worker_address=f"tcp://10.0.0.{i + 1}:22222",
            gpu_ids=(gpu_ids or {}).get(i, ()),
        )
        for i in range(n)
    )
    cluster = ClusterSpec(
        hosts=hosts,
        controller_host_id="host0",
        artifact_root="/a",
        cache_root="/c",
        allow_shared_kernel=shared_kernel,
        nccl_transport=NcclTransportSpec(net_name=nccl, socket_ifname=nccl_ifname) if nccl else None,
    )
    return compile_topology(cluster)


def test_identical_hosts_are_admitted():
    admit(topology(), {f"host{i}": facts(boot=f"b{i}") for i in range(3)})


def test_fingerprint_differences_are_listed_host_by_host():
    report = {
        "host0": facts(boot="a", torch="2.13.0"),
        "host1": facts(boot="b", torch="2.12.0", files="e" * 64),
        "host2": facts(boot="c", torch="2.13.0"),
    }
    with pytest.raises(PreflightError) as info:
        admit(topology(), report)
    message = str(info.value)
    assert "art_mega_files_sha256: host0=ffffffffffff, host1=eeeeeeeeeeee, host2=ffffffffffff" in message
    assert "package torch: host0=2.13.0, host1=2.12.0, host2=2.13.0" in message


def test_shared_kernel_is_refused_unless_allowed():
    report = {f"host{i}": facts(boot="same") for i in range(3)}
    with pytest.raises(PreflightError, match="hosts host0 and host1 share one kernel"):
        admit(topology(), report)
    admit(topology(shared_kernel=True), report)


def test_named_gpus_must_exist():
    report = {
        "host0": facts(boot="a", gpus=(gpu(0, "GPU-a", "0000:01"),)),
        "host1": facts(boot="b"),
        "host2": facts(boot="c"),
    }
    admit(topology(gpu_ids={0: (0,)}), report)
    admit(topology(gpu_ids={0: ("GPU-a",)}), report)
    with pytest.raises(
        HostMismatchError,
        match=r"host host0: GPU 1 in gpu_ids is not present \(index out of range; the host has 0: GPU-a\); "
        r"use an index 0..0 or a UUID",
    ) as info:
        admit(topology(gpu_ids={0: (1,)}), report)
    assert (info.value.host, info.value.field, info.value.value) == ("host0", "gpu_ids", 1)
    with pytest.raises(HostMismatchError, match="host host0: GPU GPU-b in gpu_ids is not present"):
        admit(topology(gpu_ids={0: ("GPU-b",)}), report)
    with pytest.raises(
        PreflightError, match="host host1: GPU 0 .* not present .*no GPUs.*remove gpu_ids for a CPU-only host"
    ):
        admit(topology(gpu_ids={1: (0,)}), report)


H200_UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


def two_gpu_host():
    """Synthetic facts of an H200 host with two whole GPUs and MIG slices on a third."""
    return (
        gpu(0, H200_UUID, "00000000:19:00.0"),
        gpu(1, "GPU-1b6e9b2c-0000-4000-8000-000000000001", "00000000:3B:00.0"),
        gpu(2, "GPU-2c0f0000-0000-4000-8000-000000000002", "00000000:4C:00.0"),
        gpu(
            2,
            "MIG-aaaa0000-0000-5000-8000-000000000001",
            "00000000:4C:00.0",
            parent="GPU-2c0f0000-0000-4000-8000-000000000002",
        ),
        gpu(
            2,
            "MIG-bbbb0000-0000-5000-8000-000000000002",
            "00000000:4C:00.0",
            parent="GPU-2c0f0000-0000-4000-8000-000000000002",
        ),
    )


@pytest.mark.parametrize(
    "gpu_ids,first,second",
    [
        ((0, H200_UUID), "0", f"'{H200_UUID}'"),
        ((H200_UUID, 1, 0), f"'{H200_UUID}'", "0"),
    ],
)
def test_one_gpu_named_by_index_and_uuid_is_refused(gpu_ids, first, second):
    report = {
        "host0": facts(boot="a", gpus=two_gpu_host()),
        "host1": facts(boot="b"),
        "host2": facts(boot="c"),
    }
    with pytest.raises(HostMismatchError) as info:
        admit(topology(gpu_ids={0: gpu_ids}), report)
    assert str(info.value) == (
        f"host host0: gpu_ids names one GPU twice, as {first} and {second} (both are {H200_UUID} at PCI "
        "00000000:19:00.0), which would put two ranks on it; list each GPU once"
    )
    assert (info.value.host, info.value.field, info.value.value) == ("host0", "gpu_ids", gpu_ids)


def test_an_index_on_a_host_with_two_gpu_models_needs_pci_order():
    mixed = (gpu(0, "GPU-l4", "00000000:19:00.0", name="L4"), gpu(1, "GPU-h200", "00000000:3B:00.0"))
    report = {"host0": facts(boot="a", gpus=mixed), "host1": facts(boot="b"), "host2": facts(boot="c")}
    admit(topology(gpu_ids={0: ("GPU-h200", "GPU-l4")}), report)
    with pytest.raises(
        HostMismatchError,
        match=r"host host0: gpu_ids names GPU 1 by index on a host with 2 GPU models \(H200, L4\) while "
        r"CUDA_DEVICE_ORDER is None, .*set CUDA_DEVICE_ORDER=PCI_BUS_ID on that host",
    ):
        admit(topology(gpu_ids={0: (1,)}), report)
    report["host0"] = facts(boot="a", gpus=mixed, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    admit(topology(gpu_ids={0: (1, 0)}), report)


def test_distinct_spellings_of_distinct_gpus_and_mig_slices_are_admitted():
    report = {
        "host0": facts(boot="a", gpus=two_gpu_host()),
        "host1": facts(boot="b"),
        "host2": facts(boot="c"),
    }
    slices = ("MIG-aaaa0000-0000-5000-8000-000000000001", "MIG-bbbb0000-0000-5000-8000-000000000002")
    admit(topology(gpu_ids={0: (H200_UUID, 1, *slices)}), report)
    with pytest.raises(HostMismatchError, match="GPU MIG-cccc in gpu_ids is not present .*MIG MIG-aaaa"):
        admit(topology(gpu_ids={0: ("MIG-cccc",)}), report)


def test_whole_gpu_with_its_mig_slice_is_refused():
    inventory = (gpu(0, "GPU-a", "0000:01"), gpu(0, "MIG-x", "0000:01", parent="GPU-a"))
    report = {"host0": facts(boot="a", gpus=inventory), "host1": facts(boot="b"), "host2": facts(boot="c")}
    admit(topology(gpu_ids={0: ("MIG-x",)}), report)
    with pytest.raises(PreflightError, match="MIG slice MIG-x and its whole GPU GPU-a"):
        admit(topology(gpu_ids={0: (0, "MIG-x")}), report)


def test_one_gpu_on_two_hosts_is_refused():
    report = {
        "host0": facts(boot="a", gpus=(gpu(0, "GPU-a", "0000:01"),)),
        "host1": facts(boot="b", gpus=(gpu(0, "GPU-a", "0000:02"),)),
        "host2": facts(boot="c"),
    }
    with pytest.raises(PreflightError, match="GPU GPU-a is reported by both host0 and host1"):
        admit(topology(), report)


def test_nccl_net_must_match_the_spec_on_every_host():
    ok = {f"host{i}": facts(boot=f"b{i}", env={"NCCL_NET": "IB"}) for i in range(3)}
    admit(topology(nccl="IB"), ok)
    bad = dict(ok, host2=facts(boot="b2", env={"NCCL_NET": "Socket"}))
    with pytest.raises(PreflightError, match="host host2: NCCL_NET is 'Socket' but .*net_name is 'IB'"):
        admit(topology(nccl="IB"), bad)
    unset = dict(ok, host1=facts(boot="b1"))
    with pytest.raises(PreflightError, match="host host1: NCCL_NET is None"):
        admit(topology(nccl="IB"), unset)


@pytest.mark.parametrize(
    "value,reason",
    [
        ("^lo,docker", "uses '^', NCCL_SOCKET_IFNAME's syntax, which gloo does not take"),
        ("=eth0", "uses '=', NCCL_SOCKET_IFNAME's syntax"),
        ("eth9", "names interface 'eth9', which this host does not have (it has eth0, lo)"),
        ("eth0,", "has an empty interface name"),
    ],
)
def test_gloo_socket_ifname_that_cannot_work_is_refused_naming_the_host(value, reason):
    report = {f"host{i}": facts(boot=f"b{i}") for i in range(3)}
    report["host1"] = facts(boot="b1", env={"GLOO_SOCKET_IFNAME": value})
    with pytest.raises(HostMismatchError) as info:
        admit(topology(), report)
    assert str(info.value).startswith(f"host host1: GLOO_SOCKET_IFNAME={value!r} {reason}")
    assert (info.value.host, info.value.field, info.value.value) == ("host1", "GLOO_SOCKET_IFNAME", value)


@pytest.mark.parametrize("value", ["eth0,lo", ""])
def test_gloo_socket_ifname_naming_present_interfaces_or_empty_is_admitted(value):
    report = {f"host{i}": facts(boot=f"b{i}", env={"GLOO_SOCKET_IFNAME": value}) for i in range(3)}
    admit(topology(), report)


def test_nccl_socket_ifname_follows_nccl_syntax_on_gpu_hosts():
    def host(i, ifname):
        env = {"NCCL_NET": "IB", "NCCL_SOCKET_IFNAME": ifname}
        return facts(boot=f"b{i}", env=env, gpus=(gpu(0, f"GPU-{i}", "00000000:19:00.0"),))

    on_gpus = {0: (0,), 1: (0,), 2: (0,)}
    ok = {f"host{i}": host(i, "^lo") for i in range(3)}
    admit(topology(nccl="IB", gpu_ids=on_gpus), ok)
    admit(topology(nccl="IB", nccl_ifname="eth", gpu_ids=on_gpus), ok)
    admit(topology(nccl="IB", nccl_ifname="=eth0", gpu_ids=on_gpus), ok)
    with pytest.raises(
        HostMismatchError, match=r"host host0: ClusterSpec.nccl_transport.socket_ifname .*'ib' selects none"
    ):
        admit(topology(nccl="IB", nccl_ifname="ib", gpu_ids=on_gpus), ok)
    bad = dict(ok, host2=host(2, "^eth0,lo"))
    with pytest.raises(HostMismatchError, match=r"host host2: NCCL_SOCKET_IFNAME='\^eth0,lo' selects none"):
        admit(topology(nccl="IB", gpu_ids=on_gpus), bad)
    # NCCL does not run on a CPU-only host: its NCCL_SOCKET_IFNAME is not checked
    admit(topology(nccl="IB", gpu_ids={0: (0,), 1: (0,)}), bad)


def test_host_facts_collect_without_a_gpu():
    from art_mega.preflight.host_facts import collect_host_facts

    collected = collect_host_facts()
    assert collected.gpus == () and collected.nvml_error
    assert len(collected.art_mega_files_sha256) == 64
    assert collected.packages["art-mega"] == collected.art_mega_version
    assert "lo" in collected.interfaces
