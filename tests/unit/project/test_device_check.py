"""scripts/device_check.sh and benchmarks/device_check.py: argument handling and the dry run
(the GPU steps themselves run only on a machine with an NVIDIA GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "device_check.sh"
sys.path.insert(0, str(REPO / "benchmarks"))

import device_check  # noqa: E402


def _sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.parametrize(
    "args,fragment",
    [
        ((), "--log-dir DIR is required"),
        (("--log-dir",), "--log-dir needs a folder"),
        (("--log-dir", "--dry-run"), "--log-dir needs a folder"),
        (("--log-dir=",), "--log-dir is empty"),
        (("--log-dir", "/tmp/x", "--fast"), "unknown argument '--fast'"),
        (("--log-dir", str(SCRIPT)), "is a file"),
        (("--log-dir", "/tmp/x", "--steps"), "--steps needs step names"),
        (("--log-dir", f"{SCRIPT}/x"), "is not a writable folder"),
        (("--log-dir", " "), "--log-dir is empty"),
        (("--log-dir", "/tmp/x", "--steps=nccl_preflight,warp"), "unknown steps 'warp'"),
    ],
)
def test_bad_arguments_are_one_sentence_with_exit_2(args, fragment):
    result = _sh(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    prefixes = ("device_check.sh: error: ", "device_check: error: ")  # the Python side checks some
    assert len(lines) == 1 and lines[0].startswith(prefixes) and fragment in lines[0], lines
    assert result.stdout == ""


@pytest.mark.parametrize(
    "value,fragment", [("10m", "must be whole seconds"), ("00", "must be at least 1 second")]
)
def test_bad_timeout_is_refused(tmp_path, value, fragment):
    result = subprocess.run(
        ["bash", str(SCRIPT), "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "ART_MEGA_DEVICE_CHECK_TIMEOUT": value},
    )
    assert result.returncode == 2 and f"ART_MEGA_DEVICE_CHECK_TIMEOUT='{value}' {fragment}" in result.stderr


def test_dry_run_lists_every_step_and_runs_nothing(tmp_path):
    log_dir = tmp_path / "logs"
    result = _sh("--dry-run", "--log-dir", str(log_dir))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:8]] == [
        "0. install",
        "1. megatron_logits",
        "2. te_logits",
        "3. trainer_grpo",
        "4. trainer_throughput",
        "5. grpo_lora",
        "6. adapter_publish",
        "7. nccl_preflight",
    ]
    assert "600 s" in lines[-1]
    assert not log_dir.exists()
    assert "skipped (--skip-install)" in _sh("--dry-run", "--skip-install", "--log-dir", str(log_dir)).stdout


def test_python_side_arguments(tmp_path, capsys):
    args = device_check.parse_args(["--log-dir", str(tmp_path / "new"), "--record"])
    assert args.log_dir == tmp_path / "new" and args.record and not args.dry_run
    with pytest.raises(device_check.ArgumentError, match="--log-dir is empty"):
        device_check.parse_args(["--log-dir", " "])
    with pytest.raises(device_check.ArgumentError, match="is a file"):
        device_check.parse_args(["--log-dir", str(SCRIPT)])
    assert device_check.main(["--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "required: --log-dir" in err[0]
    assert device_check.main(["--dry-run", "--log-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("\n") == len(device_check.STEPS)


def test_steps_are_chosen_by_name_in_order_and_unknown_names_refused(tmp_path, capsys):
    args = device_check.parse_args(
        ["--log-dir", str(tmp_path), "--steps", "nccl_preflight, megatron_logits", "--keep-going"]
    )
    assert args.steps == ["megatron_logits", "nccl_preflight"] and args.keep_going
    assert device_check.parse_args(["--log-dir", str(tmp_path)]).steps == list(device_check.STEPS)
    with pytest.raises(
        device_check.ArgumentError, match="names unknown steps 'trainer'; choose from megatron_logits"
    ):
        device_check.parse_args(["--log-dir", str(tmp_path), "--steps", "trainer,nccl_preflight"])
    with pytest.raises(device_check.ArgumentError, match="names no step"):
        device_check.parse_args(["--log-dir", str(tmp_path), "--steps", ","])
    with pytest.raises(device_check.ArgumentError, match="combines 'all' with step names"):
        device_check.parse_args(["--log-dir", str(tmp_path), "--steps", "all,foo"])
    with pytest.raises(device_check.ArgumentError, match="given more than once"):
        device_check.parse_args(["--log-dir", str(tmp_path), "--steps", "te_logits", "--steps", "grpo_lora"])
    with pytest.raises(device_check.ArgumentError, match="unrecognized arguments: --step"):
        device_check.parse_args(["--log-dir", str(tmp_path), "--step", "te_logits"])  # no abbreviations
    # adapter_publish publishes grpo_lora's adapter: choosing it runs (and lists) both
    publish = device_check.parse_args(["--log-dir", str(tmp_path), "--steps", "adapter_publish"])
    assert publish.steps == ["grpo_lora", "adapter_publish"]
    with pytest.raises(device_check.ArgumentError, match="device_check.sh is not a writable folder"):
        device_check.parse_args(["--log-dir", f"{SCRIPT}/logs"])
    # the shell script refuses a bad --steps before it installs anything
    result = _sh("--log-dir", str(tmp_path / "logs"), "--steps", "megatron_logits,warp")
    assert result.returncode == 2 and "unknown steps 'warp'" in result.stderr and result.stdout == ""
    assert not (tmp_path / "logs").exists()


def test_a_step_whose_modules_are_missing_fails_with_its_name(tmp_path, monkeypatch):
    monkeypatch.setitem(device_check.STEPS, "te_logits", ("TE logits", ("no_such_module_art_mega",)))
    figures, failures = device_check.run_steps(tmp_path, ["te_logits"], keep_going=True)
    assert figures == []
    assert list(failures) == ["te_logits"]
    assert "te_logits needs no_such_module_art_mega" in failures["te_logits"]
    assert device_check.missing_modules("nccl_preflight") == []
