"""`art-mega plan` on published configs (config.json only, no torch, no GPU): the figures it prints
are checked against counts done by hand here, the layouts it lists against the budget, and a
layout that does not fit is refused with one sentence and exit code 2. A Hugging Face repo id is
read from an offline HF cache holding only its config.json."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from art_mega.launch.cli import main
from art_mega.trainer.families import family_for
from art_mega.trainer.prepare.memory_plan import ModelShape
from art_mega.trainer.prepare.stated_layout import GPU_MEMORY_MIB
from tests.real_size_configs import CONFIGS
from tests.trainer.gpt_oss_configs import GPT_OSS_120B, GPT_OSS_PARAMETERS
from tests.trainer.qwen3_5_configs import QWEN3_6_27B

GIB = 1 << 30
PUBLISHED = {
    "Llama-3.3-70B": CONFIGS["Llama-3.1-70B"],  # the same architecture as Llama-3.1-70B
    "Qwen3-32B": CONFIGS["Qwen3-32B"],
    "Qwen3-30B-A3B": CONFIGS["Qwen3-30B-A3B"],
    "gpt-oss-120b": GPT_OSS_120B,
    "Qwen3.6-27B": QWEN3_6_27B,
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("configs")
    for name, config in PUBLISHED.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return root


def run_plan(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def figure(out: str, label: str, section: str = "trainer rank") -> float:
    """The GiB printed on the line `label` of the section starting with `section`."""
    body = out[out.index(section) :]
    return float(re.search(rf"^  {re.escape(label)}\s+([0-9.]+)", body, re.M)[1])


def test_llama_33_70b_on_two_h100_nodes_by_hand(configs, capsys):
    """Llama-3.3-70B, trainer tp=8 on host1's 8 H100s, 4 replicas of 2 GPUs on host0."""
    code, out, err = run_plan(
        capsys, str(configs / "Llama-3.3-70B"), "--gpu", "H100-80GB", "--gpus", "8", "--hosts", "2",
        "--tp", "8", "--replicas", "4", "--inference-tp", "2",
    )  # fmt: skip
    assert code == 0, err
    h, layers, vocab = 8192, 80, 128256
    # a rank: vocab/8 rows of embedding and LM head; a layer: QKV h x (64 + 2 x 8) x 128 / 8, proj,
    # two norms, SwiGLU MLP 3 x h x 28672 / 8; the final norm; bfloat16
    layer = h * 80 * 128 // 8 + 64 * 128 // 8 * h + 2 * h + 3 * h * 28672 // 8
    weights = (2 * (vocab // 8) * h + layers * layer + h) * 2
    assert figure(out, "weights") == round(weights / GIB, 1) == 16.4
    # the replica: all 70,553,706,496 parameters in bfloat16 over its 2 GPUs, 0.9 of 2 x 81,559 MiB
    assert figure(out, "weights", "vLLM replica") == round(70_553_706_496 * 2 / GIB, 1)
    assert "of 143.4 GiB at gpu_memory_utilization 0.9" in out  # 0.9 x 2 x 81559 MiB
    # KV cache of one 4096-token sequence: 2 x 80 layers x 8 KV heads x 128 x 2 bytes a token
    assert figure(out, "KV cache, one full sequence", "vLLM replica") == round(
        2 * 80 * 8 * 128 * 2 * 4096 / GIB, 1
    )
    assert "8 trainer rank(s) and 4 replica(s)" in out
    # full recomputation keeps far less than none (one layer's input a layer, plus one layer)
    assert figure(out, "activations, full recomputation") < figure(out, "activations, no recomputation") / 4
    fits = re.search(r"that fit: (.*)$", out, re.M)[1]
    # 4096-token rows at tp=4 need two pipeline stages (half the layers' activations and weights)
    assert "--tp 8 (dp=1)" in fits and "--tp 4 --pp 2 (dp=1)" in fits and "--tp 4 (dp=2)" not in fits
    assert "--tp 1 " not in fits


@pytest.mark.parametrize(
    ("name", "args", "parameters"),
    [
        ("Qwen3-32B", ["--gpu", "H100-80GB", "--gpus", "8", "--tp", "4", "--replicas", "2", "--recompute", "full", "--inference-tp", "2"],
         32_762_123_264),
        ("Qwen3-30B-A3B", ["--gpu", "H100-80GB", "--gpus", "8", "--ep", "4", "--recompute", "full", "--inference-tp", "4"], 30_532_122_624),
        ("gpt-oss-120b", ["--gpu", "H100-80GB", "--gpus", "8", "--hosts", "2", "--ep", "8", "--recompute", "full", "--inference-tp", "8"],
         GPT_OSS_PARAMETERS["gpt-oss-120b"]),
        # megatron-core builds 26,895,998,464 on the meta device (tests/trainer/test_qwen3_5_family.py)
        ("Qwen3.6-27B", ["--gpu", "A100-80GB", "--gpus", "8", "--tp", "4", "--replicas", "2", "--recompute", "full", "--inference-tp", "2"],
         26_895_998_464),
    ],
)  # fmt: skip
def test_published_configs_print_plans(configs, capsys, name, args, parameters):
    code, out, err = run_plan(capsys, str(configs / name), *args)
    assert code == 0, err
    assert f"{parameters / 1e9:.2f}B parameters" in out
    total = figure(out, "total")
    available = float(re.search(r"total\s+[0-9.]+\s+of ([0-9.]+) GiB", out)[1])
    assert total <= available
    # every listed layout is within the GPU's memory, and the stated one is among them
    listed = re.findall(r"\(dp=\d+\) \(([0-9.]+) GiB\)", out)
    assert listed and all(float(n) <= available for n in listed)


def test_gpt_oss_replica_keeps_experts_in_mxfp4(configs, capsys):
    code, out, _ = run_plan(capsys, str(configs / "gpt-oss-120b"), "--gpu-memory-gib", "80", "--gpus", "8",
                            "--hosts", "2", "--ep", "8", "--recompute", "full", "--inference-tp", "8")  # fmt: skip
    assert code == 0
    shape = ModelShape.from_args(family_for(GPT_OSS_120B).model_args(GPT_OSS_120B))
    experts = 36 * 128 * (3 * 2880 * 2880 + 2 * 2880 + 2880)  # gate_up, down and their biases
    assert shape.expert_parameters() == experts
    expected = (shape.parameters() - experts) * 2 + experts * 17 / 32  # 4-bit codes + a scale a 32
    assert figure(out, "weights", "vLLM replica") == round(expected / GIB, 1)
    assert "(experts in MXFP4)" in out


def test_a_layout_that_does_not_fit_is_one_sentence(configs, capsys):
    """Qwen3-32B at tp=1 on 4 A100-40GB (8 less 2 replicas of 2): the weights alone are 61 GiB."""
    code, out, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu", "A100-40GB", "--gpus", "8",
                              "--replicas", "2", "--inference-tp", "2", "--seq-len", "2048")  # fmt: skip
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "trainer rank 0 does not fit: it needs" in lines[0]
    needed, has = map(float, re.search(r"needs ([0-9.]+) GiB and has ([0-9.]+) GiB", lines[0]).groups())
    assert needed > 32_762_123_264 * 2 / GIB and has == 40.0
    # tp=2 holds 30.5 GiB of weights plus 2048-token activations of 64 layers: over 40 GiB
    assert lines[0].endswith("layouts that fit: --tp 4 (dp=1)")


def test_a_replica_that_does_not_fit_names_inference_tps(configs, capsys):
    code, _, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu", "H100-80GB", "--gpus", "8",
                            "--tp", "4", "--replicas", "4", "--inference-tp", "1", "--max-model-len", "40960")  # fmt: skip
    assert code == 2
    assert "replica vllm/0 does not fit" in err and "--inference-tp 2" in err


def test_bad_input_is_one_sentence(configs, capsys):
    code, _, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu", "Z9000", "--gpus", "8")
    assert code == 2 and "--gpu 'Z9000' is not a GPU art-mega knows" in err and "H100-80GB" in err
    code, _, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu", "H100-80GB", "--tp", "3")
    assert code == 2 and "--tp 3 does not divide" in err
    code, _, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu", "H100-80GB", "--ep", "2")
    assert code == 2 and "needs an MoE model" in err
    code, _, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu-memory-utilization", "1.5")
    assert code == 2 and "0 < fraction <= 1" in err


def test_known_gpus_are_nvml_totals():
    assert GPU_MEMORY_MIB["H100-80GB"] == 81_559 and GPU_MEMORY_MIB["A100-40GB"] == 40_960


def test_a_hub_id_reads_an_offline_cache_with_only_config_json(tmp_path):
    """Qwen/Qwen3-32B from an HF cache laid out as huggingface_hub lays it, HF_HUB_OFFLINE=1, in
    a fresh process (huggingface_hub reads its environment at import)."""
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-32B"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIGS["Qwen3-32B"]))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    command = [
        sys.executable,
        "-m",
        "art_mega",
        "plan",
        "Qwen/Qwen3-32B",
        "--gpu",
        "H100-80GB",
        "--tp",
        "2",
        "--replicas",
        "2",
        "--recompute",
        "full",
    ]
    proc = subprocess.run(command, env={**env, "PYTHONPATH": str(Path(__file__).parents[3])},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "32.76B parameters" in proc.stdout
    missing = subprocess.run([*command[:4], "Qwen/Qwen3-8B", *command[5:]], env={**env, "PYTHONPATH": str(Path(__file__).parents[3])},
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "config.json is neither in the Hugging Face cache nor downloadable" in missing.stderr


def test_without_gpus_the_plan_is_of_cpu_ranks_in_float32(configs, capsys, monkeypatch):
    """No --gpu and no NVML GPU: CPU ranks (float32, as the backend trains on CPU), printed, never refused."""
    monkeypatch.setattr("art_mega.launch.plan.local_gpus", lambda: (0, None, None))
    code, out, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--seq-len", "1024")
    assert code == 0, err
    assert "on 1 CPU host(s)" in out and "trainer rank 0 (float32," in out
    assert figure(out, "weights") == round(32_762_123_264 * 4 / GIB, 1)
    assert "of CPU memory" in out and "layouts" not in out


def test_shared_gpus_list_only_layouts_that_leave_the_replica_its_share(configs, capsys):
    """Qwen3-32B on 8 H100s beside a replica (--shared-gpus, gpu_memory_utilization 0.9): a rank
    keeps 8.0 GiB, so tp=8's 7.6 GiB of weights plus reserve does not fit, and no layout is offered
    (the list once held every layout that fits a whole GPU, tp=8 included: found by running
    Qwen2.5-32B's config through `art-mega plan`)."""
    code, out, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu", "H100-80GB", "--gpus", "8",
                              "--tp", "8", "--shared-gpus")  # fmt: skip
    assert code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert re.search(r"it needs [0-9.]+ GiB and has 8\.0 GiB", line), line
    assert line.endswith("layouts that fit: none on these GPUs"), line
    # at 0.7 a rank keeps 23.9 GiB: tp=2's 30.5 GiB of weights no longer fit beside the replica,
    # but half or a quarter of them on a pipeline stage do
    code, out, err = run_plan(capsys, str(configs / "Qwen3-32B"), "--gpu", "H100-80GB", "--gpus", "8", "--tp", "8",
                              "--shared-gpus", "--inference-tp", "2", "--gpu-memory-utilization", "0.7")  # fmt: skip
    assert code == 0, err
    assert out.strip().splitlines()[-1] == (
        "trainer layouts of these 8 GPU(s) that fit: --tp 2 --pp 2 (dp=2) (70.2 GiB), --tp 2 --pp 4 (dp=1) "
        "(62.8 GiB), --tp 4 (dp=2) (53.5 GiB), --tp 4 --pp 2 (dp=1) (41.8 GiB), --tp 8 (dp=1) (33.5 GiB)"
    )


def test_the_plan_counts_the_models_default_lora(configs, capsys):
    """Qwen3.6-27B's default LoRA (ART's) also adapts its 48 delta-net layers' in_proj_qkv,
    in_proj_z and out_proj: at r=8, 14,548,992 more parameters than q/k/v/o and the MLP alone at
    TP=1 (the plan counted neither before)."""
    from art_mega.trainer.families import lora_names_of
    from art_mega.trainer.prepare.memory_plan import ModelShape

    code, out, err = run_plan(
        capsys, str(configs / "Qwen3.6-27B"), "--gpu", "H100-80GB", "--gpus", "8", "--tp", "4", "--inference-tp", "4"
    )
    assert code == 0, err
    shape, _ = ModelShape.from_model_dir(configs / "Qwen3.6-27B")
    default = lora_names_of(QWEN3_6_27B).default_targets
    assert "in_proj_qkv" in default
    delta = shape.lora_parameters(8, default, tp=4) - shape.lora_parameters(8, default[:4], tp=4)
    assert delta == 8 * 48 * (5120 + 10240 // 4 + 5120 + 6144 // 4 + 6144 // 4 + 5120)
    assert f"({shape.lora_parameters(8, default, tp=4):,} LoRA parameters" in out
