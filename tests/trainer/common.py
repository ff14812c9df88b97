"""Inputs and helpers shared by the trainer tests and their gloo worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from art_mega.agent.ports import free_port

TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    # One KV head: TP=2 exceeds the KV heads, Megatron's all-gather path for shared KV heads.
    "qwen2_1kv": ("qwen2", {"num_kv_heads": 1}),
    "qwen3_1kv": ("qwen3", {"num_kv_heads": 1}),
    # Three heads cannot be split two ways: the divisibility error.
    "llama_3heads": (
        "llama",
        {"num_heads": 3, "num_kv_heads": 3, "hidden_size": 96, "intermediate_size": 192},
    ),
}
"""Test model name -> (arch, build_tiny_model size arguments)."""

EQUIVALENCE_MODELS = ("llama", "qwen2", "qwen3", "qwen2_1kv", "qwen3_1kv")
BATCH, SEQ = 2, 24


def require_trainer_deps() -> None:
    """Skip the calling test module unless megatron-core and transformers (the cpu extra) import."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the cpu extra)")
    pytest.importorskip("transformers", reason="transformers is not installed (the cpu extra)")


def input_ids(vocab_size: int):
    """Fixed token ids [BATCH, SEQ] (int64), the same in every process."""
    import torch

    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1234))


def megatron_logits(built, ids):
    """Full-vocabulary logits [b, s, vocab] (float32) of a `MegatronModel`, gathered over TP
    (and over CP: `forward_logits` runs this CP rank's positions)."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from art_mega.trainer.rank.cp_attention import gather_from_cp_ranks
    from art_mega.trainer.rank.logprobs import forward_logits

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        shard = forward_logits(built.module, ids, positions)
        full = gather_from_tensor_model_parallel_region(shard, mpu.get_tensor_model_parallel_group())
        full = gather_from_cp_ranks(full, mpu.get_context_parallel_group(), dim=1)[:, : ids.shape[1]]
    return full[..., : built.vocab_size].float()


def shard_of(name: str, full, got, size: int, rank: int):
    """The piece of the one-process tensor `full` that a TP / expert-TP rank holds as `got`:
    linear_fc1's B as `fc1_shard` splits the fused gate/up rows, else a chunk along the one
    dimension that differs (B's rows of a column layer, A's columns of a row layer)."""
    from art_mega.trainer.families.layout import fc1_shard

    if got.shape == full.shape:
        return full
    if name.endswith("linear_fc1.lora_B"):
        gate, up = full.chunk(2, dim=0)
        return fc1_shard(gate, up, size, rank)
    dim = next(d for d in range(full.dim()) if got.shape[d] != full.shape[d])
    return full.chunk(size, dim=dim)[rank]


class RankProcesses:
    """A gloo world of `world` processes running `python -m MODULE RANK WORLD OUT PORT_A PORT_B NAME=DIR...`
    (through `tests.trainer.launch`: without the imports a rank blocks).

    Started on construction (one thread each, output captured); `results()` waits for them and
    returns each rank's `OUT/rankR.pt`; `kill()` ends those still running.
    """

    def __init__(self, module: str, out: Path, models: dict[str, Path], world: int = 2) -> None:
        from tests.conftest import REPO

        self.out = out
        self.world = world
        ports = [str(free_port()), str(free_port())]
        pairs = [f"{name}={path}" for name, path in models.items()]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.trainer.launch",
                    module,
                    str(rank),
                    str(world),
                    str(out),
                    *ports,
                    *pairs,
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]

    def results(self, timeout: float = 240) -> list[dict]:
        import torch

        logs = []
        for proc in self.procs:
            try:
                logs.append(proc.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        for rank, proc in enumerate(self.procs):
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{logs[rank][-4000:]}"
        return [torch.load(self.out / f"rank{rank}.pt", weights_only=False) for rank in range(self.world)]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class MetaMapper:
    """One `tests.trainer.meta_mapping_worker` process serving every meta-device mapping of a test
    session (`map`), its files under `root`; `close()` ends it."""

    def __init__(self, root: Path) -> None:
        from tests.conftest import REPO

        self.root = root
        self.count = 0
        self.stderr = open(root / "stderr.txt", "w")  # a file: a full pipe would stall the worker
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.trainer.launch", "tests.trainer.meta_mapping_worker"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def map(self, config: dict, tp: int, ep: int) -> dict:
        """The worker's result dict for an HF config dict at these TP / EP sizes; AssertionError
        with the worker's traceback when the mapping raised, or its stderr when it died."""
        import json

        self.count += 1
        out = self.root / f"map{self.count}.json"
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"config": config, "tp": tp, "ep": ep, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        while (line := self.proc.stdout.readline()) and line.strip() != f"MAPPED {out}":
            pass  # anything else the libraries print
        assert line, f"the meta-mapping worker died:\n{(self.root / 'stderr.txt').read_text()[-3000:]}"
        reply = json.loads(out.read_text())
        assert "error" not in reply, reply.get("error")
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()
