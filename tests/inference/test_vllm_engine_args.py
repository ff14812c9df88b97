"""The committed table of vLLM's engine arguments (`art_mega.inference.vllm_engine_args`) is the
one vLLM's own parser gives: regenerated with the replicas' interpreter and compared; and a
replica's command line with ART's engine settings is read by vLLM's parser as they were set."""

import json
import subprocess
from pathlib import Path

from tests.helpers import require_vllm
from tests.inference.common import replica_spec


def test_the_committed_table_is_what_vllms_parser_has_and_it_reads_the_settings_as_set(tmp_path):
    require_vllm()
    from art_mega.backend import default_vllm_python
    from art_mega.dev.settings import engine_settings
    from art_mega.inference import vllm_engine_args
    from art_mega.inference.protocol import ReplicaLaunch
    from art_mega.inference.replica import vllm_argv

    settings = engine_settings(
        {
            "init_args": {"gpu_memory_utilization": 0.8, "enable_prefix_caching": False},
            "engine_args": {"enforce_eager": True, "max_num_seqs": 7, "num_scheduler_steps": 1,
                            "compilation_config": {"mode": 0}, "block_size": 16},
        }
    )  # fmt: skip
    launch = ReplicaLaunch(
        model="/m",
        served_model_name="tiny",
        log_dir=str(tmp_path),
        gpu_memory_utilization=settings.gpu_memory_utilization,
        extra_args=tuple(vllm_engine_args.engine_argv(settings.vllm_args)),
    )
    argv = vllm_argv(replica_spec(8000), launch)[3:]  # after `python -m <server module>`
    source = Path(vllm_engine_args.__file__)
    done = subprocess.run(
        [default_vllm_python(), str(source), *argv], capture_output=True, text=True, timeout=300, check=True
    )
    version, generated = done.stdout.split("\n", 1)
    generated, parsed = generated.rstrip("\n").rsplit("\n", 1)
    generated += "\n"
    read = json.loads(parsed)
    assert (read["enforce_eager"], read["max_num_seqs"], read["gpu_memory_utilization"]) == (True, 7, 0.8)
    assert (read["enable_prefix_caching"], read["block_size"], read["max_model_len"]) == (False, 16, 512)
    assert read["compilation_config"].startswith("{'mode': <CompilationMode.NONE: 0>")  # the dict, as JSON
    assert "num_scheduler_steps" not in read
    # what to paste between the GENERATED markers (and VLLM_VERSION) when vLLM is upgraded
    assert version == f"# vLLM {vllm_engine_args.VLLM_VERSION}"
    assert generated == vllm_engine_args._render(vllm_engine_args.ENGINE_ARGS), (
        "regenerate: <vLLM's python> art_mega/inference/vllm_engine_args.py"
    )
    assert len(vllm_engine_args.ENGINE_ARGS) == 252 and "max_num_seqs" in vllm_engine_args.ENGINE_ARGS
