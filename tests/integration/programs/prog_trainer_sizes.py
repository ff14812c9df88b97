"""Compiles a topology whose TrainerSpec asks for sizes the trainer cannot run yet (TRAINER_SIZES,
e.g. "pp=2,cp=2"), then would start a runtime and register: refused at
`compile_topology` in one sentence (exit 2) before any trainer rank or replica starts.
REGISTER_ROOT: the artifact_root; REGISTER_MODEL: the model directory."""

import os

import art_mega as art
from art_mega import ArtRuntime, compile_topology
from art_mega.backend import MegatronBackend
from art_mega.topology import InferenceSpec, TrainerSpec


async def main(launch):
    sizes = dict(item.split("=") for item in os.environ["TRAINER_SIZES"].split(","))
    cluster = launch.homogeneous_cluster(cpu_slots=2, artifact_root=os.environ["REGISTER_ROOT"])
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(cpu_ranks_per_host=2, **{k: int(v) for k, v in sizes.items()}),
        inference=InferenceSpec(replicas=1),
    )
    runtime = await ArtRuntime.start(launch, topology)
    try:
        model = art.TrainableModel(name="m", project="p", base_model=os.environ["REGISTER_MODEL"])
        await model.register(MegatronBackend(runtime))
    finally:
        await runtime.close()
