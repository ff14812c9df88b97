"""vLLM 0.32's own sampler steps as the reference for the trainer's sampled-distribution logprobs.

Run with the vLLM interpreter: `python tests/trainer/vllm_sampler_reference.py IN.json OUT.json`.
IN holds `logits` [N, V], per row `temperature`, `top_k` (0: off), `top_p`, `min_p` and `targets`
[N]; OUT gets `logprobs` [N]: the processed logprob (`--logprobs-mode processed_logprobs`) of each
target, computed as vLLM's CPU sampler does (`v1/sample/sampler.py` `Sampler.sample`): the
temperature (`Sampler.apply_temperature`), min_p (`MinPLogitsProcessor.apply`, copied: it needs an
engine config to construct), then `apply_top_k_top_p` (on CPU without Triton: the PyTorch
implementation), then the log-softmax (`TopKTopPSampler.forward_cpu`).
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    spec = json.load(open(spec_path))
    logits = torch.tensor(spec["logits"], dtype=torch.float32)
    vocab = logits.shape[1]
    logits = Sampler.apply_temperature(logits, torch.tensor(spec["temperature"]), all_random=True)
    min_p = torch.tensor(spec["min_p"])[:, None]
    probability_values = torch.nn.functional.softmax(logits, dim=-1)
    max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)
    logits.masked_fill_(probability_values < max_probabilities.mul_(min_p), -float("inf"))
    # the input batch holds top_k = vocab where it is off (`gpu_input_batch.py`)
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k in spec["top_k"]], dtype=torch.int32)
    logits = apply_top_k_top_p(logits, top_k, torch.tensor(spec["top_p"], dtype=torch.float32))
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    targets = torch.tensor(spec["targets"])[:, None]
    json.dump({"logprobs": logprobs.gather(1, targets)[:, 0].tolist()}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
