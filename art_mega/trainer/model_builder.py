"""Build this rank's megatron-core GPTModel from a Hugging Face directory and load its shard.

Needs `init_parallel` first; the model's `FamilySpec` (trainer/families/) does the config and weight
mapping.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from art_mega.errors import ModelSplitError, UserError
from art_mega.trainer import rope_scaling
from art_mega.trainer.families import family_for
from art_mega.trainer.families.spec import FamilySpec, ParallelLayout
from art_mega.trainer.hf_checkpoint import SafetensorsReader, read_hf_config


@dataclass
class MegatronModel:
    """A rank's GPTModel and what callers need to interpret its output.

    `module` is the megatron-core `GPTModel`; its forward(input_ids [b, s] int64,
    position_ids [b, s] int64 (RoPE angles, see `RopeFromPositionIds`), attention_mask None
    (causal) or bool [b, 1, s, s] with True = masked) returns this rank's vocabulary shard of the logits, [b, s, padded_vocab_size / tp]
    in the parameter dtype (`parallel_output=True`: gather over the TP group for full logits).
    Columns at and beyond `vocab_size` are padding (logit 0) and must be ignored. `family` is
    the model's family spec, `args` its architecture arguments (`family.model_args`).
    """

    module: Any
    family: FamilySpec[Any]
    args: Any
    vocab_size: int
    padded_vocab_size: int
    device: str
    uses_te: bool


def te_available() -> bool:
    """True when TransformerEngine's PyTorch extension imports (GPU machines only)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def check_model_fits(
    model_dir: str | os.PathLike[str],
    tp: int,
    *,
    ep: int = 1,
    etp: int = 1,
    pp: int = 1,
    spec: str | None = None,
) -> None:
    """Refuse an HF model in `model_dir` that cannot be split `tp` ways (and, for an MoE model,
    its experts `ep` ways and their FFN `etp` ways; a dense model ignores ep/etp), or into `pp`
    pipeline stages (`check_pipeline`).

    Reads only config.json (no torch): `MegatronBackend.register` calls it before any rank or
    replica starts. `spec` ("TrainerSpec", "InferenceSpec") names the sizes' owner in the
    sentence ("TrainerSpec.tp=3 cannot split ...").

    Raises:
        ModelSplitError: a size does not divide the model (one sentence naming the valid sizes).
        UserError: config.json is missing or invalid (see `_model_args`), or its model_type is
            not supported.
    """
    config = read_hf_config(model_dir)
    args = _model_args(config, model_dir)
    family = family_for(config)
    try:
        _check_parallel(family, args, ParallelLayout(tp=tp, ep=ep, etp=etp), model_dir)
        check_pipeline(family, args, pp, model_dir)
    except ModelSplitError as exc:
        if spec is None:
            raise
        raise ModelSplitError(f"{spec}.{exc}", exc.model_dir, tp, ep, etp) from None


def check_pipeline(family: FamilySpec[Any], args: Any, pp: int, model_dir: str | os.PathLike[str]) -> None:
    """Refuse `pp` > 1 pipeline stages for a family whose model cannot be split into stages
    (`FamilySpec.pipeline_parallel`) or whose decoder layers `pp` does not divide (each stage
    holds num_layers / pp whole layers, megatron-core's even split). Raises `ModelSplitError`."""
    if pp == 1:
        return
    if not family.pipeline_parallel:
        raise ModelSplitError(
            f"pp={pp} cannot split this {family.name} model: pipeline stages are built for the llama "
            "and qwen3_moe families only; use pp=1 and split it with tp (or ep for experts).",
            str(model_dir),
            1,
        )
    layers = args.num_layers
    if layers % pp:
        sizes = ", ".join(str(n) for n in range(1, layers + 1) if layers % n == 0)
        raise ModelSplitError(
            f"pp={pp} cannot split this {family.name} model ({layers} decoder layers) into equal "
            f"stages; use pp in {{{sizes}}}.",
            str(model_dir),
            1,
        )


def read_model_args(model_dir: str | os.PathLike[str]) -> tuple[FamilySpec[Any], Any]:
    """The family and its architecture arguments of the HF model in `model_dir` (config.json
    only, no torch; `trainer.prepare.memory_plan` sizes the model from them). Raises `UserError` as
    `check_model_fits` does."""
    config = read_hf_config(model_dir)
    args = _model_args(config, model_dir)
    return family_for(config), args


CONFIG_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
"""config.json sizes every family reads: whole numbers >= 1."""

OPTIONAL_CONFIG_SIZES = ("num_key_value_heads", "intermediate_size", "head_dim", "moe_intermediate_size")
"""config.json sizes a family may read: absent, null where the family has a default, else whole numbers >= 1."""


def _model_args(config: Any, model_dir: str | os.PathLike[str]) -> Any:
    """The family's architecture arguments of a config.json, after its sizes were checked: a
    broken config was a KeyError or TypeError traceback at `register`.

    Raises:
        UserError: config.json is not an object, has no supported model_type, a size that is not
            a whole number >= 1 (a string, 0, a float), KV heads that do not divide the heads,
            or a field its family cannot read (named with the file).
    """
    path = os.path.join(str(model_dir), "config.json")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise UserError(
            f"{path} is not a model config (an object with a model_type string); use the model's own config.json."
        )
    family = family_for(config)  # an unsupported model_type first: its wrapper may omit sizes (gemma3)
    inner = config.get("text_config")
    if family.text_config is not None:  # the decoder's config with the family's defaults (gemma3)
        sizes = family.text_config(config)
    else:
        sizes = {**config, **inner} if isinstance(inner, dict) else config  # a multimodal wrapper's decoder
    for name in (*CONFIG_SIZES, *OPTIONAL_CONFIG_SIZES):
        value = sizes.get(name)
        if value is None and name in OPTIONAL_CONFIG_SIZES:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            shown = "missing" if name not in sizes else f"{value!r}"
            raise UserError(
                f"{path}: {name} is {shown}, not a whole number of at least 1; use the model's own config.json."
            )
    heads, kv = (
        sizes["num_attention_heads"],
        sizes.get("num_key_value_heads") or sizes["num_attention_heads"],
    )
    if heads % kv:
        raise UserError(
            f"{path}: num_key_value_heads={kv} does not divide num_attention_heads={heads} (each KV head "
            "serves a whole group of query heads); use the model's own config.json."
        )
    try:
        return family.model_args(config)
    except (KeyError, TypeError, ValueError) as exc:
        shown = (
            f"has no {exc}"
            if isinstance(exc, KeyError)
            else f"has a field its {config['model_type']} loader cannot read ({exc})"
        )
        raise UserError(f"{path} {shown}; use the model's own config.json.") from None


def _check_parallel(
    family: FamilySpec[Any], args: Any, layout: ParallelLayout, model_dir: str | os.PathLike[str]
) -> None:
    """The family's size check, its sentence raised as a `ModelSplitError`."""
    try:
        family.check_parallel(args, layout)
    except UserError as exc:
        raise ModelSplitError(str(exc), str(model_dir), layout.tp, layout.ep, layout.etp) from None


def _rank_layout(expert_parallel: bool) -> ParallelLayout:
    """This rank's TP (and, for a family with experts, EP / expert-TP) sizes and coordinates from
    megatron-core's parallel state; a dense family's layout keeps ep = etp = 1 (no experts to
    split, whatever megatron-core's expert groups are)."""
    from megatron.core import parallel_state as mpu

    dense = ParallelLayout(
        tp=mpu.get_tensor_model_parallel_world_size(), tp_rank=mpu.get_tensor_model_parallel_rank()
    )
    if not expert_parallel:
        return dense
    return ParallelLayout(
        tp=dense.tp,
        tp_rank=dense.tp_rank,
        ep=mpu.get_expert_model_parallel_world_size(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp=mpu.get_expert_tensor_parallel_world_size(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
    )


def build_megatron_model(
    model_dir: str | os.PathLike[str],
    *,
    device: str = "cpu",
    dtype: str = "float32",
    use_te: bool | None = None,
    recompute: Any = None,
) -> MegatronModel:
    """This rank's GPTModel with the HF weights of `model_dir` loaded for its TP position.

    `recompute`: anything with `recompute`, `recompute_modules` and `recompute_layers` (a
    `TrainerSpec`, a rank's `ParallelState`), set on the `TransformerConfig` by `_recompute_config`;
    None: no recomputation.

    Call after `init_parallel` (TP size and rank come from megatron-core's parallel state).
    `device`: "cpu" or "cuda:0"; `dtype`: "float32" or "bfloat16". `use_te` None means the
    TransformerEngine layer spec on CUDA when TE imports, else the local spec; TE's fused
    norm names are mapped with the family's `te_name_map`. The head, KV-head and FFN counts are
    checked against TP (and an MoE family's experts against EP and expert-TP, read from
    megatron-core's expert groups) before anything is allocated; each rank loads only its
    own experts.

    Raises `UserError` for an unsupported model, `ModelSplitError` for an unsplittable one (one
    sentence naming the valid sizes), and `RuntimeError` when parallel state is not initialised or the converted
    weights do not cover the model's parameters exactly.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_model import GPTModel

    if not mpu.model_parallel_is_initialized():
        raise RuntimeError("call init_parallel before build_megatron_model")
    config = read_hf_config(model_dir)
    family = family_for(config)
    args = family.model_args(config)
    layout = _rank_layout(family.expert_parallel)
    _check_parallel(family, args, layout, model_dir)
    on_cuda = device.startswith("cuda")
    if use_te is None:
        use_te = on_cuda and te_available()
    kind = "cuda" if on_cuda else "cpu"
    pp = mpu.get_pipeline_model_parallel_world_size()
    check_pipeline(family, args, pp, model_dir)
    transformer_config = family.transformer_config(args, layout, dtype=dtype, device=kind)
    if pp > 1:
        transformer_config = _pipeline_config(transformer_config, pp)
    if recompute is not None and recompute.recompute != "none":
        transformer_config = _recompute_config(transformer_config, recompute)
    kwargs = family.gpt_model_kwargs(args, tp=layout.tp)
    module = GPTModel(
        transformer_config,
        family.layer_spec(args, use_te=use_te),
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
        **kwargs,
    )
    module.to(device)
    with SafetensorsReader(model_dir) as reader:
        state = family.megatron_state_dict(args, reader.get, layout)
    model_keys = set(module.state_dict())
    if pp > 1:
        state = _stage_state(state, model_keys, module.decoder.layers)
    state = _rename_for_spec(state, model_keys, family.te_name_map)
    dtype_t = next(module.parameters()).dtype
    state = {name: tensor.to(dtype=dtype_t) for name, tensor in state.items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [name for name in missing if not name.endswith("._extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"HF -> Megatron weights mismatch: missing {missing}, unexpected {unexpected}")
    _norms_in(module, dtype_t)
    if getattr(module, "position_embedding_type", None) == "rope":
        # linear / YaRN RoPE (a family's args without `rope_scaling` has none)
        scaling = getattr(args, "rope_scaling", None)
        if scaling is not None:
            rope_scaling.install(module, scaling, args.rope_theta)
        RopeFromPositionIds.install(module)
    if family.finish_model is not None:
        family.finish_model(args, module)
    if transformer_config.recompute_granularity == "full" and getattr(module, "embedding", None) is not None:
        _embedding_requires_grad(module)
    return MegatronModel(
        module=module,
        family=family,
        args=args,
        vocab_size=args.vocab_size,
        padded_vocab_size=kwargs["vocab_size"],
        device=device,
        uses_te=use_te,
    )


def _pipeline_config(config: Any, pp: int) -> Any:
    """`config` (a `TransformerConfig`) for `pp` pipeline stages: megatron-core's even split of
    the layers (`get_num_layers_to_build`), stage-to-stage tensors in the parameter dtype, and
    shapes sent before each tensor (`variable_seq_lengths`: every microbatch is cut to its own
    length, `TrainerEngine._real_columns`). Sends are plain isend/irecv (`batch_p2p_comm` off:
    gloo has no batched point-to-point). Rebuilt with `dataclasses.replace`, so the config's own
    checks run for the new sizes."""
    import dataclasses

    return dataclasses.replace(
        config,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=config.params_dtype,
        variable_seq_lengths=True,
        batch_p2p_comm=False,
        # megatron-core refuses variable lengths with the allgather dispatcher, dense models
        # included (its default; a dense model dispatches no tokens)
        moe_token_dispatcher_type="alltoall" if not config.num_moe_experts else config.moe_token_dispatcher_type,
    )


def _recompute_config(config: Any, recompute: Any) -> Any:
    """`config` (a `TransformerConfig`) with `recompute`'s activation recomputation
    (`TrainerSpec.recompute`): "selective" sets `recompute_granularity="selective"` and its
    `recompute_modules` (a dense model's "mlp" is megatron-core's "moe" on an MoE layer); "full"
    sets `recompute_granularity="full"` with `recompute_method="uniform"` and one layer a chunk, or
    `"block"` and `recompute_layers` layers of each stage. Rebuilt with `dataclasses.replace`, so
    megatron-core's own checks run. Full recomputation re-enters autograd from each chunk's input
    (`tensor_parallel.checkpoint`), which must require grad for the LoRA weights inside to get
    theirs: the first stage's embedding output is marked so (`_embedding_requires_grad`)."""
    import dataclasses

    if recompute.recompute == "selective":
        modules = [
            "moe" if name == "mlp" and config.num_moe_experts else name
            for name in recompute.recompute_modules
        ]
        return dataclasses.replace(config, recompute_granularity="selective", recompute_modules=modules)
    layers = recompute.recompute_layers
    return dataclasses.replace(
        config,
        recompute_granularity="full",
        recompute_method="uniform" if layers is None else "block",
        recompute_num_layers=1 if layers is None else layers,
    )


def _embedding_requires_grad(module: Any) -> None:
    """Make the embedding's output require grad (a forward hook), so megatron-core's reentrant
    checkpoint of the first layers (full recomputation) runs its backward through the frozen base
    model to the LoRA weights: with every base weight frozen, nothing before the first LoRA
    linear requires grad, and a reentrant checkpoint whose inputs need no grad gets none."""

    def hook(_module: Any, _args: Any, output: Any) -> Any:
        return output.requires_grad_(True) if not output.requires_grad else output

    module.embedding.register_forward_hook(hook)


_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _stage_state(state: dict[str, Any], model_keys: set[str], layers: Any) -> dict[str, Any]:
    """The tensors of this pipeline stage from the whole model's Megatron `state`.

    A stage's `decoder.layers` are numbered from 0 while each `TransformerLayer` knows its global
    `layer_number` (from 1): global layer g is local layer g - offset. The embedding, the final
    norm and the output layer are kept where the stage has them (`model_keys`). With tied
    embeddings the last stage has its own output-layer weight (megatron-core zeroes it and sums
    it with the first stage's over the embedding group, `LanguageModule.setup_embeddings_and_output_layer`):
    it gets the embedding matrix, as the tie says.
    """
    offset = layers[0].layer_number - 1
    count = len(layers)
    out = {}
    for name, tensor in state.items():
        match = _LAYER_KEY.match(name)
        if match is not None:
            local = int(match.group(1)) - offset
            if 0 <= local < count:
                out[f"decoder.layers.{local}.{match.group(2)}"] = tensor
        elif name in model_keys:
            out[name] = tensor
    if "output_layer.weight" in model_keys and "output_layer.weight" not in out:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out


def _norms_in(module: Any, dtype: Any) -> None:
    """Cast the local spec's torch norm weights to the model's parameter dtype.

    megatron-core's `WrappedTorchNorm` builds `torch.nn.RMSNorm`/`LayerNorm` without a dtype, so
    with bf16 parameters the norms stay fp32 and torch falls back from its fused norm kernel
    ("Mismatch dtype between input and weight", seen on an H200); Megatron's own bf16 training
    casts the whole module (`Float16Module`), norms included. A no-op for fp32.
    """
    import torch

    for child in module.modules():
        if isinstance(child, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            child.to(dtype)


def _rename_for_spec(state: dict[str, Any], model_keys: set[str], name_map: dict[str, str]) -> dict[str, Any]:
    """Rename local-spec keys to the spec's names where the model lacks them (TE fused norms)."""
    renamed = {}
    for name, tensor in state.items():
        if name not in model_keys:
            for local, fused in name_map.items():
                if name.endswith(local) and name[: -len(local)] + fused in model_keys:
                    name = name[: -len(local)] + fused
                    break
        renamed[name] = tensor
    return renamed


class RopeFromPositionIds:
    """Make a GPTModel's rotary embedding follow its `position_ids` argument.

    megatron-core's GPTModel ignores `position_ids` under RoPE: it rotates token t of every row
    by angle t (`models/gpt/gpt_model.py` _preprocess calls `rotary_pos_emb(rotary_seq_len)`).
    Packed rows restart positions at each document, as vLLM does; RoPE is relative, so the two
    agree in exact arithmetic, but only position-based angles match the inference engine to the
    last bit. `install` adds a forward pre-hook on the GPTModel that records `position_ids`, and
    a forward hook on its `RotaryEmbedding` that replaces the [s, 1, 1, d] angle table with a
    per-row [s, b, 1, d] table computed from them the same way (`get_emb`: positions outer
    inv_freq, halves concatenated, or interleaved); attention's unfused RoPE broadcasts over
    the batch dimension. Positions 0..s-1 give bit-identical angles to Megatron's own.
    Under context parallelism the model gets this CP rank's positions
    (`logprobs.forward_logits` slices `position_ids` with the tokens), so the table is already
    the rank's own and replaces Megatron's CP-sliced one as it is.
    """

    def __init__(self) -> None:
        self.position_ids = None

    @classmethod
    def install(cls, module: Any) -> RopeFromPositionIds:
        """Hook `module` (a GPTModel with RoPE); returns the hook state."""
        if getattr(module.config, "apply_rope_fusion", False):
            raise NotImplementedError("RoPE from position_ids with apply_rope_fusion")
        state = cls()
        module.register_forward_pre_hook(state._record, with_kwargs=True)
        module.register_forward_hook(state._clear)
        module.rotary_pos_emb.register_forward_hook(state._angles)
        return state

    def _record(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.position_ids = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

    def _clear(self, module: Any, args: tuple, output: Any) -> None:
        self.position_ids = None

    def _angles(self, rope: Any, args: tuple, output: Any) -> Any:
        positions = self.position_ids
        if positions is None:
            return output
        table = rope_table(
            positions, rope.inv_freq, rope.seq_len_interpolation_factor, rope.rotary_interleaved
        )
        return table.to(output.dtype)


def rope_table(positions: Any, inv_freq: Any, interpolation_factor: float | None, interleaved: bool) -> Any:
    """RoPE angles [s, b, 1, d] (inv_freq's dtype) of `positions` [b, s] (int64): position / factor
    (megatron-core's `seq_len_interpolation_factor`, HF's "linear" RoPE) outer `inv_freq` [d/2],
    halves concatenated (or interleaved), as megatron-core's `RotaryEmbedding.get_emb`."""
    import torch

    seq = positions.to(device=inv_freq.device, dtype=inv_freq.dtype)
    if interpolation_factor is not None:
        seq = seq * (1 / interpolation_factor)
    freqs = seq.transpose(0, 1)[..., None] * inv_freq  # [s, b, d/2]
    if interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, :, None, :]
