"""The typed record of a model family (`FamilySpec`), its parallel coordinates (`ParallelLayout`)
and its LoRA <-> PEFT names (`LoraNames`).

Torch-free at import: the controller reads a spec (config mapping, parallel limits, LoRA target
names) before any trainer rank starts; the tensor functions import torch when called.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from art_mega.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

ArgsT = TypeVar("ArgsT")
"""A family's architecture arguments (frozen dataclass read from config.json)."""


@dataclass(frozen=True)
class ParallelLayout:
    """A rank's place in the model-parallel split: the sizes and this rank's coordinates.

    tp / tp_rank: tensor parallel (heads, FFN and vocabulary split tp ways); ep / ep_rank: expert
    parallel (each EP rank holds num_experts / ep whole experts); etp / etp_rank: expert tensor
    parallel (each expert's FFN split etp ways). Sizes >= 1, ranks in [0, size); `ValueError`
    otherwise (a caller's bug: the sizes come from megatron-core or a checked topology).
    """

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank in ((self.tp, self.tp_rank), (self.ep, self.ep_rank), (self.etp, self.etp_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"invalid parallel layout {self}")


_LAYER_NAME = re.compile(
    r"^decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(?:experts\.(\d+)\.|(shared_experts)\.)?(\w+)$"
)
"""An adapter name of `trainer.rank.lora.apply_lora`:
decoder.layers.{i}[.mlp.experts.{e} | .mlp.shared_experts].{target}."""


ART_EXPERTS = "experts"
"""ART 0.5.23's LoRA target name for an MoE layer's experts (`art/megatron/model_support/registry.py`
`_QWEN3_MOE_TARGET_MODULES` and the other MoE lists; `LoraNames.normalise`)."""


@dataclass(frozen=True)
class LoraNames:
    """A family's LoRA target names: Megatron's linear layers <-> the HF (PEFT) modules.

    `modules`: Megatron target -> the HF module names it stands for, in Megatron's fused order
    (linear_qkv: q, k, v; linear_fc1: gate, up; several names = one fused Megatron layer).
    `parents`: Megatron target -> the HF submodule under a decoder layer that holds those modules
    ("self_attn", "mlp"). `expert_targets`: the targets an MoE layer also has per expert, whose HF
    modules sit under `{parent}.experts.{e}` (the per-expert names of the Hub checkpoints).
    `layer_prefix`: PEFT's key prefix of the decoder layers (PeftModel -> LoraModel ->
    *ForCausalLM.model.layers; a multimodal wrapper's `...model.language_model.layers`, Gemma 3,
    Qwen3.5). `output_gate`: linear_qkv also holds the attention output gate
    (HF's q_proj is per head [query; gate]; `layout.fuse_qkv_gate`, Qwen3.5). `shared_expert`:
    the HF name of an MoE layer's shared expert under its parent ("shared_expert" in Qwen's MoE
    models; "" = none): Megatron's `mlp.shared_experts.linear_fc1` / `linear_fc2` are its
    gate_proj + up_proj / down_proj. `optional`: targets left out of the default LoRA (a family
    adapts every target by default, as ART 0.5.23 does per model; the shared names of every
    family, `families.LORA_NAMES`, default to the llama family's). `fused_experts`: the path
    under a decoder layer of the module where transformers fuses the experts' weights into 3-D
    parameters that PEFT cannot adapt from per-expert names ("mlp.experts": text-only Qwen3.5 MoE;
    "experts": Gemma 4's MoE block; "" = none such, `for_peft`). `mlp_is_experts`: every linear
    the targets linear_fc1 / linear_fc2 name is an expert's (no dense layer, no shared expert:
    GPT-OSS, Qwen3-MoE), so ART's target "experts" alone means them (`normalise`). `mlp_parameters`: the paths
    under a decoder layer of the MLPs whose gate_proj / up_proj / down_proj `for_peft` names as
    2-D PEFT `target_parameters` (`mlp.gate_proj.weight`; the same tensors and keys) instead of
    `target_modules`: PEFT 0.21 rewrites every `target_modules` entry ending in gate_proj /
    up_proj / down_proj into the fused experts' `gate_up_proj` / `down_proj` parameters for the
    model types transformers converts like qwen2_moe (`peft/utils/transformers_weight_conversion.py`
    `_convert_peft_config_moe`; transformers' `_MODEL_TO_CONVERSION_PATTERN`: deepseek_v3,
    qwen3_moe, glm4_moe, ...), so a dense or shared-expert MLP beside the experts would get no
    LoRA ("mlp", "mlp.shared_experts": DeepSeek-V3's first dense layers and shared experts;
    () = none).

    Torch-free except `to_peft` / `from_peft`.
    """

    modules: Mapping[str, tuple[str, ...]]
    parents: Mapping[str, str]
    expert_targets: tuple[str, ...] = ()
    layer_prefix: str = "base_model.model.model.layers"
    output_gate: bool = False
    shared_expert: str = ""
    optional: tuple[str, ...] = ()
    fused_experts: str = ""
    mlp_is_experts: bool = False
    mlp_parameters: tuple[str, ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        """Every Megatron target, in order."""
        return tuple(self.modules)

    @property
    def default_targets(self) -> tuple[str, ...]:
        """The default LoRA targets: every target but the `optional` ones, in order."""
        return tuple(name for name in self.modules if name not in self.optional)

    def normalise(self, targets: Sequence[str]) -> tuple[str, ...]:
        """Megatron target names from Megatron and/or HF names, in `modules` order.

        A fused Megatron layer needs all of its HF modules: q_proj without k_proj and v_proj cannot
        be expressed with one adapter on linear_qkv, so it is refused.

        ART's "experts" (its MoE models' default `target_modules` name the experts so, beside
        gate_proj / up_proj / down_proj, which adapt the experts too in ART 0.5.23 and here:
        linear_fc1 / linear_fc2 cover dense MLPs, shared experts and experts alike) means
        linear_fc1 + linear_fc2 where every MLP linear is an expert's (`mlp_is_experts`); else it
        is taken with those three and adds nothing, and without them refused (an experts-only
        LoRA, which Megatron's targets cannot express apart from the dense or shared MLP).

        Raises:
            UserError: an unknown name, part of a fused layer's HF modules, or "experts" without
                the MLP's modules (one sentence each).
        """
        if ART_EXPERTS in targets:
            others = [name for name in targets if name != ART_EXPERTS]
            if self.mlp_is_experts:
                return self.normalise([*others, "linear_fc1", "linear_fc2"])
            rest = self.normalise(others) if others else ()
            if not {"linear_fc1", "linear_fc2"} <= set(rest):
                raise UserError(
                    f"LoRA target {ART_EXPERTS!r} needs gate_proj, up_proj and down_proj beside it: art-mega "
                    "adapts an MoE model's experts with its MLP modules, as ART does when they are named."
                )
            return rest
        hf_to_megatron = {hf: mc for mc, names in self.modules.items() for hf in names}
        wanted: set[str] = set()
        hf_seen: set[str] = set()
        for name in targets:
            if name in self.modules:
                wanted.add(name)
            elif name in hf_to_megatron:
                hf_seen.add(name)
                wanted.add(hf_to_megatron[name])
            else:
                known = ", ".join([*self.modules, *hf_to_megatron])
                raise UserError(f"LoRA target {name!r} is not known; use some of: {known}.")
        for megatron_name, hf_names in self.modules.items():
            partial = hf_seen & set(hf_names)
            if partial and partial != set(hf_names) and megatron_name not in targets:
                raise UserError(
                    f"LoRA targets {sorted(partial)} need all of {list(hf_names)}: Megatron fuses them "
                    f"into {megatron_name}, which takes one adapter."
                )
        return tuple(name for name in self.modules if name in wanted)

    def hf_target_modules(self, targets: Sequence[str]) -> list[str]:
        """The HF module names (PEFT's `target_modules`, sorted) of normalised Megatron `targets`."""
        return sorted(hf for name in targets for hf in self.modules[name])

    def parse(self, name: str) -> tuple[str, str]:
        """(HF module path under the decoder layers, Megatron target) of a LoRA layer name:
        decoder.layers.3.mlp.linear_fc1 -> ("3.mlp", "linear_fc1"),
        decoder.layers.3.mlp.experts.5.linear_fc2 -> ("3.mlp.experts.5", "linear_fc2"),
        decoder.layers.3.mlp.shared_experts.linear_fc1 -> ("3.mlp.shared_expert", "linear_fc1").
        Raises `ValueError` for a name this family has no HF module for."""
        match = _LAYER_NAME.match(name)
        if match is None or match.group(4) not in self.modules:
            raise ValueError(f"unexpected LoRA layer name {name!r}")
        layer, expert, shared, target = match.groups()
        if expert is not None and target not in self.expert_targets:
            raise ValueError(f"unexpected LoRA layer name {name!r}: this family has no experts' {target}")
        if shared is not None and not (self.shared_expert and target in self.expert_targets):
            raise ValueError(
                f"unexpected LoRA layer name {name!r}: this family has no shared expert's {target}"
            )
        parent = f"{layer}.{self.parents[target]}"
        if expert is not None:
            parent += f".experts.{expert}"
        elif shared is not None:
            parent += f".{self.shared_expert}"
        return parent, target

    def hf_parents(self, layer: int, target: str, num_experts: int) -> list[tuple[str, str]]:
        """(HF parent under the decoder layers, width kind) of each adapter `target` has on decoder
        layer `layer` of a model with `num_experts` experts (0: dense): ("{layer}.{parent}",
        "dense"); an expert target of an MoE model: ("{layer}.{parent}.experts.{e}", "expert")
        per expert, and ("{layer}.{parent}.{shared_expert}", "shared") where there is one.
        `peft_io.adapter_layout` sizes each kind's adapters."""
        parent = f"{layer}.{self.parents[target]}"
        if not (num_experts and target in self.expert_targets):
            return [(parent, "dense")]
        placed = [(f"{parent}.experts.{e}", "expert") for e in range(num_experts)]
        if self.shared_expert:
            placed.append((f"{parent}.{self.shared_expert}", "shared"))
        return placed

    def hf_modules(self, name: str) -> tuple[str, ...]:
        """The HF modules (under `parse(name)`'s parent) the LoRA layer `name` exports to."""
        return self.modules[self.parse(name)[1]]

    def peft_key(self, parent: str, hf_module: str, matrix: str) -> str:
        """PEFT's tensor key of `matrix` ("lora_A" / "lora_B") of `hf_module` under `parent`."""
        return f"{self.layer_prefix}.{parent}.{hf_module}.{matrix}.weight"

    # The adapter's on-disk format. `to_peft` / `from_peft` speak per-module PEFT names (one
    # lora_A / lora_B per HF module, per expert); a family whose HF experts are fused 3-D
    # parameters (GPT-OSS) writes them as PEFT `target_parameters` instead, and overrides these
    # five hooks, which are the identity here.

    def peft_targets(self, targets: Sequence[str]) -> dict[str, list[str]]:
        """adapter_config.json's target fields for normalised Megatron `targets`:
        {"target_modules": `hf_target_modules(targets)`}."""
        return {"target_modules": self.hf_target_modules(targets)}

    def config_modules(self, target_modules: Sequence[str], target_parameters: Sequence[str]) -> list[str]:
        """The per-module HF names an adapter_config.json's `target_modules` and
        `target_parameters` cover (`normalise` reads them): `target_modules` here."""
        return list(target_modules)

    def pack(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """The on-disk tensors of a whole adapter from its per-module PEFT tensors (export)."""
        return tensors

    def unpack(self, tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> Mapping[str, Tensor]:
        """The per-module PEFT tensors of a whole adapter from its on-disk tensors and its
        adapter_config.json dict `config` (import; inverse of `pack`)."""
        return tensors

    def pack_shapes(
        self, shapes: dict[str, tuple[int, int]], shared: list[tuple[str, ...]], rank: int
    ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, ...]]]:
        """`pack` on shapes: the on-disk (key -> shape, shared lora_A groups) of the per-module
        ones (`peft_io.adapter_layout`). Torch-free."""
        return shapes, shared

    def for_peft(
        self, tensors: Mapping[str, Tensor], config: Mapping[str, Any]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """An on-disk adapter (tensors, adapter_config.json dict) as PEFT 0.21 loads it onto
        transformers 5's model: as it is, but where `fused_experts` is set, the per-expert tensors
        there as PEFT's LoRA on the fused 3-D parameters (`fused_experts.peft_form`), and where
        `mlp_parameters` is set, those MLPs' modules as 2-D `target_parameters` (`_mlp_parameters`).
        PEFT turns per-expert names into the fused form itself only for the model types its
        `_MOE_TARGET_MODULE_MAPPING` knows (`peft/utils/transformers_weight_conversion.py`: Mixtral
        and those transformers converts like Qwen2-MoE, e.g. qwen3_moe); for others it drops them."""
        out, fields = dict(tensors), dict(config)
        if self.fused_experts:
            from art_mega.trainer.families.fused_experts import peft_form

            out, fields = peft_form(out, fields, self.fused_experts)
        if self.mlp_parameters:
            fields = _mlp_parameters(out, fields, self.mlp_parameters, self.layer_prefix)
        return out, fields

    def to_peft(
        self, name: str, a: Tensor, b_shards: list[Tensor], num_heads: int, num_query_groups: int
    ) -> dict[str, Tensor]:
        """PEFT tensors of one Megatron LoRA layer from its full A [r, in] and its B (shards in TP order).

        linear_qkv: B's fused rows are split per query group into q, k, v (`layout.split_qkv`);
        linear_fc1: each rank's B rows are [gate shard; up shard] (`layout.unfuse_fc1`); the
        shared A is written for each of the HF modules (x A^T is the same input to all of them),
        which is exactly the fused layer's update. Other targets map one to one (a column layer
        whose TP shards hold parts, Qwen3.5's in_proj_qkv, comes as pieces whose concatenation
        is the HF order, `peft_io._full_lora`). An expert's (or the shared expert's)
        linear_fc1 / linear_fc2 maps to its gate_proj + up_proj / down_proj.
        """
        import torch

        from art_mega.trainer.families.layout import split_qkv, split_qkv_gate, unfuse_fc1

        parent, target = self.parse(name)
        hf_names = self.modules[target]
        if target == "linear_qkv":
            full_b = torch.cat(b_shards, dim=0)
            split = split_qkv_gate if self.output_gate else split_qkv
            bs = dict(zip(hf_names, split(full_b, num_heads, num_query_groups)))
        elif target == "linear_fc1":
            bs = dict(zip(hf_names, unfuse_fc1(b_shards)))
        else:
            bs = {hf_names[0]: torch.cat(b_shards, dim=0)}
        out = {}
        for hf_module, b in bs.items():
            out[self.peft_key(parent, hf_module, "lora_A")] = a.contiguous().clone()
            out[self.peft_key(parent, hf_module, "lora_B")] = b.contiguous().clone()
        return out

    def from_peft(
        self,
        name: str,
        tensors: Mapping[str, Tensor],
        num_heads: int,
        num_query_groups: int,
        tp_size: int,
        tp_rank: int,
        *,
        column_parts: tuple[int, ...] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """This TP rank's (A, B) of the Megatron LoRA layer `name` from PEFT tensors (inverse of
        `to_peft`). Column layers: A [r, in] whole, B this rank's rows; row layers: A this rank's
        columns, B whole. linear_qkv and linear_fc1 are column layers; another target is a row
        layer unless `column_parts` gives the full row counts of the consecutive parts TP splits
        one by one (Qwen3.5's in_proj_qkv: (q, k, v) rows; a plain column layer: (rows,)).

        Raises:
            UserError: a tensor is missing, or the HF modules of a fused layer have different A
                matrices (one fused adapter cannot express them).
        """
        import torch

        from art_mega.trainer.families.layout import fc1_shard, fuse_qkv, fuse_qkv_gate, shard

        parent, target = self.parse(name)
        layer = parent.split(".", 1)[0]
        hf_names = self.modules[target]
        a_list, b_list = [], []
        for hf_module in hf_names:
            keys = [self.peft_key(parent, hf_module, matrix) for matrix in ("lora_A", "lora_B")]
            for key in keys:
                if key not in tensors:
                    raise UserError(
                        f"the adapter has no tensor {key}; it does not cover {hf_module} of layer {layer}."
                    )
            a_list.append(tensors[keys[0]])
            b_list.append(tensors[keys[1]])
        if any(not torch.equal(a_list[0], other) for other in a_list[1:]):
            raise UserError(
                f"layer {layer}'s {', '.join(hf_names)} have different lora_A matrices; "
                f"art-mega fuses them into one {target} adapter and needs them equal."
            )
        a = a_list[0]
        if target == "linear_qkv":
            fuse = fuse_qkv_gate if self.output_gate else fuse_qkv
            b = shard(fuse(*b_list, num_heads, num_query_groups), 0, tp_size, tp_rank)
        elif target == "linear_fc1":
            b = fc1_shard(b_list[0], b_list[1], tp_size, tp_rank)
        elif column_parts is not None:
            pieces = b_list[0].split(list(column_parts), dim=0)
            b = torch.cat([shard(piece, 0, tp_size, tp_rank) for piece in pieces], dim=0)
        else:
            a = shard(a, 1, tp_size, tp_rank)
            b = b_list[0]
        return a, b


_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
"""The HF modules of a SwiGLU MLP, the names PEFT's MoE conversion takes for the experts'."""


def _mlp_parameters(
    tensors: Mapping[str, Any], config: Mapping[str, Any], paths: Sequence[str], layer_prefix: str
) -> dict[str, Any]:
    """adapter_config.json dict `config` with the MLPs at `paths` (under a decoder layer) adapted
    as 2-D `target_parameters`: "{path}.{module}.weight" for each gate_proj / up_proj / down_proj
    that `tensors` (PEFT keys `{layer_prefix}.{i}.{path}.{module}.lora_A.weight`) has one on, and
    gate_proj / up_proj / down_proj out of `target_modules` (the experts' are parameters already,
    `fused_experts.peft_form`). PEFT's ParamWrapper on a 2-D weight [out, in] has lora_A [r, in]
    and lora_B [out, r] under the module's own keys, so the tensors stay as they are."""
    pattern = re.compile(
        rf"^{re.escape(layer_prefix)}\.\d+\.(?P<path>.+)\.(?P<module>{'|'.join(_MLP_MODULES)})\.lora_A\.weight$"
    )
    found = {(m["path"], m["module"]) for m in map(pattern.match, tensors) if m is not None}
    wanted = [
        f"{path}.{module}.weight" for path in paths for module in _MLP_MODULES if (path, module) in found
    ]
    modules = [name for name in config.get("target_modules") or () if name not in _MLP_MODULES]
    return {
        **config,
        "target_modules": modules,
        "target_parameters": [*(config.get("target_parameters") or ()), *wanted],
    }


@dataclass(frozen=True)
class FamilySpec(Generic[ArgsT]):
    """Everything the trainer knows about one model family, declared in the family's file.

    `name`: the family's name (its file's). Config mapping: `model_types` (HF `model_type` values
    it reads); `model_args(config)` the architecture arguments of an HF config dict, raising
    `UserError` (one sentence) for a value the family cannot express exactly. The arguments have
    at least `vocab_size`, `num_heads` and `num_query_groups` (the engine and the LoRA export
    read them).

    Parallel limits: `expert_parallel` (the layers have experts: `megatron_state_dict` reads the
    layout's ep/etp coordinates and `check_parallel` its ep/etp sizes); `valid_tp_sizes(args)`
    ascending; `check_parallel(args, layout)` raises `UserError` naming the valid sizes when the
    layout's sizes cannot split `args`.

    Megatron model: `transformer_config(args, layout, *, dtype, device)` megatron-core's
    `TransformerConfig` (dtype "float32"/"bfloat16", device "cpu"/"cuda");
    `layer_spec(args, *, use_te)` the decoder layer's `ModuleSpec`; `gpt_model_kwargs(args, *, tp)`
    the other `GPTModel` arguments (its "vocab_size" is the padded vocabulary).

    Weight adapter: `megatron_state_dict(args, read, layout)` this rank's Megatron tensors
    (local-spec names) from HF tensors read by `read(name)` (`KeyError` when absent);
    `te_name_map` local-spec -> TransformerEngine-spec parameter name suffixes (TE fuses a norm
    into the next linear); `lora` the LoRA <-> PEFT names both ways.

    `pipeline_parallel`: the family's model can be split into pipeline stages (pp > 1): its
    layers are uniform blocks whose weights depend only on their global index, and nothing outside
    megatron-core's GPTModel reads the embedding or the output layer (checked for each family by
    the pp = 2 equality tests, `tests/trainer/test_pipeline_parallel.py`).

    `finish_model(args, module)`, where set, is called on the built GPTModel after its weights
    are loaded, for what a layer spec cannot express (forward hooks, e.g. Gemma's embedding scale).
    `lora_for(args)`, where set, gives one model's LoRA names when its layers differ in shape
    (Gemma 4's global layers); `lora_names(args)` is the names to use with a model in hand.
    `text_config(config)`, where set, gives the decoder's config dict of a config.json with the
    family's defaults filled (a multimodal wrapper's sparse `text_config`, Gemma 3); the register
    checks read the sizes there.
    """

    name: str
    model_types: tuple[str, ...]
    model_args: Callable[[dict[str, Any]], ArgsT]
    expert_parallel: bool
    valid_tp_sizes: Callable[[ArgsT], list[int]]
    check_parallel: Callable[[ArgsT, ParallelLayout], None]
    transformer_config: Callable[..., Any]
    layer_spec: Callable[..., Any]
    gpt_model_kwargs: Callable[..., dict[str, Any]]
    megatron_state_dict: Callable[[ArgsT, Callable[[str], Tensor], ParallelLayout], dict[str, Tensor]]
    te_name_map: Mapping[str, str]
    lora: LoraNames = field(repr=False)
    finish_model: Callable[[ArgsT, Any], None] | None = None
    lora_for: Callable[[ArgsT], LoraNames] | None = None
    pipeline_parallel: bool = False
    text_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def lora_names(self, args: ArgsT) -> LoraNames:
        """The LoRA <-> PEFT names of the model with arguments `args` (`lora_for`, else `lora`)."""
        return self.lora if self.lora_for is None else self.lora_for(args)
