"""The LoRA a backend without `lora_targets` trains is the one ART 0.5.23 trains on that model
(`art/megatron/model_support/registry.py`: `default_target_modules` of the model's spec, which
`art.dev.get_model_config` puts in every model's `peft_args.target_modules`), resolved at
register from the model's config.json (`MegatronBackend._lora_targets`), and a target the model
does not have is refused there in one sentence. No torch: the published configs' JSON only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_mega.errors import UserError
from tests.real_size_configs import CONFIGS, DEEPSEEK_V3, GEMMA4_31B_TEXT, KIMI_K2
from tests.trainer.gpt_oss_configs import GPT_OSS_20B
from tests.trainer.qwen3_5_configs import QWEN3_5_35B_A3B, QWEN3_6_27B

_DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""ART's `_DENSE_TARGET_MODULES` (llama3, qwen3 dense, gemma4 dense, the default spec)."""
_QWEN3_5 = (*_DENSE[:4], "in_proj_qkv", "in_proj_z", "out_proj", *_DENSE[4:])
"""ART's `_QWEN3_5_DENSE_TARGET_MODULES` (its MoE list adds "experts", the fused experts' name)."""
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", *_DENSE[4:])
"""ART's `_GLM52_TARGET_MODULES` for its MLA models, less "experts"."""


def _model(tmp_path: Path, config: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


_PACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""ART's "experts": PEFT `target_parameters` on the fused 3-D expert weights, where the adapter
is written so (GPT-OSS; the Hub's Qwen3.5 MoE wrapper, `families/fused_experts.py`); elsewhere
the experts' gate/up/down_proj per expert."""


@pytest.mark.parametrize(
    "config,art,parameters",
    [
        (CONFIGS["Llama-3.1-8B"], _DENSE, None),
        (CONFIGS["Qwen3-30B-A3B"], _DENSE, None),
        (QWEN3_6_27B, _QWEN3_5, None),
        (QWEN3_5_35B_A3B, _QWEN3_5, _PACKED),
        (GEMMA4_31B_TEXT, _DENSE, None),
        (DEEPSEEK_V3, _MLA, None),
        (KIMI_K2, _MLA, None),
        (GPT_OSS_20B, _DENSE[:4], _PACKED),
    ],
    ids=["llama", "qwen3_moe", "qwen3_6", "qwen3_5_moe", "gemma4", "deepseek_v3", "kimi_k2", "gpt_oss"],
)
def test_the_default_lora_is_arts_for_the_model(
    tmp_path: Path, config: dict, art: tuple[str, ...], parameters: list[str] | None
) -> None:
    """As the adapter's config.json is written, so a resume compares like with like."""
    from art_mega.backend import MegatronBackend

    settings = MegatronBackend()._lora_settings(_model(tmp_path, config))
    assert sorted(settings["target_modules"]) == sorted(art)
    assert settings.get("target_parameters") == parameters


def test_the_backends_targets_replace_the_default(tmp_path: Path) -> None:
    from art_mega.backend import MegatronBackend

    model = _model(tmp_path, QWEN3_6_27B)
    targets, _ = MegatronBackend(lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))._lora_targets(model)
    assert targets == ("linear_qkv", "linear_proj")


def test_q_k_v_proj_on_multi_head_latent_attention_are_refused_in_one_sentence(tmp_path: Path) -> None:
    """DeepSeek-V3 has no q_proj / k_proj / v_proj: before, such a LoRA trained o_proj and the MLPs
    only, silently (PEFT, and art-mega's trainer, skip names a model lacks)."""
    from art_mega.backend import MegatronBackend

    model = _model(tmp_path, DEEPSEEK_V3)
    backend = MegatronBackend(lora_targets=list(_DENSE))
    with pytest.raises(UserError) as caught:
        backend._lora_targets(model)
    message = str(caught.value)
    assert message.startswith("LoRA target 'q_proj' is not known; use some of: linear_q_down_proj, ")
    assert "q_a_proj" in message and "kv_a_proj_with_mqa" in message
    assert message.count(". ") == 0 and message.endswith(".")


@pytest.mark.parametrize(
    "config,art_list",
    [
        (CONFIGS["Qwen3-30B-A3B"], (*_DENSE, "experts")),  # _QWEN3_MOE_TARGET_MODULES
        (QWEN3_5_35B_A3B, (*_QWEN3_5, "experts")),  # _QWEN3_5_MOE_TARGET_MODULES
        (DEEPSEEK_V3, (*_MLA, "experts")),  # _GLM52_TARGET_MODULES
        (GPT_OSS_20B, (*_DENSE[:4], "experts")),  # _GPT_OSS_MOE_TARGET_MODULES
    ],
    ids=["qwen3_moe", "qwen3_5_moe", "deepseek_v3", "gpt_oss"],
)
def test_arts_own_moe_target_lists_train_its_default(tmp_path: Path, config: dict, art_list: tuple) -> None:
    """An ART program that copies its model's target list (with "experts") into
    `peft_args.target_modules` trains what the default trains."""
    from art_mega.backend import MegatronBackend

    model = _model(tmp_path, config)
    assert MegatronBackend(lora_targets=list(art_list))._lora_targets(model)[0] == (
        MegatronBackend()._lora_targets(model)[0]
    )


def test_experts_alone_is_the_mlp_only_where_every_mlp_is_experts(tmp_path: Path) -> None:
    """GPT-OSS has no dense MLP: "experts" is linear_fc1 + linear_fc2. Qwen3.5 MoE also has a
    shared expert, which Megatron's linear_fc1 LoRA covers with the experts: refused."""
    from art_mega.backend import MegatronBackend

    experts_only = MegatronBackend(lora_targets=["q_proj", "k_proj", "v_proj", "experts"])
    assert experts_only._lora_targets(_model(tmp_path / "g", GPT_OSS_20B))[0] == (
        "linear_qkv",
        "linear_fc1",
        "linear_fc2",
    )
    with pytest.raises(UserError) as caught:
        experts_only._lora_targets(_model(tmp_path / "q", QWEN3_5_35B_A3B))
    assert str(caught.value) == (
        "LoRA target 'experts' needs gate_proj, up_proj and down_proj beside it: art-mega adapts an MoE "
        "model's experts with its MLP modules, as ART does when they are named."
    )


def test_a_run_resumes_on_its_committed_adapters_modules(tmp_path: Path) -> None:
    """A Qwen3.6-27B run begun when the default left the delta-net out resumes on q/k/v/o and the
    MLP (what its committed adapter holds), not refused for the new default; a backend that names
    its targets is still held to them."""
    from art_mega.backend import MegatronBackend
    from art_mega.basemodels.resolve import ResolvedModel
    from art_mega.errors import AdapterMismatchError
    from tests.unit.backend.test_register_checks import _topology

    model = ResolvedModel(_model(tmp_path / "model", QWEN3_6_27B))
    adapter = tmp_path / "run" / "checkpoints" / "0004"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "target_modules": sorted(_DENSE)})
    )
    topology = _topology()
    backend = MegatronBackend()
    backend._check_model_and_adapter(topology.trainer, topology.replicas, model, tmp_path / "run", 4)
    assert backend._lora_targets(model.model_dir)[0] == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    explicit = MegatronBackend(lora_targets=list(_QWEN3_5))
    with pytest.raises(AdapterMismatchError, match="committed step 4"):
        explicit._check_model_and_adapter(topology.trainer, topology.replicas, model, tmp_path / "run", 4)
