"""One gloo rank of `benchmarks/trainer_step.py`: time GRPO train steps with LoRA.

    python benchmarks/_trainer_step_rank.py CONFIG_JSON_PATH

The rank does what a trainer rank of the service does (`art_mega.trainer.rank.main`): joins the
world from its row of the compiled topology's rank table (`init_parallel`, gloo on 127.0.0.1),
builds the engine from the launch config (`jobs.build_engine`), then runs `warmup` + `steps`
GRPO steps (`TrainerEngine.train_step`, default `GRPOLossConfig`) on its DP share of a seeded
synthetic packed batch, every step started after a barrier. It writes CONFIG["out"] as JSON:
step_seconds (wall seconds of each timed step on this rank), tokens (non-padding tokens of the
global batch), trained_tokens, setup_seconds (init + engine build), peak_rss_mb (VmHWM of this
process, 10^6 bytes) and the last step's metrics.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def peak_rss_mb() -> float:
    """VmHWM (peak resident set) of this process in MB (10^6 bytes); 0.0 where /proc has none."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def synthetic_documents(vocab_size: int, documents: int, seq_len: int, seed: int) -> list[Any]:
    """`documents` seeded random GRPO documents of 1/4..3/4 of `seq_len` tokens each, the first
    third of each a prompt (loss_mask 0), advantages N(0, 1), weight 1 / trained tokens."""
    import numpy as np

    from art_mega.trainer.batch import Document
    from art_mega.trainer.prepare.advantages import token_weight

    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(documents):
        length = int(rng.integers(seq_len // 4, 3 * seq_len // 4 + 1))
        prompt = length // 3
        docs.append(
            Document(
                input_ids=rng.integers(3, vocab_size, length).tolist(),
                loss_mask=[0.0] * prompt + [1.0] * (length - prompt),
                old_logprobs=[0.0] * length,
                advantage=float(rng.normal()),
                weight=token_weight(length - prompt),
            )
        )
    return docs


def main(config_path: str) -> int:
    """Run the rank described by the JSON file at `config_path` (see the module docstring)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from art_mega.preflight.netif import gloo_interface_for
    from art_mega.topology.compiled import TrainerRank
    from art_mega.topology.trainer import TrainerSpec
    from art_mega.trainer.batch import pack
    from art_mega.trainer.protocol import EngineConfig
    from art_mega.trainer.rank.jobs import build_engine
    from art_mega.trainer.rank.parallel import destroy_parallel, init_parallel

    config = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    rank, world = int(config["rank"]), int(config["world_size"])
    started = time.perf_counter()
    if world > 1:
        gloo_interface_for(config["master_addr"])
    state = init_parallel(
        TrainerRank.model_validate(config["rank_table"][rank]),
        TrainerSpec.model_validate(config["trainer"]),
        world,
        master_addr=config["master_addr"],
        master_port=int(config["master_port"]),
    )
    engine = build_engine(EngineConfig.model_validate(config["engine"]), state)
    setup_seconds = time.perf_counter() - started
    batch_spec = config["batch"]
    docs = synthetic_documents(
        engine.vocab_size, batch_spec["documents"], batch_spec["seq_len"], batch_spec["seed"]
    )
    batch = pack(docs, batch_spec["seq_len"], dp_size=state.dp)[state.dp_rank]
    batch.old_logprobs = (engine.logprobs(batch) * batch.loss_mask).astype(np.float32)
    seconds, metrics = [], {}
    for step in range(config["warmup"] + config["steps"]):
        if world > 1:
            dist.barrier()
        begin = time.perf_counter()
        metrics = engine.train_step(batch, "grpo")
        if step >= config["warmup"]:
            seconds.append(time.perf_counter() - begin)
    result = {
        "rank": rank,
        "step_seconds": seconds,
        "tokens": sum(len(doc) for doc in docs),
        "trained_tokens": metrics.get("loss/tokens", 0.0),
        "setup_seconds": setup_seconds,
        "peak_rss_mb": peak_rss_mb(),
        "metrics": metrics,
    }
    destroy_parallel()
    Path(config["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
