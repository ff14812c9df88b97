"""The main job's program runs unchanged under `art-mega ssh` on two namespace hosts: a trainer
rank on each host (data parallel over gloo), one vLLM replica, two GRPO steps on the tiny model."""

import re
import sys

import pytest

from tests.conftest import REPO, cli_env

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")


def test_train_example_two_steps_over_ssh(netns_cluster, tmp_path):
    from art_mega.backend import default_vllm_python
    from art_mega.errors import UserError

    try:
        vllm_python = default_vllm_python()
    except UserError as exc:
        pytest.skip(str(exc))
    cluster = netns_cluster(2)
    env = cli_env()
    env.update(
        ART_MEGA_STEPS="2",
        ART_MEGA_GROUP_SIZE="4",
        ART_MEGA_BASE_MODEL="tiny-llama",
        ART_MEGA_VLLM_PYTHON=vllm_python,
        ART_MEGA_CACHE=str(tmp_path / "cache"),
    )
    argv = [
        sys.executable,
        "-m",
        "art_mega",
        "ssh",
        "--program",
        f"{REPO}/examples/multinode/train.py:main",
        "--port",
        "22700",
    ]
    for host in cluster.hosts:
        argv += ["--host", host.ssh_alias]
    argv += [f"--ssh-arg=-F {cluster.ssh_config}", "--startup-timeout", "120"]
    result = cluster.hosts[0].run(argv, cwd=tmp_path, env=env, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ART_MEGA_TRAIN_DONE" in result.stdout
    # piped output a person reads (issue 34): the run folder, one summary line per step, plain
    # lines instead of bars (no carriage returns, no remaining-time estimate)
    out = result.stdout
    run_line = "art-mega: run folder "
    assert out.count(run_line) == 2, out[-3000:]  # at register and at close
    for step in (0, 1):  # 2 steps of the 3 the one epoch holds (12 questions, 4 a step)
        assert re.search(rf"^art-mega: step {step}/3, reward \d\.\d{{3}}, loss \S+, trained tokens [1-9]\d*, ", out, re.M)
    assert "\r" not in out and "━" not in out and "<" not in out
    assert re.search(r"^step 0: \d+/16 rollouts in \d+\.\d s, reward=", out, re.M)
    run = tmp_path / ".art" / "art-mega-quickstart" / "models" / "yes-no"
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "2"
    assert (run / "report" / "reward.png").is_file()
    assert sorted(p.name for p in (run / "logs").glob("trainer-rank*.log")) == [
        "trainer-rank0.log",
        "trainer-rank1.log",
    ]
