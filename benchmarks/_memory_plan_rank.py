"""One gloo rank of `benchmarks/memory_plan.py`: what a CPU trainer rank's resident set grows by.

    python benchmarks/_memory_plan_rank.py CONFIG_JSON_PATH

Joins the world (`init_parallel`), reads VmRSS (the libraries imported, nothing of the model
built), builds the engine (`rank.jobs.build_engine`: float32 base weights, LoRA, DDP's gradient
buffer), reads VmRSS again, then runs one GRPO step (`TrainerEngine.train_step`) on ONE packed
row of exactly `seq_len` tokens a micro-batch (one document whose every token but the first is
trained, so the LM head runs on the whole row; `rows` such micro-batches, `micro_batch_rows` 1),
twice: the second step holds Adam's moments, allocated in the first, through its peak. Writes CONFIG["out"] as JSON, bytes:
base_rss (before the build), built_rss (after it), peak_rss (VmHWM after the step), and torch's own
accounting of CPU tensor memory (`tensor_bytes`): built_tensors, the bytes of the tensors the
build allocated that are live after it (weights, LoRA, DDP's gradient buffer, whatever else the
model keeps), and step_peak_tensors, the most bytes of tensors allocated in the step live at once
over the two steps (activations, logits and their temporaries, Adam's moments) -- on a GPU rank these are what
`torch.cuda.max_memory_allocated` counts above the memory allocated before the step.
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


def tensor_bytes(run) -> tuple[object, int, int]:
    """(run's result, live bytes at its end, the peak live bytes during it) of the CPU tensors
    `run()` allocates, from torch's profiler (`profile_memory=True`: c10's CPU allocator reports
    each allocation and free with its running total while the profiler records).

    The running total is the process's, not the recording's: it still holds the tensors an
    earlier recording allocated that are live (the build's weights, when the step is measured),
    so the total before the first event (its total less its own size) is subtracted. Tensors
    allocated while nothing recorded are in neither figure, nor their frees."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and str(event.extra_fields.device) == "cpu":
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.total_allocated, fields.alloc_size))
    events.sort()
    if not events:
        return result, 0, 0
    before = events[0][1] - events[0][2]
    return result, events[-1][1] - before, max(total for _, total, _ in events) - before


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
    engine, built_tensors, _ = tensor_bytes(
        lambda: build_engine(EngineConfig.model_validate(config["engine"]), state)
    )
    gc.collect()
    built = status_bytes("VmRSS")
    seq_len = int(config["seq_len"])
    rng = np.random.default_rng(0)
    prompt = 1  # every other position trained: the LM head runs on all of them, the plan's worst case
    doc = Document(
        input_ids=rng.integers(3, engine.vocab_size, seq_len).tolist(),
        loss_mask=[0.0] * prompt + [1.0] * (seq_len - prompt),
        old_logprobs=[-1.0] * seq_len,
        advantage=1.0,
        weight=1.0 / (seq_len - prompt),
    )
    rows = int(config.get("rows", 1))
    batch = pack([doc] * (state.dp * rows), seq_len, dp_size=state.dp)[state.dp_rank]

    def two_steps() -> None:
        for _ in range(2):
            engine.train_step(batch, "grpo")

    _, _, step_peak = tensor_bytes(two_steps)
    result = {
        "rank": rank,
        "pp_rank": state.pp_rank,
        "base_rss": base,
        "built_rss": built,
        "peak_rss": status_bytes("VmHWM"),
        "built_tensors": built_tensors,
        "step_peak_tensors": step_peak,
    }
    destroy_parallel()
    Path(config["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
