"""Plots of a run directory: reward, loss, KL, grad norm and the step-time split.

`write_report(run_dir)` reads `run_dir/history.jsonl` and writes PNGs into `run_dir/report/`;
`art-mega report RUN_DIR` does the same and prints a short table. matplotlib is imported lazily.

Every plot has a title, axis labels with units, and integer step ticks. A series is drawn over
the steps of its split's rows, with a gap (not a line) where a row lacks the value, and a
marker at every point so a lone value still shows. The reward band is mean +- the mean
within-group std, clipped to the step's lowest and highest reward (`{split}/reward_min`,
`{split}/reward_max`) when the row has them: a band never claims rewards nobody got.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from art_mega.errors import UserError
from art_mega.metrics import read_history

PLOTS = (
    # file, title, y label, candidate keys (the first one the history holds is drawn)
    ("loss.png", "Training loss", "loss", ("loss/train", "train/loss")),
    (
        "kl.png",
        "KL divergence of the policy from the reference",
        "KL (nats per token)",
        ("loss/kl_div", "loss/kl_policy_ref", "train/kl"),
    ),
    ("grad_norm.png", "Gradient norm before clipping", "L2 norm", ("loss/grad_norm", "train/grad_norm")),
)
"""The line plots besides reward.png and step_time.png; each is written when the history logs
one of its keys (kl.png: the KL loss term's `loss/kl_div`, else `loss/kl_policy_ref`)."""

ROLLOUT_KEYS = ("time/step_actor_s", "time/rollout_s")
"""Rollout seconds of a train row: the library's own (`gather_trajectory_groups`' time,
`metrics.gather_seconds`), else an older program's `time/rollout_s`."""
TRAINER_PARTS = ("time/prepare_s", "time/train_s", "time/publish_s")


def _value(row: dict[str, Any], keys: Sequence[str]) -> float | None:
    for key in keys:
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None


def _split_rows(rows: Sequence[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The rows of `split` (those holding a `{split}/...` key), one per step (the last)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if any(key.startswith(f"{split}/") for key in row):
            by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[step] for step in sorted(by_step)]


def _train_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of training steps: train rows, and rows with a loss (an SFT or metrics-only step)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if any(key.startswith(("train/", "loss/")) for key in row):
            by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[step] for step in sorted(by_step)]


def _trainer_seconds(row: dict[str, Any]) -> float | None:
    total = _value(row, ("time/step_trainer_s",))
    if total is not None:
        return total
    parts = [float(row[key]) for key in TRAINER_PARTS if isinstance(row.get(key), (int, float))]
    return sum(parts) if parts else None


def step_seconds(row: dict[str, Any]) -> float | None:
    """A train row's step time in seconds: `time/step_wall_s` (the wall time since the previous
    train row), else rollout + trainer seconds; None when the row has neither."""
    wall = _value(row, ("time/step_wall_s",))
    if wall is not None:
        return wall
    parts = [v for v in (_value(row, ROLLOUT_KEYS), _trainer_seconds(row)) if v is not None]
    return sum(parts) if parts else None


def summary(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(label, value) pairs: steps logged, first/last train and val reward, trained tokens,
    and the median step time over the train rows (seconds; the median because the first row's
    wall time also counts the start-up)."""
    out = [("steps logged", str(len({r["step"] for r in rows})))]
    for split in ("train", "val"):
        points = [(r["step"], r[f"{split}/reward"]) for r in _split_rows(rows, split) if f"{split}/reward" in r]
        if points:
            out.append((f"{split}/reward at step {points[0][0]}", f"{points[0][1]:.4f}"))
            out.append((f"{split}/reward at step {points[-1][0]}", f"{points[-1][1]:.4f}"))
    train = _train_rows(rows)
    tokens = [float(r["data/step_trainer_tokens"]) for r in train if "data/step_trainer_tokens" in r]
    if tokens:
        out.append(("trained tokens (all steps)", f"{sum(tokens):.0f}"))
    times = [t for t in (step_seconds(r) for r in train) if t is not None]
    if times:
        out.append(("median step time (s)", f"{statistics.median(times):.2f}"))
    return out


def _axes(plt: Any, title: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return fig, ax


def _step_axis(ax: Any, steps: Sequence[int]) -> None:
    """Integer ticks over `steps`, half a step of margin (one lone point too)."""
    if steps:
        ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        if max(steps) - min(steps) <= 12:
            ax.set_xticks(range(min(steps), max(steps) + 1))


def write_report(run_dir: str | Path) -> list[Path]:
    """Write the PNG plots of `figures` for `run_dir` into `run_dir/report/`; return their paths.

    Raises:
        UserError: `run_dir/history.jsonl` does not exist or has no rows.
    """
    folder = Path(run_dir)
    rows = read_history(folder / "history.jsonl")
    if not rows:
        raise UserError(f"{folder}/history.jsonl does not exist or is empty; pass a model's run directory")
    import matplotlib.pyplot as plt

    out_dir = folder / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, fig in figures(rows).items():
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def figures(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report's matplotlib figures of history `rows`, by file name: reward.png (when a
    reward is logged), loss.png, kl.png and grad_norm.png (each when its metric is logged, see
    `PLOTS`), step_time.png (when a train row has timings). The caller closes them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, Any] = {}

    def save(fig: Any, name: str) -> None:
        out[name] = fig

    nan = math.nan
    fig, ax = _axes(plt, "Reward per step (mean, band: +- within-group std)", "reward")
    drawn = False
    for split, color in (("train", "tab:blue"), ("val", "tab:orange")):
        split_rows = [r for r in _split_rows(rows, split) if f"{split}/reward" in r]
        if not split_rows:
            continue
        drawn = True
        steps = [int(r["step"]) for r in split_rows]
        mean = [float(r[f"{split}/reward"]) for r in split_rows]
        ax.plot(steps, mean, marker="o", color=color, label=f"{split} reward")
        std = [_value(r, (f"{split}/reward_std_dev",)) for r in split_rows]
        if any(s is not None for s in std):
            low = [nan if s is None else m - s for m, s in zip(mean, std)]
            high = [nan if s is None else m + s for m, s in zip(mean, std)]
            for i, row in enumerate(split_rows):
                lowest, highest = _value(row, (f"{split}/reward_min",)), _value(row, (f"{split}/reward_max",))
                if lowest is not None:
                    low[i] = max(low[i], lowest)
                if highest is not None:
                    high[i] = min(high[i], highest)
            ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
    if drawn:
        _step_axis(ax, sorted({int(r["step"]) for r in rows if any(k.endswith("/reward") for k in r)}))
        ax.legend()
        save(fig, "reward.png")
    else:
        plt.close(fig)

    train = _train_rows(rows)
    train_steps = [int(r["step"]) for r in train]
    for name, title, ylabel, candidates in PLOTS:
        key = next((k for k in candidates if any(k in r for r in train)), None)
        if key is None:
            continue
        values = [float(r[key]) if isinstance(r.get(key), (int, float)) else nan for r in train]
        fig, ax = _axes(plt, title, f"{ylabel}\n[{key}]")
        ax.plot(train_steps, values, marker="o")  # NaN: a gap, not a line across it
        _step_axis(ax, train_steps)
        save(fig, name)

    timed = [r for r in train if step_seconds(r) is not None]
    if timed:
        fig, ax = _axes(plt, "Time per training step", "seconds")
        steps = [int(r["step"]) for r in timed]
        rollout = [_value(r, ROLLOUT_KEYS) or 0.0 for r in timed]
        trainer = [_trainer_seconds(r) or 0.0 for r in timed]
        other = [max(0.0, (step_seconds(r) or 0.0) - a - b) for r, a, b in zip(timed, rollout, trainer)]
        bottom = [0.0] * len(timed)
        for label, values in (("rollouts", rollout), ("trainer", trainer), ("other (start-up, validation, logging)", other)):
            if any(values):
                ax.bar(steps, values, bottom=bottom, label=label)
                bottom = [b + v for b, v in zip(bottom, values)]
        _step_axis(ax, steps)
        ax.legend()
        save(fig, "step_time.png")
    return out
