"""The vLLM replica's command line and environment as ART starts its server: tool calling with
the model family's parser, vLLM's generation config, chat-template kwargs, the replica's GPUs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from art_mega.inference.protocol import ReplicaLaunch
from art_mega.inference.replica import vllm_argv, vllm_env
from art_mega.inference.tool_calls import (
    DEFAULT_TOOL_CALL_PARSER,
    TOOL_CALL_PARSERS,
    added_tokens,
    tool_call_parser,
)
from art_mega.topology import EndpointSpec
from art_mega.topology.compiled import ReplicaSpec
from art_mega.trainer.families import FAMILIES
from tests.conftest import REPO

VLLM_TOOL_PARSERS = (
    REPO / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm" / "tool_parsers" / "__init__.py"
)


def spec(gpus: tuple[int | str, ...] = ()) -> ReplicaSpec:
    return ReplicaSpec(
        name="vllm",
        index=0,
        host_ids=("local",),
        gpu_ids=(("local", gpus),),
        endpoint=EndpointSpec(host="127.0.0.1", port=8123),
        tp=1,
        pp=1,
        dp=1,
        shared_gpus=False,
    )


def launch(**fields) -> ReplicaLaunch:
    return ReplicaLaunch(model="/models/q", served_model_name="q", log_dir="/tmp/logs", **fields)


def test_tool_calling_generation_config_and_template_kwargs_are_on_the_argv():
    argv = vllm_argv(
        spec(),
        launch(
            tool_call_parser="hermes",
            generation_config="vllm",
            chat_template_kwargs={"enable_thinking": False, "a": 1},
            extra_args=("--seed", "1"),
        ),
    )
    at = argv.index("--enable-auto-tool-choice")
    assert argv[at + 1 : at + 3] == ["--tool-call-parser", "hermes"]
    assert argv[argv.index("--generation-config") + 1] == "vllm"
    kwargs = argv[argv.index("--default-chat-template-kwargs") + 1]
    assert (
        json.loads(kwargs) == {"enable_thinking": False, "a": 1}
        and kwargs == '{"a": 1, "enable_thinking": false}'
    )
    assert argv[-2:] == ["--seed", "1"]


def test_without_them_the_argv_has_no_tool_calling():
    argv = vllm_argv(spec(), launch())
    for flag in (
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--generation-config",
        "--default-chat-template-kwargs",
    ):
        assert flag not in argv


@pytest.mark.parametrize("parser", ["", "hermes --x", "a;b"])
def test_a_parser_name_that_is_not_one_word_is_refused(parser):
    with pytest.raises(ValidationError, match="tool_call_parser"):
        launch(tool_call_parser=parser)


def test_the_replica_sees_only_its_gpus_and_launch_env_wins():
    agent_env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "HOME": "/root"}
    assert vllm_env(launch(), agent_env, gpus=(3,))["CUDA_VISIBLE_DEVICES"] == "3"
    assert vllm_env(launch(), agent_env, gpus=("MIG-1", "MIG-2"))["CUDA_VISIBLE_DEVICES"] == "MIG-1,MIG-2"
    assert vllm_env(launch(), agent_env)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # a CPU replica: untouched
    assert (
        vllm_env(launch(env={"CUDA_VISIBLE_DEVICES": "7"}), agent_env, gpus=(3,))["CUDA_VISIBLE_DEVICES"]
        == "7"
    )


def test_each_family_gets_its_parser_qwen_keeps_arts_hermes():
    llama3 = {"<|begin_of_text|>", "<|python_tag|>"}
    assert (
        tool_call_parser("qwen3", ())
        == tool_call_parser("qwen3_moe", ())
        == tool_call_parser("qwen2", ())
        == "hermes"
    )
    assert tool_call_parser("llama", llama3) == "llama3_json"
    assert tool_call_parser("mistral", {"[TOOL_CALLS]"}) == "mistral"
    assert (
        tool_call_parser("gpt2", llama3) == tool_call_parser(None, ()) == DEFAULT_TOOL_CALL_PARSER == "hermes"
    )
    assert set(FAMILIES) <= set(TOOL_CALL_PARSERS)  # every model type the trainer trains is in the table


def test_a_tokenizer_without_the_formats_marker_gets_arts_hermes():
    """vLLM refuses to start llama3_json on a tokenizer without <|python_tag|> (Llama 2, SmolLM)."""
    assert tool_call_parser("llama", {"<s>", "</s>"}) == "hermes"
    assert tool_call_parser("mistral", {"<s>"}) == "hermes"
    assert tool_call_parser("gemma4_text", {"<|tool_call>"}) == "gemma4"
    assert tool_call_parser("gemma4_text", {"<eos>"}) == "hermes"
    assert tool_call_parser("kimi_k2", {"<|tool_calls_section_begin|>"}) == "kimi_k2"
    assert tool_call_parser("kimi_k2", {"[EOS]"}) == "hermes"


def test_added_tokens_are_read_from_both_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text(
        json.dumps({"added_tokens": [{"id": 5, "content": "<|python_tag|>"}]})
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"7": {"content": "[TOOL_CALLS]"}}})
    )
    assert added_tokens(tmp_path) == {"<|python_tag|>", "[TOOL_CALLS]"}
    assert added_tokens(tmp_path / "missing") == frozenset()
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert added_tokens(tmp_path) == {"[TOOL_CALLS]"}


def test_every_parser_in_the_table_is_one_the_installed_vllm_registers():
    if not VLLM_TOOL_PARSERS.exists():
        pytest.skip(
            f"no vLLM environment at {VLLM_TOOL_PARSERS.parents[4]} (ART_MEGA_WITH_VLLM=1 bash scripts/install.sh)"
        )
    registered = set(re.findall(r'^\s+"([\w.-]+)":\s*\(', Path(VLLM_TOOL_PARSERS).read_text(), re.M))
    assert {"hermes", "llama3_json", "mistral"} <= registered
    assert {parser for parser, _ in TOOL_CALL_PARSERS.values()} <= registered
