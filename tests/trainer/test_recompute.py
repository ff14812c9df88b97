"""Activation recomputation (`TrainerSpec.recompute`) changes memory and time, never values: two
GRPO steps of the tiny Llama under selective and full recomputation give the losses, grad norms
and LoRA gradients of the run that keeps every activation (issue 32)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.trainer.common import require_trainer_deps
from tests.trainer.engine_scenarios import LORA, OPTIMIZER, STEP_LOSSES, grpo_batch

require_trainer_deps()

RECOMPUTE_TOLERANCE = 1e-6
"""Loss, grad norm and every LoRA gradient element: the same float32 operations re-run in the
backward, so the only differences are in the order autograd sums a few gradients."""

SETTINGS = {
    "selective core_attn + mlp": {"recompute": "selective", "recompute_modules": ("core_attn", "mlp")},
    "full, every layer": {"recompute": "full"},
    "full, first layer only": {"recompute": "full", "recompute_layers": 1},
}


RERUN = {
    "selective core_attn + mlp": ("self_attention.core_attention", "mlp"),
    "full, every layer": ("", "self_attention.core_attention", "mlp"),
    "full, first layer only": ("", "self_attention.core_attention", "mlp"),
}
"""Submodules of the first layer (""; the layer itself) that each setting runs again in the
backward (the last layer too, but where only the first layer is recomputed)."""


def _two_steps(state, model_dir: Path) -> tuple[list[dict], dict[str, object], dict[str, int]]:
    """Metrics of two GRPO steps, the LoRA gradients of the second (float32 `main_grad`) and how
    often each submodule of the first and last layer ran in the second."""
    from art_mega.trainer.rank.engine import TrainerEngine

    engine = TrainerEngine(model_dir, state, lora=LORA, optimizer=OPTIMIZER)
    batch = grpo_batch(engine)
    metrics = [engine.train_step(batch, "grpo", STEP_LOSSES[0])]
    calls: dict[str, int] = {}
    layers = engine.ddp.module.decoder.layers
    for index, layer in ((0, layers[0]), (-1, layers[-1])):
        for name in ("", "self_attention.core_attention", "mlp"):
            key = f"{index}:{name}"
            calls[key] = 0
            module = layer.get_submodule(name)
            module.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    metrics.append(engine.train_step(batch, "grpo", STEP_LOSSES[1]))
    grads = {
        name: param.main_grad.detach().clone()
        for name, param in engine.ddp.module.named_parameters()
        if param.requires_grad
    }
    return metrics, grads, calls


def test_recompute_gives_the_same_steps(megatron_world, tiny_dirs: dict[str, Path]) -> None:
    import torch

    from art_mega.topology.trainer import TrainerSpec

    torch.set_num_threads(1)
    reference, reference_grads, reference_calls = _two_steps(megatron_world, tiny_dirs["llama"])
    assert all(grad.abs().max() > 0 for name, grad in reference_grads.items() if "lora_A" in name)
    for label, setting in SETTINGS.items():
        spec = TrainerSpec(**setting)  # validated as a user's spec is
        state = dataclasses.replace(
            megatron_world,
            recompute=spec.recompute,
            recompute_modules=spec.recompute_modules,
            recompute_layers=spec.recompute_layers,
        )
        metrics, grads, calls = _two_steps(state, tiny_dirs["llama"])
        twice = {f"0:{name}" for name in RERUN[label]}
        if label != "full, first layer only":
            twice |= {f"-1:{name}" for name in RERUN[label]}
        # the no-grad passes (the old policy's logprobs) run once; the trained ones twice when recomputed
        assert {key for key in calls if calls[key] > reference_calls[key]} == twice, (label, calls)
        assert all(calls[key] == reference_calls[key] for key in calls if key not in twice), label
        for step, (got, want) in enumerate(zip(metrics, reference, strict=True)):
            for key in ("loss/policy", "loss/grad_norm", "loss/kl", "loss/tokens"):
                assert got[key] == pytest.approx(want[key], abs=RECOMPUTE_TOLERANCE), (label, step, key)
        assert grads.keys() == reference_grads.keys()
        worst = max((grads[n] - reference_grads[n]).abs().max().item() for n in grads)
        print(f"{label}: largest LoRA gradient difference {worst:.1e}")
        assert worst <= RECOMPUTE_TOLERANCE, label


def test_recompute_reaches_the_transformer_config(megatron_world, tiny_dirs: dict[str, Path]) -> None:
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.model_builder import build_megatron_model

    config = build_megatron_model(tiny_dirs["llama"], recompute=TrainerSpec(recompute="full")).module.config
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    spec = TrainerSpec(recompute="selective", recompute_modules=("mlp",))
    config = build_megatron_model(tiny_dirs["llama"], recompute=spec).module.config
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["mlp"])


def test_recompute_layers_needs_full() -> None:
    from pydantic import ValidationError

    from art_mega.topology.trainer import TrainerSpec

    with pytest.raises(ValidationError, match='set recompute="full"'):
        TrainerSpec(recompute="selective", recompute_layers=2)
