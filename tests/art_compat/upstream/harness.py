"""Run a program taken from ART's repositories as its notebook runs it, and stop it after a few
training steps.

The program file is compiled with top-level `await` allowed (`ast.PyCF_ALLOW_TOP_LEVEL_AWAIT`, as
Jupyter runs a cell) and run in this process as `__main__`. Real programs ask for 10 to 1,000
steps; the run is bounded from here, never by editing the program: `MegatronBackend.train` (which
both `model.train` and ART 0.5.23's `backend.train(model, groups)` reach) is wrapped to record each
step's `TrainResult`, and once `steps` steps have trained, the program's next call of
`art.gather_trajectory_groups`, `art.gather_trajectories` or of a train raises `ProgramStopped` (a
BaseException, so the program's own `except Exception` lets it through). Each backend the program
built is closed afterwards (notebooks never close theirs).
"""

from __future__ import annotations

import ast
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UPSTREAM = Path(__file__).resolve().parent


class ProgramStopped(BaseException):
    """Raised into the program at its first call after the steps asked for have trained."""


@dataclass
class ProgramRun:
    """What a bounded run did: the TrainResults in order, the trajectory groups each train call
    got, the program's globals, its wall time (seconds, start to stop, backend start-up included)
    and whether the harness stopped it."""

    results: list[Any] = field(default_factory=list)
    groups: list[list[Any]] = field(default_factory=list)
    namespace: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    stopped: bool = False

    @property
    def steps(self) -> list[int]:
        return [int(r.step) for r in self.results]

    @property
    def trained_tokens(self) -> list[float]:
        """`data/step_trainer_tokens` of each step (ART's name for the tokens trained)."""
        return [float(r.metrics.get("data/step_trainer_tokens", 0.0)) for r in self.results]

    def rewards(self, step: int) -> list[list[float]]:
        """The rewards of each group the program trained step `step` (1-based) on."""
        return [[t.reward for t in group.trajectories] for group in self.groups[step - 1]]


async def run_program(path: Path, monkeypatch: Any, *, steps: int = 2) -> ProgramRun:
    """Run the program at `path` until it has trained `steps` steps (or ends); see the module
    docstring. Exceptions of the program other than the harness's stop propagate (after the
    backends are closed)."""
    import art_mega
    from art_mega.backend import MegatronBackend

    run = ProgramRun()
    backends: list[Any] = []
    init, train = MegatronBackend.__init__, MegatronBackend.train

    def stop_when_done() -> None:
        if len(run.results) >= steps:
            run.stopped = True
            raise ProgramStopped(f"the program trained {steps} steps")

    def recorded_init(self: Any, *args: Any, **kwargs: Any) -> None:
        backends.append(self)
        init(self, *args, **kwargs)

    async def counted_train(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        stop_when_done()
        groups = args[0] if args else kwargs.get("trajectory_groups")
        result = await train(self, model, *args, **kwargs)
        run.groups.append(list(groups))
        run.results.append(result)
        return result

    def stopping(gather: Any) -> Any:
        @functools.wraps(gather)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            stop_when_done()
            return await gather(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(MegatronBackend, "__init__", recorded_init)
    monkeypatch.setattr(MegatronBackend, "train", counted_train)
    for name in ("gather_trajectory_groups", "gather_trajectories"):
        monkeypatch.setattr(art_mega, name, stopping(getattr(art_mega, name)))
    code = compile(path.read_text(), str(path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    run.namespace = {"__name__": "__main__", "__file__": str(path)}
    started = time.perf_counter()
    try:
        coroutine = eval(code, run.namespace)  # a coroutine when the program awaits at top level
        if coroutine is not None:
            await coroutine
    except ProgramStopped:
        pass
    finally:
        run.wall_s = time.perf_counter() - started
        for backend in backends:
            await backend.close()
    return run
