"""Builders shared by tests (importable as `helpers`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, compile_topology


def loopback_cluster(n: int, cpu_slots: int = 1, tmp: str = "/tmp/art-mega-test", **kw) -> ClusterSpec:
    """A cluster of `n` hosts on 127.0.0.(i+1), port 0 (each agent picks a free port)."""
    hosts = tuple(
        HostSpec(
            host_id=f"host{i}",
            node_rank=i,
            worker_address=EndpointSpec(host=f"127.0.0.{i + 1}", port=0),
            cpu_slots=cpu_slots,
        )
        for i in range(n)
    )
    return ClusterSpec(
        hosts=hosts,
        controller_host_id="host0",
        artifact_root=f"{tmp}/artifacts",
        cache_root=f"{tmp}/cache",
        allow_shared_kernel=True,
        **kw,
    )


def loopback_topology(n: int, cpu_slots: int = 1, **kw):
    return compile_topology(loopback_cluster(n, cpu_slots, **kw))


def require_vllm() -> None:
    """Skip the calling test when no vLLM interpreter is installed (the backend's own lookup)."""
    import pytest

    from art_mega.backend import default_vllm_python
    from art_mega.errors import UserError

    try:
        default_vllm_python()
    except UserError as exc:
        pytest.skip(str(exc))


def program_workdir(tmp_path: Path, monkeypatch: Any, *, without_wandb: bool = False) -> Path:
    """Run an ART-style program in `tmp_path` (its `.art/` lands there) with the shared
    art-mega model cache; `without_wandb` unsets WANDB_API_KEY so nothing reports to W&B."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ART_MEGA_CACHE", str(Path.home() / ".cache" / "art-mega"))
    if without_wandb:
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve the ASGI `app` (uvicorn, on a thread of its own, so sync and async tests alike can
    call it) on a free loopback port while the block runs; yields its http://127.0.0.1:PORT."""
    import threading
    import time

    import uvicorn

    from art_mega.agent.ports import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def save_checkpoint_step(
    root: Path, step: int, rank: int = 4, commit: bool = True, config_rank: int | None = None
) -> Path:
    """Step `step` of a LoRA of rank `rank` (layer 0's seven modules, hidden size 16) saved under
    `root` (a `checkpoint.checkpoints_dir`) as the ranks save it: staged, adapter_config.json as
    the trainer writes it (`peft_io.adapter_config`; `config_rank` writes another r), weights by
    `safetensors.torch.save_file`, the manifest with their sha256, placed, and with `commit` the
    pointer moved to it. Returns the step folder."""
    import hashlib
    import json

    import torch
    from safetensors.torch import save_file

    from art_mega.trainer import checkpoint as ckpt
    from art_mega.trainer.peft_io import adapter_config
    from art_mega.trainer.protocol import LoraConfig

    lora = LoraConfig(rank=rank, alpha=8.0)
    final = ckpt.step_dir(root, step)
    staging = ckpt.prepare_staging(final)
    torch.manual_seed(step)
    tensors = {}
    for module in lora.hf_target_modules():
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        key = f"base_model.model.model.layers.0.{parent}.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 16)
        tensors[f"{key}.lora_B.weight"] = torch.randn(16, rank)
    weights = ckpt.adapter_dir(staging) / "adapter_model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = adapter_config(lora, "/models/tiny")
    if config_rank is not None:
        config["r"] = config_rank
    (ckpt.adapter_dir(staging) / "adapter_config.json").write_text(json.dumps(config, indent=2))
    ckpt.write_manifest(
        staging,
        ckpt.Manifest(
            step=step,
            adapter_sha256=hashlib.sha256(weights.read_bytes()).hexdigest(),
            base_model="/models/tiny",
            layout=ckpt.ManifestLayout(world_size=1, tp=1, dp=1),
            written_at=1.0,
        ),
    )
    ckpt.place_folder(staging, final)
    if commit:
        ckpt.write_commit(root, step)
    return final


def trained_turns(sequences: Any) -> list[tuple[list[int], list[int], list[float]]]:
    """(context, ids, logprobs) of every run of trained tokens, in order."""
    turns = []
    for seq in sequences:
        k = 0
        while k < len(seq.loss_mask):
            if not seq.loss_mask[k]:
                k += 1
                continue
            end = k
            while end < len(seq.loss_mask) and seq.loss_mask[end]:
                end += 1
            turns.append((seq.input_ids[:k], seq.input_ids[k:end], seq.old_logprobs[k:end]))
            k = end
    return turns
