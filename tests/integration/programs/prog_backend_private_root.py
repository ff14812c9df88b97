"""Registers a model with MegatronBackend on host-local artifact roots.

Default: trainer rank 0 on host0, a replica on host1. Run by a controller that does not see
host0's private artifact dir, the registration must stop with one sentence before any trainer
rank or replica starts.

PRIVATE_TRAIN=1: trainer ranks on host0 and host1 (DP=2), the replica on host0; two
`backend.train` steps, then a fresh backend on the same runtime resumes, trains step 3 and
deletes old checkpoints. Prints PRIVATE_OK {json} with the steps seen.

NIXL_ROOT: the host-local artifact_root; NIXL_MODEL: the base model folder (PRIVATE_TRAIN).
"""

import json
import os

import art_mega as art
from art_mega import ArtRuntime, compile_topology
from art_mega.backend import MegatronBackend
from art_mega.topology import InferenceSpec, TrainerSpec


async def main(launch):
    training = os.environ.get("PRIVATE_TRAIN") == "1"
    cluster = launch.homogeneous_cluster(
        cpu_slots=2,
        allow_shared_kernel=True,
        artifact_root=os.environ["NIXL_ROOT"],
        shared_artifact_root=False,
        startup_timeout_s=600,
    )
    topology = compile_topology(
        cluster,
        trainer=TrainerSpec(host_ids=("host0", "host1") if training else ("host0",), cpu_ranks_per_host=1),
        inference=InferenceSpec(replicas=1, host_ids=("host0",) if training else ("host1",)),
    )
    runtime = await ArtRuntime.start(launch, topology)
    try:
        if training:
            print("PRIVATE_OK " + json.dumps(await train_and_resume(runtime)), flush=True)
        else:
            model = art.TrainableModel(name="m", project="proj", base_model="tiny-llama")
            await model.register(MegatronBackend(runtime))
    finally:
        await runtime.close()


async def train_and_resume(runtime):
    """Two steps on one backend, then a fresh one resumes and trains step 3; the steps seen."""
    from tests.inference.common import rollout_groups

    seen = {"trained": []}
    for attempt in ("first", "resumed"):
        backend = MegatronBackend(runtime, seq_len=128, max_model_len=256, startup_timeout_s=600)
        model = art.TrainableModel(name="m", project="proj", base_model=os.environ["NIXL_MODEL"])
        try:
            await model.register(backend)
            seen[f"{attempt}_at"] = await backend.get_step(model)
            for _ in range(2 if attempt == "first" else 1):
                result = await backend.train(model, await rollout_groups(model), learning_rate=1e-3)
                seen["trained"].append(result.step)
            if attempt == "resumed":
                seen["deleted"] = await backend.delete_checkpoints(model)
        finally:
            await backend.close()
    return seen
