"""benchmarks/trainer_step.py without running a trainer: layout and step arguments, the figures
computed from rank results, the printed per-layout table."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))

import trainer_step  # noqa: E402

from art_mega.errors import UserError  # noqa: E402


def test_select_layouts_adds_the_baseline_of_each_model_in_table_order():
    assert [layout.name for layout in trainer_step.select_layouts("TP2+EP2, CP2")] == [
        "TP1",
        "CP2",
        "EP1",
        "TP2+EP2",
    ]
    assert [layout.name for layout in trainer_step.select_layouts(None)] == [
        "TP1",
        "TP2",
        "DP2",
        "CP2",
        "PP2",
        "PP2+TP2",
        "PP2+DP2",
        "EP1",
        "EP2",
        "TP2+EP2",
        "PP2+EP2",
    ]


@pytest.mark.parametrize("names", ["TP3", "TP2,tp1", ","])
def test_unknown_layout_is_a_user_error_naming_the_field(names):
    with pytest.raises(UserError, match="--layouts=.*TP1,TP2,DP2,CP2,PP2,PP2\\+TP2,PP2\\+DP2,EP1,EP2,TP2\\+EP2,PP2\\+EP2"):
        trainer_step.select_layouts(names)


def test_step_count():
    assert trainer_step.step_count(False, None) == 5
    assert trainer_step.step_count(True, None) == 2
    assert trainer_step.step_count(True, 7) == 7
    with pytest.raises(UserError, match="--steps=0"):
        trainer_step.step_count(False, 0)


def test_bad_arguments_exit_2_before_any_run(capsys):
    assert trainer_step.main(["--layouts", "PP3"]) == 2
    assert "--layouts='PP3'" in capsys.readouterr().err
    assert trainer_step.main(["--steps", "-1"]) == 2


def _rank(seconds, rss, tokens=1000):
    return {"step_seconds": seconds, "peak_rss_mb": rss, "tokens": tokens, "setup_seconds": 3.0}


def test_summary_takes_the_slowest_rank_per_step_then_the_median():
    got = trainer_step.summarise([_rank([1.0, 4.0, 2.0], 300.0), _rank([3.0, 1.0, 1.0], 350.0)])
    # per step: max(1, 3)=3, max(4, 1)=4, max(2, 1)=2 -> median 3
    assert got["step_s"] == 3.0
    assert got["tokens_per_s"] == pytest.approx(1000 / 3)
    assert (got["rss_min_mb"], got["rss_mb"]) == (300.0, 350.0)


def test_figures_and_table_give_ratios_to_the_same_models_baseline():
    layouts = trainer_step.select_layouts("TP2,EP2")
    summaries = {
        "TP1": trainer_step.summarise([_rank([0.5], 400.0)]),
        "TP2": trainer_step.summarise([_rank([1.0], 410.0), _rank([0.9], 420.0)]),
        "EP2": trainer_step.summarise([_rank([2.0], 500.0), _rank([2.0], 510.0)]),
    }  # EP1 missing: EP2 gets no ratio
    rows = {name: (value, unit) for name, value, unit in trainer_step.figures(layouts, summaries)}
    assert rows["trainer step TP2 / TP1, tiny llama"] == (2.0, "ratio")
    assert rows["trainer GRPO+LoRA step, tiny llama, TP2 (2 ranks), median"] == (1.0, "s")
    assert rows["peak RSS trainer rank, tiny llama, TP2 (2 ranks) (max over ranks)"] == (420.0, "MB")
    assert rows["trainer step throughput, tiny Qwen3-MoE, EP2 (2 ranks)"] == (500.0, "tokens/s")
    assert not any("EP2 / EP1" in name for name in rows)
    lines = trainer_step.detail_table(layouts, summaries)
    assert lines[0].split()[:2] == ["layout", "model"]
    assert lines[2].split() == ["TP2", "tiny", "llama", "2", "1.000", "2.00", "1000", "3.0", "410..420"]
    assert lines[3].split()[:4] == ["EP1", "tiny", "Qwen3-MoE", "1"] and "failed" in lines[3]
