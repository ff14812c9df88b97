"""Context parallelism for the families whose attention has no CP path: each published config is
refused with one sentence when megatron-core's CP size is 2, where the trainer asks (the rank's
`check_parallel` or the family's `transformer_config`), before any tensor is allocated.

The CP-capable families (llama, qwen2, qwen3, qwen3_moe, mistral without a window) are checked at
CP=2 against one process in tests/trainer/test_context_parallel.py; a window refuses CP
(tests/trainer/test_sliding_window.py). Here: Qwen3.5 / 3.6 dense and MoE (the delta rule's state
spans the sequence), GPT-OSS (attention sinks), Gemma 3 / Gemma 4 (their local layers' window),
DeepSeek-V3 (MLA's per-layer rotary embedding).
"""

from __future__ import annotations

import pytest

from art_mega.errors import UserError
from art_mega.trainer.families import family_for, llama
from art_mega.trainer.families.spec import ParallelLayout
from tests.real_size_configs import DEEPSEEK_V3, GEMMA3_27B_TEXT, GEMMA4_31B_TEXT
from tests.trainer.gpt_oss_configs import GPT_OSS_20B
from tests.trainer.qwen3_5_configs import QWEN3_5_35B_A3B, QWEN3_6_27B

CASES = {
    "qwen3_5": (
        QWEN3_6_27B,
        "context parallelism is not implemented for Qwen3.5's gated delta-net layers; use cp=1.",
    ),
    "qwen3_5_moe": (
        QWEN3_5_35B_A3B,
        "context parallelism is not implemented for Qwen3.5's gated delta-net layers; use cp=1.",
    ),
    "gpt_oss": (
        GPT_OSS_20B,
        "GPT-OSS's attention sinks are not implemented under context parallelism; use cp=1.",
    ),
    "gemma3": (
        GEMMA3_27B_TEXT,
        "sliding_window=1024 is not implemented under context parallelism; use cp=1.",
    ),
    "gemma4": (
        GEMMA4_31B_TEXT,
        "sliding_window=1024 is not implemented under context parallelism; use cp=1.",
    ),
    "deepseek_v3": (
        DEEPSEEK_V3,
        "DeepSeek-V3's multi-latent attention is not implemented under context parallelism; use cp=1.",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_cp2_is_refused_in_one_sentence(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the trainer-cpu extra)")
    config, sentence = CASES[name]
    family = family_for(config)
    assert family.name == name
    args = family.model_args(config)
    layout = ParallelLayout()
    family.check_parallel(args, layout)  # CP=1: accepted
    monkeypatch.setattr(llama, "_context_parallel_size", lambda: 2)
    with pytest.raises(UserError) as caught:
        family.check_parallel(args, layout)
        family.transformer_config(args, layout, dtype="bfloat16", device="cpu")
    assert str(caught.value) == sentence
