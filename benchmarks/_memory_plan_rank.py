"""One gloo rank of `benchmarks/memory_plan.py`: what a CPU trainer rank's resident set grows by.

    python benchmarks/_memory_plan_rank.py CONFIG_JSON_PATH

Joins the world (`init_parallel`), reads VmRSS (the libraries imported, nothing of the model
built), builds the engine (`rank.jobs.build_engine`: float32 base weights, LoRA, DDP's gradient
buffer), reads VmRSS again, then runs one GRPO step (`TrainerEngine.train_step`) on ONE packed
row of exactly `seq_len` tokens (one document, `micro_batch_rows` 1, whole-row logprobs), the
first step, so Adam's moments are allocated in it. Writes CONFIG["out"] as JSON, bytes:
base_rss (before the build), built_rss (after it), peak_rss (VmHWM after the step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def status_bytes(field: str) -> int:
    """`field` (VmRSS, VmHWM) of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main(config_path: str) -> int:
    import gc

    import numpy as np
    import torch

    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.batch import Document, pack
    from art_mega.trainer.protocol import EngineConfig
    from art_mega.trainer.rank.jobs import build_engine
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

    config = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    rank, world = int(config["rank"]), int(config["world_size"])
    state = init_parallel(
        TrainerRank.model_validate(config["rank_table"][rank]),
        TrainerSpec.model_validate(config["trainer"]),
        world,
        master_addr="127.0.0.1",
        master_port=int(config["master_port"]),
    )
    gc.collect()
    base = status_bytes("VmRSS")
    engine = build_engine(EngineConfig.model_validate(config["engine"]), state)
    gc.collect()
    built = status_bytes("VmRSS")
    seq_len = int(config["seq_len"])
    rng = np.random.default_rng(0)
    prompt = seq_len // 4
    doc = Document(
        input_ids=rng.integers(3, engine.vocab_size, seq_len).tolist(),
        loss_mask=[0.0] * prompt + [1.0] * (seq_len - prompt),
        old_logprobs=[-1.0] * seq_len,
        advantage=1.0,
        weight=1.0 / (seq_len - prompt),
    )
    batch = pack([doc] * state.dp, seq_len, dp_size=state.dp)[state.dp_rank]
    engine.train_step(batch, "grpo")
    result = {"rank": rank, "base_rss": base, "built_rss": built, "peak_rss": status_bytes("VmHWM")}
    destroy_parallel()
    Path(config["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
