"""The committed table of vLLM's engine arguments (`art_mega.inference.vllm_engine_args`) is the
one vLLM's own parser gives: regenerated with the replicas' interpreter and compared."""

import subprocess
from pathlib import Path

from tests.helpers import require_vllm


def test_the_committed_table_is_what_vllms_parser_has():
    require_vllm()
    from art_mega.backend import default_vllm_python
    from art_mega.inference import vllm_engine_args

    source = Path(vllm_engine_args.__file__)
    done = subprocess.run(
        [default_vllm_python(), str(source)], capture_output=True, text=True, timeout=300, check=True
    )
    version, generated = done.stdout.split("\n", 1)
    # what to paste between the GENERATED markers (and VLLM_VERSION) when vLLM is upgraded
    assert version == f"# vLLM {vllm_engine_args.VLLM_VERSION}"
    assert generated == vllm_engine_args._render(vllm_engine_args.ENGINE_ARGS), (
        "regenerate: <vLLM's python> art_mega/inference/vllm_engine_args.py"
    )
    assert len(vllm_engine_args.ENGINE_ARGS) == 252 and "max_num_seqs" in vllm_engine_args.ENGINE_ARGS
