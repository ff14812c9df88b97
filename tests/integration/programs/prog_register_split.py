"""Registers a model whose heads TrainerSpec(tp=3) cannot split (the tiny Llama: 4 attention
heads, 2 KV heads): refused at register in one sentence (exit 2) before any trainer rank or
replica starts. REGISTER_ROOT: the artifact_root; REGISTER_MODEL: the model directory."""

import os

import art_mega as art
from art_mega import ArtRuntime, compile_topology
from art_mega.backend import MegatronBackend
from art_mega.topology import InferenceSpec, TrainerSpec


async def main(launch):
    cluster = launch.homogeneous_cluster(cpu_slots=3, artifact_root=os.environ["REGISTER_ROOT"])
    topology = compile_topology(
        cluster, trainer=TrainerSpec(tp=3, cpu_ranks_per_host=3), inference=InferenceSpec(replicas=1)
    )
    runtime = await ArtRuntime.start(launch, topology)
    try:
        model = art.TrainableModel(name="m", project="p", base_model=os.environ["REGISTER_MODEL"])
        await model.register(MegatronBackend(runtime))
    finally:
        await runtime.close()
