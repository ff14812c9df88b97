"""A full-size HF config's HF -> Megatron weight mapping checked on the `meta` device (no memory).

Run as `python -m tests.trainer.launch tests.trainer.meta_mapping_worker`, it serves requests: one
JSON line on stdin each, {"config": an HF config.json dict, "tp", "ep", "out": a path}, answered by
writing the result (or {"error": traceback}) to `out`, then the line `MAPPED <out>` on stdout; it
exits at the end of stdin. One process maps every config of a test session (its imports took 11 of
the 12 s a map took alone). With `IN.json OUT.json` arguments it maps one (IN holds config, tp, ep).
The process is in a fake world of 8 ranks (torch's "fake"
process-group backend: collectives are no-ops, which building a model never needs), so
megatron-core's parallel state is that of rank 0 of a real 8-rank TP x EP job (expert-TP 1),
initialized again for each request.

It builds transformers' model and megatron-core's `GPTModel` (the family's `transformer_config`,
`layer_spec` and `gpt_model_kwargs`) under `torch.device("meta")`, runs the family's
`megatron_state_dict` for every rank's (tp_rank, ep_rank) with a reader that hands out the HF
model's meta tensors and records each name, and writes to OUT: the HF tensor names never read,
names read that HF lacks, Megatron keys missing or unexpected and shape mismatches against the
rank's model, both parameter counts (Megatron's from its TP=1 EP=1 model on meta, vocabulary
unpadded there), the LoRA layers `apply_lora` wraps on the TP x EP model (every target of the family) and any whose HF module
the HF model lacks, and a few rank-0 shapes.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from typing import Any

import torch

_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
"""The Hub's per-expert names, which `qwen3_moe.read_expert` asks for before the fused ones."""


def _init(tp: int, ep: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=False,
    )


def _megatron_model(family: Any, args: Any, layout: Any) -> Any:
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = family.transformer_config(args, layout, dtype="bfloat16", device="cpu")
    with torch.device("meta"):
        return GPTModel(
            config, family.layer_spec(args, use_te=False), **family.gpt_model_kwargs(args, tp=layout.tp)
        )


def _expert_module_exists(hf_params: dict[str, Any], layers: str, parent: str, hf_module: str) -> bool:
    """Whether HF has expert `e` of layer `l` (`parent` = "l.mlp.experts.e", or Gemma 4's
    "l.experts.e" beside its mlp) for `hf_module`: transformers 5's fused expert parameters
    [E, ...] (gate/up in gate_up_proj, down in down_proj)."""
    experts, expert = parent.rsplit(".", 1)
    fused = "gate_up_proj" if hf_module in ("gate_proj", "up_proj") else "down_proj"
    tensor = hf_params.get(f"{layers}.{experts}.{fused}")
    return tensor is not None and int(expert) < tensor.shape[0]


def _lora_layers(model: Any, family: Any, args: Any, hf_model: Any, hf_params: dict) -> tuple[int, list[str]]:
    """(layers `apply_lora` wraps in `model` for every target of the family, the HF module paths
    of those layers that `hf_model` lacks; a multimodal wrapper's under its `model.language_model`)."""
    from art_mega.trainer.protocol import LoraConfig
    from art_mega.trainer.rank.lora import apply_lora

    wrapped = apply_lora(model, LoraConfig(rank=1, alpha=1.0, targets=family.lora.targets))
    hf_modules = dict(hf_model.named_modules())
    unmatched = []
    names = family.lora_names(args)
    # HF's decoder layers: "model.layers" (*ForCausalLM), "model.language_model.layers" (a wrapper)
    layers = "model.language_model.layers" if "model.language_model.layers" in hf_modules else "model.layers"
    for name in wrapped:
        parent, _ = names.parse(name)
        for hf_module in names.hf_modules(name):
            path = f"{layers}.{parent}.{hf_module}"
            ok = path in hf_modules or (
                ".experts." in parent and _expert_module_exists(hf_params, layers, parent, hf_module)
            )
            if not ok:
                unmatched.append(path)
    return len(wrapped), sorted(set(unmatched))


def map_config(config: dict, tp: int, ep: int) -> dict:
    """The mapping checks of HF config dict `config` at these TP / EP sizes (the module docstring),
    as the JSON-ready dict the tests read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from art_mega.trainer.families import family_for
    from art_mega.trainer.families.spec import ParallelLayout
    from art_mega.trainer.rank.cpu_compat import apply_cpu_compat

    family = family_for(config)
    args = family.model_args(config)
    # a model_type transformers has no config for is built by the class its family names
    # (Kimi-K2's kimi_k2 -> deepseek_v3, `deepseek_v3.TRANSFORMERS_MODEL_TYPES`)
    hf_types = getattr(sys.modules[family.model_args.__module__], "TRANSFORMERS_MODEL_TYPES", {})
    hf_type = hf_types.get(config["model_type"], config["model_type"])
    hf_config = AutoConfig.for_model(**{**config, "model_type": hf_type})
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    saved = hf_model.state_dict().keys()  # persistent buffers too (Gemma 4's layer_scalar)
    hf_params = {
        **dict(hf_model.named_parameters()),
        **{n: b for n, b in hf_model.named_buffers() if n in saved},
    }
    hf_tensors = hf_params

    read_names: set[str] = set()
    unknown: set[str] = set()

    def read(name: str) -> torch.Tensor:
        if name not in hf_tensors:
            unknown.add(name)
            raise KeyError(name)
        read_names.add(name)
        return hf_tensors[name].detach()

    apply_cpu_compat()  # as a CPU trainer rank: e.g. the local spec's norm under sequence parallel
    _init(tp, ep)
    layouts = [ParallelLayout(tp=tp, tp_rank=r % tp, ep=ep, ep_rank=r % ep) for r in range(max(tp, ep))]
    for layout in layouts:
        family.check_parallel(args, layout)
    model = _megatron_model(family, args, layouts[0])
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected, mismatched = set(), set(), []
    for layout in layouts:
        state = family.megatron_state_dict(args, read, layout)
        missing |= expected.keys() - state.keys()
        unexpected |= state.keys() - expected.keys()
        for key in state.keys() & expected.keys():
            if tuple(state[key].shape) != expected[key]:
                mismatched.append(
                    f"{key} (tp_rank {layout.tp_rank}): {tuple(state[key].shape)} != {expected[key]}"
                )
    # read_expert tries the Hub's per-expert names first, then transformers 5's fused parameters
    unknown = {name for name in unknown if not _PER_EXPERT.search(name)}
    shapes = {
        key: list(expected[key])
        for key in sorted(expected)
        if ".layers.0." in key or ".layers.5." in key or ".layers." not in key
    }

    lora_layers, lora_unmatched = _lora_layers(model, family, args, hf_model, hf_params)
    del model

    _init(1, 1)
    full = _megatron_model(family, args, ParallelLayout())
    return {
        "family": family.name,
        "hf_class": type(hf_model).__name__,
        "hf_params": sum(p.numel() for p in hf_model.parameters()),
        "hf_buffers": len(hf_params.keys() - dict(hf_model.named_parameters()).keys()),
        "megatron_params": sum(p.numel() for p in full.parameters()),
        "hf_names": len(hf_tensors),
        "unread": sorted(hf_tensors.keys() - read_names),
        "unknown_reads": sorted(unknown),
        "missing": sorted(missing),
        "unexpected": sorted(unexpected),
        "mismatched": mismatched[:20],
        "megatron_keys": len(expected),
        "lora_layers": lora_layers,
        "lora_unmatched": lora_unmatched,
        "rank0_shapes": shapes,
    }


def serve() -> None:
    """Answer each stdin request (the module docstring) until stdin ends."""
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = map_config(request["config"], int(request["tp"]), int(request["ep"]))
        except Exception:  # the test that asked fails with it; the next request still runs
            reply = {"error": traceback.format_exc()}
        with open(request["out"], "w") as out:
            json.dump(reply, out, indent=1)
        print(f"MAPPED {request['out']}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        spec = json.load(open(sys.argv[1]))
        json.dump(
            map_config(spec["config"], int(spec["tp"]), int(spec["ep"])), open(sys.argv[2], "w"), indent=1
        )
    else:
        serve()
