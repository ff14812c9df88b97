"""Starts a runtime over the launch's hosts with the topology the test describes in env vars.

PREFLIGHT_GPU_HOST1: GPU ids for host1 (comma-separated); PREFLIGHT_NCCL_NET: nccl net_name;
PREFLIGHT_LOCAL_ROOT=1: host-local artifact_root; PREFLIGHT_ROOT: artifact_root; PREFLIGHT_ETCD=1:
require the metadata store; PREFLIGHT_ETCD_BIN: etcd binary; PREFLIGHT_PROVE_AGAIN=1: prove a
second time and report its metadata store as "again"; PREFLIGHT_STORE: an explicit metadata
store (NixlTransportSpec.metadata_store, tcp://HOST:PORT); PREFLIGHT_REGISTER=1: a trainer rank on
host1 and a replica on host0, then register tiny-qwen3 from PREFLIGHT_CACHE (cache_root). Prints
PREFLIGHT_OK {json}.
"""

import json
import os

import art_mega as art
from art_mega import (
    ArtRuntime,
    ClusterSpec,
    HostSpec,
    InferenceSpec,
    NcclTransportSpec,
    NixlTransportSpec,
    TrainerSpec,
    compile_topology,
)


async def main(launch):
    base = launch.homogeneous_cluster(
        allow_shared_kernel=True,
        artifact_root=os.environ.get("PREFLIGHT_ROOT") or None,
        cache_root=os.environ.get("PREFLIGHT_CACHE") or None,
        shared_artifact_root=os.environ.get("PREFLIGHT_LOCAL_ROOT") != "1",
        nccl_transport=NcclTransportSpec(net_name=os.environ["PREFLIGHT_NCCL_NET"])
        if os.environ.get("PREFLIGHT_NCCL_NET")
        else None,
        nixl_transport=NixlTransportSpec(metadata_store=os.environ["PREFLIGHT_STORE"])
        if os.environ.get("PREFLIGHT_STORE")
        else None,
    )
    gpus = os.environ.get("PREFLIGHT_GPU_HOST1")
    if gpus:
        hosts = list(base.hosts)
        ids = tuple(int(g) if g.isdigit() else g for g in gpus.split(","))
        hosts[1] = HostSpec(**{**hosts[1].model_dump(), "gpu_ids": ids})
        base = ClusterSpec(**{**base.model_dump(), "hosts": tuple(hosts)})
    if os.environ.get("PREFLIGHT_TIMEOUT"):
        base = ClusterSpec(
            **{**base.model_dump(), "startup_timeout_s": float(os.environ["PREFLIGHT_TIMEOUT"])}
        )
    topology = compile_topology(base)
    if os.environ.get("PREFLIGHT_REGISTER") == "1":
        topology = compile_topology(
            base,
            trainer=TrainerSpec(host_ids=(base.hosts[1].host_id,), cpu_ranks_per_host=1),
            inference=InferenceSpec(replicas=1, host_ids=(base.hosts[0].host_id,)),
        )
    runtime = await ArtRuntime.start(
        launch,
        topology,
        metadata_store={"1": True, "0": False}.get(os.environ.get("PREFLIGHT_ETCD", "")),
        collective=True if os.environ.get("PREFLIGHT_COLLECTIVE") == "1" else None,
    )
    try:
        if os.environ.get("PREFLIGHT_REGISTER") == "1":
            backend = art.MegatronBackend(runtime=runtime)
            try:
                await art.TrainableModel(name="m", project="p", base_model="tiny-qwen3").register(backend)
            finally:
                await backend.close()
        report = runtime.preflight
        facts = runtime.host_facts
        again = None
        if os.environ.get("PREFLIGHT_PROVE_AGAIN") == "1":
            again = (await runtime.prove(metadata_store=True)).metadata_store
        print(
            "PREFLIGHT_OK "
            + json.dumps(
                {
                    "phases": report.phases_s,
                    "metadata_store": report.metadata_store,
                    "again": again,
                    "hosts": sorted(facts),
                    "boot_ids": sorted({f.boot_id for f in facts.values()}),
                    "bandwidth_gbps": report.collective.bandwidth_gbps if report.collective else None,
                    "members": report.collective.members if report.collective else None,
                }
            ),
            flush=True,
        )
        if os.environ.get("PREFLIGHT_HOLD"):
            print("HOLDING", flush=True)
            import asyncio

            await asyncio.sleep(float(os.environ["PREFLIGHT_HOLD"]))
    finally:
        await runtime.close()
