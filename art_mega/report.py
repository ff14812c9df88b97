"""Plots of a run directory: reward (mean with a std band), loss, KL, grad norm, step-time split.

`write_report(run_dir)` reads `run_dir/history.jsonl` and writes PNGs into `run_dir/report/`;
`art-mega report RUN_DIR` does the same and prints a short table. matplotlib is imported lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from art_mega.errors import UserError
from art_mega.metrics import read_history

TIME_PARTS = ("time/rollout_s", "time/train_s", "time/publish_s")


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def _first_key(rows: Sequence[dict[str, Any]], candidates: Sequence[str]) -> str | None:
    keys = {k for r in rows for k in r}
    return next((c for c in candidates if c in keys), None)


def summary(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(label, value) pairs: steps, first/last train and val reward, mean step time."""
    out = [("steps logged", str(len({r["step"] for r in rows})))]
    for split in ("train", "val"):
        steps, values = _series(rows, f"{split}/reward")
        if values:
            out.append((f"{split}/reward at step {steps[0]}", f"{values[0]:.4f}"))
            out.append((f"{split}/reward at step {steps[-1]}", f"{values[-1]:.4f}"))
    totals = [sum(float(r.get(k, 0.0)) for k in TIME_PARTS) for r in rows if any(k in r for k in TIME_PARTS)]
    if totals:
        out.append(("mean step time (s)", f"{sum(totals) / len(totals):.2f}"))
    return out


def write_report(run_dir: str | Path) -> list[Path]:
    """Write the PNG plots for `run_dir`; return their paths.

    Raises:
        UserError: `run_dir/history.jsonl` does not exist or has no rows.
    """
    folder = Path(run_dir)
    rows = read_history(folder / "history.jsonl")
    if not rows:
        raise UserError(f"{folder}/history.jsonl does not exist or is empty; pass a model's run directory")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = folder / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for split, color in (("train", "tab:blue"), ("val", "tab:orange")):
        steps, mean = _series(rows, f"{split}/reward")
        if not steps:
            continue
        ax.plot(steps, mean, marker="o", color=color, label=f"{split} reward")
        std_steps, std = _series(rows, f"{split}/reward_std_dev")
        if std_steps == steps:
            ax.fill_between(
                steps,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=color,
                alpha=0.2,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend()
    save(fig, "reward.png")

    plots = (
        ("loss.png", ("loss/train", "train/loss", "loss")),
        ("kl.png", ("loss/kl_div", "train/kl", "kl")),
        ("grad_norm.png", ("loss/grad_norm", "train/grad_norm", "grad_norm")),
    )
    for name, candidates in plots:
        key = _first_key(rows, candidates)
        if key is None:
            continue
        steps, values = _series(rows, key)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, values, marker="o")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        save(fig, name)

    timed = [r for r in rows if any(k in r for k in TIME_PARTS)]
    if timed:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps = [int(r["step"]) for r in timed]
        bottom = [0.0] * len(timed)
        for key in TIME_PARTS:
            values = [float(r.get(key, 0.0)) for r in timed]
            ax.bar(steps, values, bottom=bottom, label=key.split("/")[1].removesuffix("_s"))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend()
        save(fig, "step_time.png")
    return written
