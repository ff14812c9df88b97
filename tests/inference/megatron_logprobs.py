"""The Megatron model with a given adapter, as the reference for served logprobs (one gloo rank).

Run as `python -m tests.inference.megatron_logprobs IN.json OUT.json`; IN holds `model_dir`,
`lora` ({rank, alpha}) and `cases` ([{"adapter": dir, "token_ids": [...]}, ...]); OUT gets, per
case, the logprob of every token given the ones before it under the Megatron model with that
adapter (float32; the first token has none).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def main(spec_path: str, out_path: str) -> None:
    from art_mega.agent.ports import free_port
    from art_mega.trainer.batch import TrainBatch
    from art_mega.trainer.protocol import LoraConfig
    from art_mega.trainer.rank.engine import TrainerEngine
    from art_mega.trainer.rank.parallel import destroy_parallel
    from tests.trainer.tp_worker import join

    torch.set_num_threads(1)
    spec = json.load(open(spec_path))
    state = join(0, 1, tp=1, port=free_port())
    lora = LoraConfig(rank=int(spec["lora"]["rank"]), alpha=float(spec["lora"]["alpha"]))
    engine = TrainerEngine(spec["model_dir"], state, lora=lora)
    results = []
    for case in spec["cases"]:
        engine.load_adapter(case["adapter"])
        ids = np.array([case["token_ids"]], dtype=np.int64)
        ones = np.ones(ids.shape, dtype=np.float32)
        batch = TrainBatch(
            input_ids=ids,
            segment_ids=np.ones(ids.shape, dtype=np.int32),
            position_ids=np.arange(ids.shape[1], dtype=np.int64)[None, :],
            loss_mask=ones,
            old_logprobs=np.zeros_like(ones),
            advantages=np.zeros_like(ones),
            weights=ones,
        )
        results.append(engine.logprobs(batch)[0, 1:].tolist())
    destroy_parallel()
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
