"""The CPU compatibility layer, patch by patch: each Megatron call fails without its patch and
works with it (on a CPU-only torch), and the layer refuses megatron-core series it does not know.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from art_mega.errors import UserError
from art_mega.trainer.rank import cpu_compat
from tests.trainer.common import require_trainer_deps

require_trainer_deps()

import torch  # noqa: E402

CUDA_MISSING = (AssertionError, RuntimeError)
"""What torch raises for a CUDA call without CUDA ("Torch not compiled with CUDA enabled")."""


@pytest.fixture
def only_patch() -> Iterator[object]:
    """Remove every patch, yield `apply(name)`, then restore the patches and RNG states from before."""
    from megatron.core.tensor_parallel import random as mcore_random

    before = cpu_compat.applied_patches()
    tracker = mcore_random._CUDA_RNG_STATE_TRACKER
    states = dict(tracker.get_states()) if tracker is not None and tracker.is_initialized() else None
    cpu_compat.remove_cpu_compat()
    yield lambda name: cpu_compat.apply_cpu_compat([name])
    cpu_compat.remove_cpu_compat()
    cpu_compat.apply_cpu_compat(before)
    if states is not None:
        mcore_random.get_cuda_rng_tracker().set_states(states)


def unpatched_fails(call) -> None:
    """Assert that `call()` hits a CUDA call (only meaningful where torch has no CUDA)."""
    if torch.cuda.is_available():
        return
    with pytest.raises(CUDA_MISSING, match="CUDA"):
        call()


def test_current_device_is_cpu(only_patch) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.utils import GlobalMemoryBuffer

    def rope():  # rotary_pos_embedding.py:162 moves inv_freq to the current device
        return RotaryEmbedding(kv_channels=32, rotary_percent=1.0, use_cpu_initialization=True)(8)

    def buffer():  # utils.py:631 allocates the global buffer on the current device
        return GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")

    unpatched_fails(rope)
    unpatched_fails(buffer)
    only_patch("current_device_is_cpu")
    assert rope().shape == (8, 1, 1, 32)
    assert buffer().device.type == "cpu"
    assert cpu_compat.applied_patches() == ("current_device_is_cpu",)


def test_cpu_rng_tracker(only_patch) -> None:
    from megatron.core import tensor_parallel

    def seed(tp_rank: int) -> None:
        tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=tp_rank, ep_rank=0, etp_rank=0)

    def forked() -> torch.Tensor:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return torch.rand(4)

    unpatched_fails(lambda: seed(0))
    only_patch("cpu_rng_tracker")
    torch.manual_seed(1)
    outer = torch.rand(4)
    torch.manual_seed(1)
    seed(0)
    first = forked()
    assert torch.equal(torch.rand(4), outer), "forking must leave the default CPU generator untouched"
    assert not torch.equal(forked(), first), "the model-parallel stream advances between forks"
    seed(1)
    assert not torch.equal(forked(), first), "TP ranks get different model-parallel streams"
    seed(0)
    assert torch.equal(forked(), first), "the same seed and TP rank repeat the stream"


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_cpu_causal_masks(only_patch, window) -> None:
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=False,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
        window_size=window,
    )
    scores = torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(0))
    unpatched_fails(lambda: softmax(scores, None))
    only_patch("cpu_causal_masks")
    rows, cols = torch.arange(5)[:, None], torch.arange(5)[None, :]
    masked = cols > rows
    if window is not None:
        masked |= cols < rows - window[0]
    expected = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
    torch.testing.assert_close(softmax(scores, None), expected)


def test_version_gate_and_bookkeeping(only_patch) -> None:
    assert cpu_compat.check_megatron_version().startswith("0.16.")
    assert cpu_compat.check_megatron_version("0.16.9") == "0.16.9"
    with pytest.raises(UserError) as caught:
        cpu_compat.check_megatron_version("0.17.0")
    assert str(caught.value) == (
        "megatron-core 0.17.0 is installed but art-mega's CPU compatibility layer knows only 0.16.x; "
        "install 'megatron-core>=0.16,<0.17'."
    )
    with pytest.raises(KeyError, match="unknown CPU patch 'nope'"):
        cpu_compat.apply_cpu_compat(["nope"])
    original = torch.cuda.current_device
    assert cpu_compat.apply_cpu_compat() == tuple(cpu_compat.PATCHES)
    assert cpu_compat.apply_cpu_compat() == tuple(cpu_compat.PATCHES), "idempotent"
    assert torch.cuda.current_device() == "cpu"
    cpu_compat.remove_cpu_compat()
    assert torch.cuda.current_device is original and cpu_compat.applied_patches() == ()
    assert cpu_compat.needs_cpu_compat("cpu") and cpu_compat.needs_cpu_compat(torch.device("cpu"))
    assert not cpu_compat.needs_cpu_compat("cuda:0")


def _toy_optimizer(dtype: torch.dtype):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    param = torch.nn.Parameter(torch.ones(2, 3, dtype=dtype))
    adam = torch.optim.AdamW([param], lr=0.1)
    if dtype == torch.float32:
        return FP32Optimizer(adam, OptimizerConfig(lr=0.1), lambda opt: None)
    return Float16OptimizerWithFloat16Params(adam, OptimizerConfig(lr=0.1, bf16=True), None, lambda opt: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_optimizer_tensors(only_patch, dtype) -> None:
    unpatched_fails(lambda: _toy_optimizer(dtype))
    only_patch("cpu_optimizer_tensors")
    optimizer = _toy_optimizer(dtype)
    assert optimizer.get_loss_scale().device.type == "cpu"
    if dtype == torch.bfloat16:  # the bf16 parameter got an fp32 main copy (dtype check, not type())
        assert optimizer.fp32_from_float16_groups[0][0].dtype == torch.float32


def test_cpu_grad_norm(only_patch, megatron_world) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        count_zeros_fp32,
        get_grad_norm_fp32,
    )

    group = mpu.get_model_parallel_group()
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])

    def calls() -> tuple[float, float, float]:
        norm = get_grad_norm_fp32([param.grad], grad_stats_parallel_group=group)
        zeros = count_zeros_fp32([param], grad_stats_parallel_group=group)
        clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=norm)
        return norm, zeros, float(param.grad.norm())

    unpatched_fails(calls)
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    only_patch("cpu_grad_norm")
    norm, zeros, clipped = calls()
    assert norm == pytest.approx(5.0) and zeros == 2.0 and clipped == pytest.approx(1.0, rel=1e-5)


def test_cpu_schedule_tokens(only_patch, megatron_world) -> None:
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    class Toy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = ModelParallelConfig()
            self.model_type = ModelType.encoder_or_decoder
            self.weight = torch.nn.Parameter(torch.tensor(2.0))

        def set_input_tensor(self, tensor) -> None:  # the schedule's pipeline hook (unused at pp=1)
            pass

    toy = Toy()

    def step(data, model):
        x = next(data)
        return model.weight * x, lambda out: (out.sum(), {"loss": out.sum().detach()})

    def run():
        return forward_backward_no_pipelining(
            forward_step_func=step,
            data_iterator=iter([torch.ones(3)]),
            model=[toy],
            num_microbatches=1,
            seq_length=3,
            micro_batch_size=1,
            forward_only=True,
        )

    unpatched_fails(run)
    only_patch("cpu_schedule_tokens")
    assert float(run()[0]["loss"]) == 6.0


def test_rewrite_refuses_changed_source(only_patch) -> None:
    from megatron.core.pipeline_parallel import schedules

    log: list = []
    with pytest.raises(RuntimeError, match="forward_backward_no_pipelining contains 'no such text' 0 times"):
        cpu_compat._rewrite(log, schedules, "forward_backward_no_pipelining", [("no such text", "x", 1)])
    assert log == []


def test_cpu_moe_router_gemm(only_patch) -> None:
    from megatron.core.transformer.moe import moe_utils

    generator = torch.Generator().manual_seed(0)
    inp, weight = torch.randn(5, 8, generator=generator), torch.randn(4, 8, generator=generator)

    def route():  # moe_utils.py:1192 names te_general_gemm, bound only when TE imports
        return moe_utils.router_gating_linear(inp, weight, None, torch.float32)

    if not moe_utils.HAVE_TE:
        with pytest.raises(NameError, match="te_general_gemm"):
            route()
    only_patch("cpu_moe_router_gemm")
    torch.testing.assert_close(route(), inp @ weight.T)
    cpu_compat.remove_cpu_compat()
    assert moe_utils.HAVE_TE or not hasattr(moe_utils, "te_general_gemm"), "undo removes the name"


def _moe_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        num_moe_experts=2,
        moe_router_topk=2,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=True,
        **overrides,
    )


def test_cpu_alltoall_dispatcher(only_patch, megatron_world) -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    groups = ProcessGroupCollection.use_mpu_process_groups()

    def make():  # token_dispatcher.py:445 creates a torch.cuda.Stream
        return MoEAlltoAllTokenDispatcher(2, [0, 1], _moe_config(), groups)

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
    unpatched_fails(make)
    only_patch("cpu_alltoall_dispatcher")
    dispatcher = make()
    hidden = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    probs = torch.tensor([[0.25, 0.75], [1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.9, 0.1], [0.3, 0.7]])
    routing_map = probs > 0
    tokens, token_probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    tokens, token_probs = dispatcher.token_dispatch(tokens, token_probs)
    tokens, per_expert, token_probs = dispatcher.dispatch_postprocess(tokens, token_probs)
    assert per_expert.tolist() == [5, 5]
    assert all(not torch.is_tensor(getattr(dispatcher, name)) for name in ("input_splits", "output_splits"))
    # experts that return their input: the combined output is the input times its routed probs
    out = dispatcher.combine_postprocess(
        dispatcher.token_combine(dispatcher.combine_preprocess(tokens * token_probs[:, None]))
    )
    torch.testing.assert_close(out, hidden)
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None


def test_cpu_sequence_parallel_norm(only_patch) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        normalization="RMSNorm",
        use_cpu_initialization=True,
    )

    def make():  # torch_norm.py:32 asserts not config.sequence_parallel
        return WrappedTorchNorm(config, 8, eps=1e-6)

    with pytest.raises(AssertionError, match="sequence parallel"):
        make()
    only_patch("cpu_sequence_parallel_norm")
    norm = make()
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    assert config.sequence_parallel, "the caller's config is not changed"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_cpu_checkpoint_rng(only_patch) -> None:
    """Activation recomputation's checkpoint saves and restores the CUDA generator's state
    (`tensor_parallel/random.py:444-460`); patched, it keeps the CPU generator's, so a dropout
    inside a recomputed chunk draws the same mask in the backward as in the forward."""
    from megatron.core import tensor_parallel

    weight = torch.randn(6, requires_grad=True)

    def chunk(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x * weight, p=0.5)

    def checkpointed() -> torch.Tensor:
        x = torch.randn(6, requires_grad=True)
        tensor_parallel.checkpoint(chunk, False, x).sum().backward()
        return weight.grad

    unpatched_fails(checkpointed)
    only_patch("cpu_checkpoint_rng")
    torch.manual_seed(3)
    x = torch.randn(6, requires_grad=True)
    tensor_parallel.checkpoint(chunk, False, x).sum().backward()
    recomputed = weight.grad.clone()
    weight.grad = None
    torch.manual_seed(3)
    x = torch.randn(6, requires_grad=True)
    chunk(x).sum().backward()
    assert torch.equal(recomputed, weight.grad), "the recomputed dropout mask is the forward's"
    assert (recomputed == 0).any() and (recomputed != 0).any()
