"""history.jsonl rows: the metrics ART logs for a batch of trajectory groups, and W&B mirroring.

Names follow ART's: `{split}/reward`, `{split}/reward_std_dev`, `{split}/exception_rate`,
`{split}/<metric>` (trajectory metrics, averaged over trajectories), `{split}/group_<metric>`
(group metrics, averaged over groups), plus caller metrics as given (`time/...`, `loss/...`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from art_mega.trajectories import TrajectoryGroup


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _pstd(values: list[float]) -> float:
    if not values:
        return float("nan")
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def history_row(
    groups: Iterable[TrajectoryGroup],
    split: str = "train",
    step: int = 0,
    metrics: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """One history.jsonl row for `groups` at policy `step`.

    `{split}/reward_std_dev` is the mean over groups of the population standard deviation of
    rewards within a group (the spread GRPO's advantages see). `{split}/exception_rate` is
    exceptions / (trajectories + exceptions). NaN values are left out.
    """
    groups = list(groups)
    trajectories = [t for g in groups for t in g.trajectories]
    exceptions = sum(len(g.exceptions) for g in groups)
    row: dict[str, Any] = {"step": step, "recorded_at": datetime.datetime.now(datetime.UTC).isoformat()}
    values: dict[str, float] = {
        f"{split}/reward": _mean([t.reward for t in trajectories]),
        f"{split}/reward_std_dev": _mean(
            [_pstd([t.reward for t in g.trajectories]) for g in groups if g.trajectories]
        ),
        f"{split}/exception_rate": exceptions / (len(trajectories) + exceptions)
        if trajectories or exceptions
        else 0.0,
        f"{split}/num_trajectories": float(len(trajectories)),
        f"{split}/num_groups": float(len(groups)),
    }
    names = sorted({k for t in trajectories for k in t.metrics})
    for name in names:
        values[f"{split}/{name}"] = _mean([float(t.metrics[name]) for t in trajectories if name in t.metrics])
    group_names = sorted({k for g in groups for k in g.metrics})
    for name in group_names:
        values[f"{split}/group_{name}"] = _mean([float(g.metrics[name]) for g in groups if name in g.metrics])
    for name, value in (metrics or {}).items():
        values[name if "/" in name else f"{split}/{name}"] = float(value)
    row.update({k: v for k, v in values.items() if not math.isnan(v)})
    return row


def append_history(path: Path, row: Mapping[str, Any]) -> None:
    """Append one JSON line to `path` (created with its folder), flushed and fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_history(path: Path) -> list[dict[str, Any]]:
    """All rows of a history.jsonl (empty when the file does not exist).

    Raises:
        UserError: the path is not a readable text file, or a line is not a JSON object with an
            integer "step" (names the file and line).
    """
    from art_mega.errors import UserError

    if not path.exists():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{path} cannot be read as a text file ({type(exc).__name__}); pass a run directory"
        ) from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(
                f"{path} line {number} is not valid JSON; history.jsonl holds one JSON object per line"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path} line {number} is not a JSON object with an integer 'step'")
        rows.append(row)
    return rows


class WandbMirror:
    """Mirrors history rows to Weights & Biases when `WANDB_API_KEY` is set and wandb imports."""

    def __init__(self, project: str, name: str, config: Mapping[str, Any] | None = None) -> None:
        self._run: Any = None
        if not os.environ.get("WANDB_API_KEY"):
            return
        try:
            import wandb
        except ImportError:
            print("art-mega: WANDB_API_KEY is set but wandb is not installed; logging to history.jsonl only")
            return
        self._run = wandb.init(project=project, name=name, config=dict(config or {}), reinit=True)

    def log(self, row: Mapping[str, Any]) -> None:
        if self._run is not None:
            self._run.log({k: v for k, v in row.items() if k not in ("recorded_at",)}, step=int(row["step"]))
