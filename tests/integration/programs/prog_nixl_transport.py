"""Stages one exported adapter from host0 to the replica hosts over NIXL, then (NIXL_SERVE=1)
starts a vLLM replica there and publishes the adapter to it. Prints NIXL_OK {json}.

NIXL_ROOT: the host-local artifact_root; NIXL_ADAPTER: the adapter folder on host0 (absolute);
NIXL_REPLICA_HOSTS: comma-separated replica hosts; NIXL_MODEL: the base model folder (serving).
"""

import json
import os

from art_mega import ArtRuntime, compile_topology
from art_mega.topology import InferenceSpec, TrainerSpec
from art_mega.transfer.remote import adapter_transport_for


async def main(launch):
    cluster = launch.homogeneous_cluster(
        allow_shared_kernel=True, artifact_root=os.environ["NIXL_ROOT"], shared_artifact_root=False
    )
    hosts = tuple(os.environ["NIXL_REPLICA_HOSTS"].split(","))
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(host_ids=("host0",)),
        inference=InferenceSpec(replicas=len(hosts), host_ids=hosts),
    )
    runtime = await ArtRuntime.start(launch, topology)
    try:
        transport = adapter_transport_for(runtime)
        result = {"metadata_store": runtime.preflight.metadata_store}
        if os.environ.get("NIXL_SERVE") == "1":
            result.update(await serve(runtime, transport))
        else:
            result["paths"] = await transport(1, os.environ["NIXL_ADAPTER"])
            result["report"] = transport.last.__dict__
        print("NIXL_OK " + json.dumps(result), flush=True)
    finally:
        await runtime.close()


async def serve(runtime, transport):
    """Start the replicas, publish step 1 through the transport, ask the adapter for tokens."""
    import openai

    from art_mega.inference.adapters import AdapterPublisher
    from art_mega.inference.protocol import ReplicaLaunch
    from art_mega.inference.remote import start_replicas, stop_replicas
    from art_mega.inference.router import PolicyRouter, ReplicaEndpoint

    replicas = runtime.topology.replicas
    launch = ReplicaLaunch(
        model=os.environ["NIXL_MODEL"],
        served_model_name="tiny",
        python=os.environ["ART_MEGA_VLLM_PYTHON"],
        max_lora_rank=8,
        max_model_len=256,
        log_dir=os.environ["NIXL_LOGS"],
        ready_timeout_s=300,
    )
    await start_replicas(runtime.clients, replicas, launch)
    try:
        router = PolicyRouter("tiny", [ReplicaEndpoint.from_spec(r) for r in replicas])
        async with AdapterPublisher(router, stage=transport) as publisher:
            await publisher.publish(1, os.environ["NIXL_ADAPTER"])
            route = router.route()
            client = openai.AsyncOpenAI(base_url=route.base_url, api_key="x")
            reply = await client.completions.create(
                model=route.model, prompt="hello", max_tokens=4, temperature=0, logprobs=1
            )
            await client.close()
            return {
                "paths": publisher.loaded(route.replica),
                "model": route.model,
                "logprobs": reply.choices[0].logprobs.token_logprobs,
            }
    finally:
        await stop_replicas(runtime.clients, replicas)
