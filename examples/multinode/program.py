"""CPU smoke for art-mega's launchers: one rollout per host for each answer, checked end to end.

Run it with `art-mega local --program examples/multinode/program.py:main` (or `ssh`/`skypilot`).
For each answer yes/no/maybe, every host runs one rollout in its own worker process; the program
checks the answers come back in order, with the expected rewards, each from its own process.
It uses `art_mega.distributed` as ART's documented `examples/multinode/program.py` does
(`launch.host_mesh`, an executor used without await, `set_workers`); unlike it, it allows hosts
that share a kernel (the test launchers' network-namespace hosts). ART's program itself, changed
only in its import, is `tests/art_compat/multinode_program.py`.
"""

from __future__ import annotations

import asyncio
import os
import socket

from art_mega import Trajectory, TrajectoryGroup
from art_mega.distributed import ArtLaunchContext, ArtRuntime, InstalledAsyncCallable, compile_topology

ANSWERS = ("yes", "no", "maybe")
REWARDS = {"yes": 0.5, "no": 0.75, "maybe": 1.0}


async def answer_rollout(answer: str) -> Trajectory:
    """A rollout that 'answers' and records where it ran (hostname, pid)."""
    return Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "Answer yes, no or maybe."},
            {"role": "assistant", "content": answer},
        ],
        reward=REWARDS[answer],
        metadata={"hostname": socket.gethostname(), "pid": os.getpid()},
    )


async def main(launch: ArtLaunchContext) -> None:
    cluster = launch.homogeneous_cluster(cpu_slots=1, allow_shared_kernel=True)
    runtime = await ArtRuntime.start(launch.host_mesh, compile_topology(cluster=cluster))
    try:
        workers = tuple(range(launch.host_count))
        executor = runtime.rollout_executor(
            InstalledAsyncCallable.from_callable(answer_rollout), target_workers=launch.host_count
        )
        executor.set_workers(workers)
        groups = []
        for answer in ANSWERS:
            trajectories = await asyncio.gather(*(executor.run(w, answer_rollout, answer) for w in workers))
            groups.append(TrajectoryGroup(trajectories))
        if len({w.host_id for w in executor.workers}) != launch.host_count:
            raise RuntimeError(f"expected one worker per host, got {executor.workers}")
        for answer, group in zip(ANSWERS, groups):
            for worker, trajectory in zip(executor.workers, group.trajectories):
                said = trajectory.messages()[-1]["content"]
                if said != answer or trajectory.reward != REWARDS[answer]:
                    raise RuntimeError(
                        f"worker {worker.index} answered {said!r} ({trajectory.reward}) for {answer!r}"
                    )
                if trajectory.metadata["pid"] != worker.pid or trajectory.metadata["pid"] == os.getpid():
                    raise RuntimeError(
                        f"worker {worker.index} ran in pid {trajectory.metadata['pid']}, expected {worker.pid}"
                    )
        pids = {t.metadata["pid"] for g in groups for t in g.trajectories}
        if len(pids) != launch.host_count:
            raise RuntimeError(f"expected {launch.host_count} distinct worker processes, saw {sorted(pids)}")
        said = [g.trajectories[0].messages()[-1]["content"] for g in groups]
        print(f"ART_MULTINODE_SMOKE_PASS hosts={launch.host_count} answers={said}", flush=True)
    finally:
        await runtime.close()
