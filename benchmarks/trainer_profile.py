"""Where one GRPO train step's time goes on one GPU: torch.profiler over `TrainerEngine.train_step`.

    python benchmarks/trainer_profile.py [--dtype bfloat16|float32] [--seq-len 4096]
        [--micro-batch-rows 1,4] [--documents 64] [--document-tokens 1024] [--top 14]

One process, one rank (NCCL on cuda:0, or gloo on CPU when no GPU is visible): a SmolLM2-135M-
shaped Llama with seeded random weights (`device_check._smollm2_shaped`, no download), LoRA r=8
on every default target, a seeded batch of `--documents` x `--document-tokens` tokens packed into
`--seq-len` rows. For each micro-batch size it prints the mean of three timed steps after one
warm-up (seconds and tokens/s), the peak allocated GPU memory, then one profiled step of the
first micro-batch size: self CUDA time and self CPU time totals and the top operators by each.
CPU time well above CUDA time means the step is bound by kernel launches (small microbatches);
the reverse, by kernels. Figures are printed, never asserted; the H200 run is in RESULTS.md's
notes. Bad arguments: one sentence on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one sentence, not argparse's usage block
        print(f"trainer_profile.py: error: {message}; see --help", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the command line; exits 2 with one sentence on a bad value."""
    parser = _Parser(prog="trainer_profile.py", allow_abbrev=False)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-rows", default="1,4", help="comma-separated sizes to time")
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--document-tokens", type=int, default=1024)
    parser.add_argument("--top", type=int, default=14, help="operators listed per table")
    args = parser.parse_args(argv)
    try:
        args.micro_batch_rows = [int(v) for v in args.micro_batch_rows.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--micro-batch-rows {args.micro_batch_rows!r} must be whole numbers, e.g. 1,4")
    for name in ("seq_len", "documents", "document_tokens", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.micro_batch_rows or min(args.micro_batch_rows) < 1:
        parser.error("--micro-batch-rows needs sizes of at least 1, e.g. 1,4")
    if args.document_tokens > args.seq_len:
        parser.error(f"--document-tokens {args.document_tokens} exceeds --seq-len {args.seq_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    on_gpu = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="art-mega-profile-"))
    try:
        return _profile(args, work, on_gpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the random weights are ~0.5 GB


def _profile(args: argparse.Namespace, work: Path, on_gpu: bool) -> int:
    import torch
    from device_check import SMOLLM2_SHAPE, _smollm2_shaped
    from torch.profiler import ProfilerActivity, profile

    from art_mega.agent.ports import free_port
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.groups import rank_coordinates
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.batch import Document, pack
    from art_mega.trainer.protocol import LoraConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

    model_dir = _smollm2_shaped(work / "smollm2-shape")
    rank = TrainerRank(
        rank=0, host_id="local", local_rank=0, gpu_id=0 if on_gpu else None, **rank_coordinates(0, 1)
    )
    state = init_parallel(rank, TrainerSpec(), 1, master_addr="127.0.0.1", master_port=free_port())
    rng = random.Random(0)
    length, prompt = args.document_tokens, args.document_tokens // 4
    documents = [
        Document(
            [rng.randrange(SMOLLM2_SHAPE["vocab_size"]) for _ in range(length)],
            [0.0] * prompt + [1.0] * (length - prompt),
            [-2.0] * length,
            1.0 if i % 2 else -1.0,
            1.0 / (length - prompt),
        )
        for i in range(args.documents)
    ]
    (batch,) = pack(documents, args.seq_len, 1)
    tokens = args.documents * length

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    try:
        engine = TrainerEngine(model_dir, state, lora=LoraConfig(rank=8, alpha=16), dtype=args.dtype)
        print(f"{args.dtype}, {batch.shape[0]} rows x {args.seq_len} tokens, {tokens} document tokens")
        for rows in args.micro_batch_rows:
            engine.micro_batch_rows = rows
            engine.train_step(batch)
            sync()
            started = time.perf_counter()
            for _ in range(3):
                engine.train_step(batch)
            sync()
            step_s = (time.perf_counter() - started) / 3
            print(
                f"micro_batch_rows={rows}: {step_s:.3f} s per step, {tokens / step_s:.0f} tokens/s",
                flush=True,
            )
        if on_gpu:
            print(f"peak allocated GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        engine.micro_batch_rows = args.micro_batch_rows[0]
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            engine.train_step(batch)
            sync()
        averages = prof.key_averages()
        if on_gpu:
            print(
                averages.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=60)
            )
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    finally:
        destroy_parallel()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
