"""Registers a model with MegatronBackend on host-local artifact roots (trainer rank 0 on host0,
a replica on host1). Run by a controller that does not see host0's private artifact dir, the
registration must stop with one sentence before any trainer rank or replica starts.

NIXL_ROOT: the host-local artifact_root.
"""

import os

import art_mega as art
from art_mega import ArtRuntime, compile_topology
from art_mega.backend import MegatronBackend
from art_mega.topology import InferenceSpec, TrainerSpec


async def main(launch):
    cluster = launch.homogeneous_cluster(
        allow_shared_kernel=True, artifact_root=os.environ["NIXL_ROOT"], shared_artifact_root=False
    )
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(host_ids=("host0",)),
        inference=InferenceSpec(replicas=1, host_ids=("host1",)),
    )
    runtime = await ArtRuntime.start(launch, topology)
    try:
        model = art.TrainableModel(name="m", project="proj", base_model="tiny-llama")
        await model.register(MegatronBackend(runtime))
    finally:
        await runtime.close()
