import json
import math

import pytest

from art_mega.report import figures, summary, write_report
from tests.conftest import run_cli


def make_run(tmp_path, steps=3, kl=True):
    """History rows named as a real LocalBackend run writes them (see the quickstart's
    history.jsonl): val rows at steps 0 and `steps`, a train row per step, one without a loss."""
    rows = [{"step": 0, "val/reward": 0.47, "val/reward_std_dev": 0.42, "val/reward_min": 0.0, "val/reward_max": 1.0}]
    for step in range(steps):
        row = {
            "step": step,
            "train/reward": 0.36 + 0.3 * step,
            "train/reward_std_dev": 0.37,
            "train/reward_min": 0.1 + 0.3 * step,
            "train/reward_max": min(1.0, 0.7 + 0.3 * step),
            "loss/train": -0.5 + 0.1 * step,
            "loss/grad_norm": 1.8,
            "time/step_actor_s": 60.0 + step,
            "time/step_trainer_s": 15.0,
            "time/step_wall_s": [220.0, 81.0, 79.0, 90.0][step],
            "data/step_trainer_tokens": 300.0,
        }
        if kl:
            row["loss/kl_policy_ref"] = 0.01 * step
        if step == 1:
            del row["loss/train"]  # a step whose loss was not logged: a gap, not a line across it
        rows.append(row)
    rows.append({"step": steps, "val/reward": 1.0, "val/reward_std_dev": 0.0})
    (tmp_path / "history.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_report_writes_every_plot_and_kl_when_kl_is_logged(tmp_path):
    make_run(tmp_path)
    paths = write_report(tmp_path)
    assert sorted(p.name for p in paths) == ["grad_norm.png", "kl.png", "loss.png", "reward.png", "step_time.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000 for p in paths)
    without_kl = tmp_path / "nokl"
    without_kl.mkdir()
    make_run(without_kl, kl=False)
    assert "kl.png" not in [p.name for p in write_report(without_kl)]


def test_every_plot_has_a_title_units_and_integer_step_ticks(tmp_path):
    rows = make_run(tmp_path, steps=2)  # a short run: matplotlib alone would tick 0.25, 0.5, ...
    for name, fig in figures(rows).items():
        ax = fig.axes[0]
        assert ax.get_title(), name
        assert ax.get_xlabel() == "step" and ax.get_ylabel(), name
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), (name, ticks)
    assert figures(rows)["kl.png"].axes[0].get_ylabel().startswith("KL (nats per token)")
    assert figures(rows)["step_time.png"].axes[0].get_ylabel() == "seconds"


def test_the_reward_band_stays_within_the_rewards_of_each_step(tmp_path):
    rows = make_run(tmp_path)
    ax = figures(rows)["reward.png"].axes[0]
    bands = ax.collections
    assert len(bands) == 2  # train and val
    train_band = bands[0].get_paths()[0].vertices
    limits = {r["step"]: (r["train/reward_min"], r["train/reward_max"]) for r in rows if "train/reward_min" in r}
    for x, y in train_band:
        if not math.isfinite(y) or round(x) != x or int(x) not in limits:
            continue
        lowest, highest = limits[int(x)]
        assert lowest - 1e-9 <= y <= highest + 1e-9, (x, y)
    # mean + std of step 2 is 0.96 + 0.37 = 1.33; the step's best reward, 1.0, caps it
    assert max(y for _, y in train_band if math.isfinite(y)) == pytest.approx(1.0)


def test_a_step_without_a_value_is_a_gap(tmp_path):
    rows = make_run(tmp_path)
    line = figures(rows)["loss.png"].axes[0].lines[0]
    assert list(line.get_xdata()) == [0, 1, 2]
    assert math.isnan(line.get_ydata()[1]) and not math.isnan(line.get_ydata()[0])


def test_step_time_splits_rollouts_trainer_and_the_rest_and_the_summary_matches(tmp_path):
    rows = make_run(tmp_path)
    ax = figures(rows)["step_time.png"].axes[0]
    heights = {
        container.get_label(): [bar.get_height() for bar in container] for container in ax.containers
    }
    assert heights["rollouts"] == [60.0, 61.0, 62.0] and heights["trainer"] == [15.0, 15.0, 15.0]
    assert heights["other (start-up, validation, logging)"] == pytest.approx([145.0, 5.0, 2.0])
    table = dict(summary(rows))
    assert table["train/reward at step 0"] == "0.3600" and table["train/reward at step 2"] == "0.9600"
    assert table["val/reward at step 3"] == "1.0000"
    assert table["trained tokens (all steps)"] == "900"
    assert table["median step time (s)"] == "81.00"  # of 220, 81 and 79 s: the wall time between train rows


def test_report_cli(tmp_path):
    make_run(tmp_path)
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "val/reward at step 3" in result.stdout and "reward.png" in result.stdout
    missing = run_cli("report", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "history.jsonl does not exist" in missing.stderr
