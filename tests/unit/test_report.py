import json

from art_mega.report import summary, write_report
from tests.conftest import run_cli


def make_run(tmp_path):
    rows = []
    for step in range(4):
        rows.append(
            {
                "step": step,
                "train/reward": 0.2 * step,
                "train/reward_std_dev": 0.1,
                "loss/train": 1 - 0.1 * step,
                "loss/kl_div": 0.01 * step,
                "loss/grad_norm": 2.0,
                "time/rollout_s": 1.0,
                "time/train_s": 2.0,
                "time/publish_s": 0.5,
            }
        )
        if step % 2 == 0:
            rows.append({"step": step, "val/reward": 0.1 + 0.2 * step})
    (tmp_path / "history.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_report_writes_every_plot(tmp_path):
    rows = make_run(tmp_path)
    paths = write_report(tmp_path)
    assert sorted(p.name for p in paths) == [
        "grad_norm.png",
        "kl.png",
        "loss.png",
        "reward.png",
        "step_time.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 2000 for p in paths)
    table = dict(summary(rows))
    assert table["train/reward at step 0"] == "0.0000" and table["train/reward at step 3"] == "0.6000"
    assert table["val/reward at step 2"] == "0.5000"
    assert table["mean step time (s)"] == "3.50"


def test_report_cli(tmp_path):
    make_run(tmp_path)
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "val/reward at step 2" in result.stdout and "reward.png" in result.stdout
    missing = run_cli("report", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "history.jsonl does not exist" in missing.stderr
