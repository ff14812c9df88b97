"""Builds an invalid cluster: a user error naming the field (exit 2, one sentence)."""


async def main(launch):
    launch.homogeneous_cluster(cpu_slots=0)
