"""The benchmark harness: RESULTS.md keeps one table and its notes, run_all skips what is missing,
the memory benchmark reads real /proc figures."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _results  # noqa: E402
import memory  # noqa: E402
import run_all  # noqa: E402


def _row(name: str, value: str, command: str = "python benchmarks/executor.py") -> tuple[str, ...]:
    return (name, value, "ms", "cpu x2, Linux, py3.11.7", "2026-01-02", command)


def test_record_replaces_by_name_keeps_others_and_notes(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Old title\n\nold text\n\n## Notes\n\n- target: p50 < 2 ms\n")
    _results.record([_row("a", "1"), _row("b|c", "2")], path)
    _results.record([_row("a", "3"), _row("d", "4", "python benchmarks/launch.py")], path)
    rows = _results.read_rows(path)
    assert [(r[0], r[1]) for r in rows] == [("a", "3"), ("b|c", "2"), ("d", "4")]
    text = path.read_text()
    assert text.count(_results.HEADER_LINE) == 1
    assert "b\\|c" in text and "old text" not in text
    assert text.endswith("## Notes\n\n- target: p50 < 2 ms\n")


def test_rewrite_orders_rows_by_script(tmp_path):
    path = tmp_path / "RESULTS.md"
    _results.record(
        [
            _row("launch", "1", "python benchmarks/launch.py"),
            _row("gpu row", "2", "bash scripts/device_check.sh"),
            _row("run p50", "3"),
            _row("run p99", "4"),
        ],
        path,
    )
    _results.rewrite(["executor.py", "launch.py"], path)
    assert [r[0] for r in _results.read_rows(path)] == ["run p50", "run p99", "launch", "gpu row"]


def test_rows_for_formats_values_and_machine():
    (row,) = _results.rows_for([("x", 0.0012345, "s")], "cmd", machine_name="gpu NVIDIA H200, cpu x16")
    assert row[:4] == ("x", "0.00123", "s", "gpu NVIDIA H200, cpu x16") and row[5] == "cmd"
    assert _results.fmt(1234.6) == "1235" and _results.fmt(31.04) == "31"
    assert _results.machine("gpu", "NVIDIA H200").startswith("gpu NVIDIA H200, cpu x")


def test_run_all_skips_missing_scripts_and_the_real_model_unless_asked(tmp_path):
    for name in ("executor.py", "grpo_real.py"):
        (tmp_path / name).write_text("")
    runs, skipped = run_all.commands(quick=True, with_real_model=False, folder=tmp_path)
    assert [Path(r[1]).name for r in runs] == ["executor.py"]
    assert runs[0][2:] == ["--record", "--quick"]
    assert any(s.startswith("adapter_publish.py (not in") for s in skipped)
    assert any(s.startswith("grpo_real.py (the real-model run") for s in skipped)
    runs, _ = run_all.commands(quick=False, with_real_model=True, folder=tmp_path)
    assert [r[2:] for r in runs] == [["--record"], ["--run", "--record"]]


def test_memory_reads_peaks_of_a_real_process_tree():
    # a child that holds ~64 MB resident, named like a rollout worker
    code = "import time; b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code, "art_mega.rollouts.worker"])
    try:
        deadline = time.monotonic() + 20
        while memory.peak_rss_bytes(child.pid) < 64 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.1)
        peaks = memory.peaks_below(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert len(peaks["rollout worker"]) == 1
    assert 64 * 2**20 <= peaks["rollout worker"][0] < 200 * 2**20
    assert memory.peak_rss_bytes(child.pid) == 0  # gone


def test_memory_figures_from_program_output():
    lines = [
        "noise",
        memory.MARK + json.dumps({"stage": "start", "peaks": {"controller": [120e6], "agent": [80e6]}}),
        memory.MARK
        + json.dumps({"stage": "rollout", "peaks": {"controller": [1], "rollout worker": [50e6, 60e6]}}),
        memory.MARK
        + json.dumps(
            {
                "stage": "train",
                "layout": "TP2",
                "peaks": {"controller": [1], "trainer rank": [300e6, 310e6], "vLLM replica": [2e9]},
            }
        ),
    ]
    figures = {name: value for name, value, unit in memory.figures_from("\n".join(lines))}
    assert figures == {
        "peak RSS controller at program start (target < 300)": pytest.approx(120.0),
        "peak RSS agent at program start (target < 150)": pytest.approx(80.0),
        "peak RSS rollout worker (after 100 calls)": pytest.approx(60.0),
        "peak RSS trainer rank, tiny model, TP2 (max over ranks)": pytest.approx(310.0),
    }
