"""LoRA configuration, initialisation, the PEFT name and layout mapping, and the packed-row
helpers, pinned on small tensors (no Megatron world needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the cpu extra (torch) is not installed")

from art_mega.errors import UserError  # noqa: E402
from art_mega.trainer.families.layout import fc1_shard, fuse_qkv, shard  # noqa: E402
from art_mega.trainer.families.llama import SPEC  # noqa: E402
from art_mega.trainer.peft_config import check_adapter_config  # noqa: E402
from art_mega.trainer.peft_io import adapter_config  # noqa: E402
from art_mega.trainer.protocol import LoraConfig  # noqa: E402
from art_mega.trainer.rank.logprobs import _mask_padded_vocab, _shift_to_token, packed_attention_mask  # noqa: E402
from art_mega.trainer.rank.lora import init_lora_a  # noqa: E402
from art_mega.trainer.rank.step_loss import _document_layout, _token_ratios  # noqa: E402

megatron_to_hf, hf_to_megatron = SPEC.lora.to_peft, SPEC.lora.from_peft


def test_targets_accept_megatron_and_hf_names() -> None:
    config = LoraConfig(rank=4, alpha=8, targets=("o_proj", "q_proj", "k_proj", "v_proj", "linear_fc2"))
    assert config.targets == ("linear_qkv", "linear_proj", "linear_fc2")
    assert config.scaling == 2.0
    assert config.hf_target_modules() == ["down_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    assert LoraConfig().targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"targets": ("q_proj", "v_proj")},
            "LoRA targets ['q_proj', 'v_proj'] need all of ['q_proj', 'k_proj', 'v_proj']: "
            "Megatron fuses them into linear_qkv, which takes one adapter.",
        ),
        ({"targets": ("lm_head",)}, "LoRA target 'lm_head' is not known; use some of: linear_qkv,"),
        ({"rank": 0}, "LoRA rank=0 must be at least 1."),
        ({"targets": ()}, "LoRA targets are empty; name at least one layer."),
    ],
)
def test_bad_configs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError) as caught:
        LoraConfig(**kwargs)
    assert str(caught.value).startswith(message)


def test_a_is_seeded_by_layer_and_independent_of_layout() -> None:
    a = init_lora_a(0, "decoder.layers.0.mlp.linear_fc2", 4, 256)
    assert torch.equal(a, init_lora_a(0, "decoder.layers.0.mlp.linear_fc2", 4, 256))
    assert not torch.equal(a, init_lora_a(0, "decoder.layers.1.mlp.linear_fc2", 4, 256))
    assert not torch.equal(a, init_lora_a(1, "decoder.layers.0.mlp.linear_fc2", 4, 256))
    assert a.shape == (4, 256) and a.abs().max() <= 1 / 16 and a.std() > 0.02


def test_packed_mask_is_block_diagonal_causal() -> None:
    mask = packed_attention_mask(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    allowed = (~mask[0, 0]).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees itself only
    ]
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool


def test_predictions_move_onto_the_predicted_token() -> None:
    values = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0]])
    segments = torch.tensor([[1, 1, 1, 2, 2]])
    assert _shift_to_token(values, None).tolist() == [[0.0, 10.0, 11.0, 12.0, 13.0]]
    assert _shift_to_token(values, segments).tolist() == [[0.0, 10.0, 11.0, 0.0, 13.0]]


def test_padded_vocabulary_columns_are_masked_on_the_last_rank() -> None:
    logits = torch.zeros(1, 1, 4)
    assert _mask_padded_vocab(logits, vocab_size=7, tp_rank=0) is logits
    masked = _mask_padded_vocab(logits, vocab_size=7, tp_rank=1)  # ids 4..7 here, 7 is padding
    assert masked[0, 0, :3].tolist() == [0.0, 0.0, 0.0] and masked[0, 0, 3] == torch.finfo(torch.float32).min


def test_documents_are_laid_out_one_per_row() -> None:
    rows, cols, valid = _document_layout(torch.tensor([[1, 1, 2, 0], [1, 1, 1, 1]]))
    assert rows.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert cols.tolist() == [[0, 1, 0, 0], [2, 0, 0, 0], [0, 1, 2, 3]]
    assert valid.int().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_sequence_ratios_are_length_normalised_per_document() -> None:
    new = torch.tensor([[0.0, -1.0, -2.0], [0.0, -1.0, 0.0]])
    old = torch.tensor([[0.0, -2.0, -2.0], [0.0, -1.5, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    token = _token_ratios(new, old, mask, "token")
    assert token.tolist() == pytest.approx([torch.e, 1.0, torch.e**0.5])
    sequence = _token_ratios(new, old, mask, "sequence")
    assert sequence.tolist() == pytest.approx([torch.e**0.5, torch.e**0.5, torch.e**0.5])


HEADS, GROUPS, HEAD_DIM, HIDDEN, FFN, RANK = 4, 2, 3, 5, 6, 2


def _megatron_full() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Full (unsharded) Megatron A and B of each target of layer 7, random."""
    g = torch.Generator().manual_seed(0)
    qkv_rows = (HEADS + 2 * GROUPS) * HEAD_DIM
    return {
        "decoder.layers.7.self_attention.linear_qkv": (
            torch.randn(RANK, HIDDEN, generator=g),
            torch.randn(qkv_rows, RANK, generator=g),
        ),
        "decoder.layers.7.self_attention.linear_proj": (
            torch.randn(RANK, HEADS * HEAD_DIM, generator=g),
            torch.randn(HIDDEN, RANK, generator=g),
        ),
        "decoder.layers.7.mlp.linear_fc2": (
            torch.randn(RANK, FFN, generator=g),
            torch.randn(HIDDEN, RANK, generator=g),
        ),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_peft_mapping_round_trips_for_every_tp_rank(tp: int) -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(FFN, RANK, generator=g), torch.randn(FFN, RANK, generator=g)
    fc1_a = torch.randn(RANK, HIDDEN, generator=g)
    layers = _megatron_full()
    hf: dict[str, torch.Tensor] = {}
    for name, (a, b) in layers.items():
        row_parallel = name.endswith(("linear_proj", "linear_fc2"))
        b_shards = [b] if row_parallel else [shard(b, 0, tp, r) for r in range(tp)]
        hf.update(megatron_to_hf(name, a, b_shards, HEADS, GROUPS))
    hf.update(
        megatron_to_hf(
            "decoder.layers.7.mlp.linear_fc1",
            fc1_a,
            [fc1_shard(gate, up, tp, r) for r in range(tp)],
            HEADS,
            GROUPS,
        )
    )
    prefix = "base_model.model.model.layers.7."
    assert torch.equal(hf[prefix + "mlp.gate_proj.lora_B.weight"], gate)
    assert torch.equal(hf[prefix + "mlp.up_proj.lora_B.weight"], up)
    assert torch.equal(hf[prefix + "mlp.up_proj.lora_A.weight"], fc1_a)
    q_b = hf[prefix + "self_attn.q_proj.lora_B.weight"]
    k_b = hf[prefix + "self_attn.k_proj.lora_B.weight"]
    v_b = hf[prefix + "self_attn.v_proj.lora_B.weight"]
    assert (q_b.shape, k_b.shape) == ((HEADS * HEAD_DIM, RANK), (GROUPS * HEAD_DIM, RANK))
    assert torch.equal(
        fuse_qkv(q_b, k_b, v_b, HEADS, GROUPS), layers["decoder.layers.7.self_attention.linear_qkv"][1]
    )
    for r in range(tp):
        for name, (a, b) in layers.items():
            got_a, got_b = hf_to_megatron(name, hf, HEADS, GROUPS, tp, r)
            if name.endswith(("linear_proj", "linear_fc2")):
                assert torch.equal(got_a, shard(a, 1, tp, r)) and torch.equal(got_b, b)
            else:
                assert torch.equal(got_a, a) and torch.equal(got_b, shard(b, 0, tp, r))
        got_a, got_b = hf_to_megatron("decoder.layers.7.mlp.linear_fc1", hf, HEADS, GROUPS, tp, r)
        assert torch.equal(got_a, fc1_a) and torch.equal(got_b, fc1_shard(gate, up, tp, r))


def test_import_refuses_what_one_fused_adapter_cannot_hold() -> None:
    name = "decoder.layers.7.self_attention.linear_qkv"
    a, b = _megatron_full()[name]
    hf = megatron_to_hf(name, a, [b], HEADS, GROUPS)
    hf["base_model.model.model.layers.7.self_attn.k_proj.lora_A.weight"] = a + 1
    with pytest.raises(UserError, match="layer 7's q_proj, k_proj, v_proj have different lora_A matrices"):
        hf_to_megatron(name, hf, HEADS, GROUPS, 1, 0)
    del hf["base_model.model.model.layers.7.self_attn.v_proj.lora_B.weight"]
    with pytest.raises(
        UserError, match="no tensor base_model.model.model.layers.7.self_attn.v_proj.lora_B.weight"
    ):
        hf_to_megatron(name, hf, HEADS, GROUPS, 1, 0)


def test_adapter_config_and_compatibility_check(tmp_path) -> None:
    config = LoraConfig(rank=4, alpha=8.0)
    written = adapter_config(config, "/models/tiny")
    assert (written["r"], written["lora_alpha"], written["base_model_name_or_path"]) == (4, 8, "/models/tiny")
    assert written["peft_type"] == "LORA" and written["lora_dropout"] == 0.0
    lora = {"rank": config.rank, "alpha": config.alpha, "target_modules": config.hf_target_modules()}
    check_adapter_config(written, tmp_path, **lora)
    other = {**written, "r": 8, "target_modules": ["q_proj"]}
    with pytest.raises(UserError) as caught:
        check_adapter_config(other, tmp_path, **lora)
    assert str(caught.value) == (
        f"the warm-start adapter {tmp_path} does not match this backend's LoRA: it has r=8 where the "
        "backend's lora_rank=4, and target_modules=['q_proj'] where the backend's LoRA covers "
        "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']; warm-start "
        "from an adapter trained with the backend's settings"
    )
