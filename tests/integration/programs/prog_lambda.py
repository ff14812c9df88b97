"""Gives the executor a lambda: a user error (exit 2, one sentence)."""

from art_mega import ArtRuntime, compile_topology


async def main(launch):
    runtime = await ArtRuntime.start(
        launch, compile_topology(launch.homogeneous_cluster(allow_shared_kernel=True))
    )
    await runtime.rollout_executor(lambda answer: answer)
