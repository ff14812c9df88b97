"""The checks `register` makes from JSON files alone, before any trainer rank starts: the model's
heads / KV heads / experts against tp / ep (config.json), a warm-start adapter's LoRA settings
against the backend's (adapter_config.json); no torch in either."""

import json
import subprocess
import sys

import pytest

from art_mega.errors import AdapterMismatchError, ModelSplitError, UserError
from art_mega.trainer.model_builder import check_model_fits
from art_mega.trainer.peft_config import check_adapter_config, read_adapter_config

ALL = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ALL}


def _config(tmp_path, **fields):
    base = {
        "model_type": "llama",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "vocab_size": 768,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
    }
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    return tmp_path


def test_heads_that_do_not_divide_by_tp_are_one_sentence(tmp_path):
    model = _config(tmp_path)
    check_model_fits(model, 2)
    with pytest.raises(ModelSplitError) as caught:
        check_model_fits(model, 3)
    assert str(caught.value) == (
        "tp=3 cannot split this llama model (4 attention heads, 2 KV heads, FFN size 256); use tp in {1, 2, 4}."
    )
    assert (caught.value.tp, caught.value.model_dir) == (3, str(model))
    assert isinstance(caught.value, UserError)  # exit code 2 through the CLI


def test_experts_that_do_not_divide_by_ep_are_one_sentence(tmp_path):
    model = _config(
        tmp_path,
        model_type="qwen3_moe",
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    )
    check_model_fits(model, 1, ep=2)
    with pytest.raises(
        ModelSplitError, match=r"ep=3 cannot split this qwen3_moe model's 4 experts; use ep in \{1, 2, 4\}"
    ):
        check_model_fits(model, 1, ep=3)


def test_pipeline_stages_that_do_not_divide_the_layers_are_one_sentence(tmp_path):
    model = _config(tmp_path, num_hidden_layers=6)
    check_model_fits(model, 1, pp=2)
    check_model_fits(model, 2, pp=3)
    with pytest.raises(ModelSplitError) as caught:
        check_model_fits(model, 1, pp=4, spec="TrainerSpec")
    assert str(caught.value) == (
        "TrainerSpec.pp=4 cannot split this llama model (6 decoder layers) into equal stages; "
        "use pp in {1, 2, 3, 6}."
    )


def test_pipeline_stages_of_a_family_without_them_are_one_sentence(tmp_path):
    model = _config(tmp_path, model_type="mistral", sliding_window=None)
    check_model_fits(model, 1)
    with pytest.raises(ModelSplitError) as caught:
        check_model_fits(model, 1, pp=2, spec="TrainerSpec")
    assert str(caught.value) == (
        "TrainerSpec.pp=2 cannot split this mistral model: pipeline stages are built for the llama "
        "and qwen3_moe families only; use pp=1 and split it with tp (or ep for experts)."
    )


GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_hidden_layers": 27},
}
"""google/gemma-3-4b-it's config.json (its vision config shortened): the multimodal wrapper, whose
text_config leaves the head counts and the vocabulary to Gemma3TextConfig's defaults."""


def test_the_published_gemma3_wrapper_is_read_with_its_text_defaults(tmp_path):
    """google/gemma-3-4b-it's config.json (model_type "gemma3", sparse text_config) passes
    register's checks as its decoder with Gemma3TextConfig's defaults (8 heads, 4 KV heads, 256
    wide, vocabulary 262208), and a tp those cannot split is refused in one sentence."""
    from art_mega.trainer.model_builder import read_model_args

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_IT))
    check_model_fits(tmp_path, 4)
    family, args = read_model_args(tmp_path)
    assert (family.name, args.model_type, args.vocab_size, args.num_heads, args.num_query_groups) == (
        "gemma3",
        "gemma3",
        262_208,
        8,
        4,
    )
    assert (args.hidden_size, args.num_layers, args.head_dim, args.global_rope_factor) == (2560, 34, 256, 8.0)
    with pytest.raises(ModelSplitError):
        check_model_fits(tmp_path, 3)


def test_an_unsupported_wrapper_is_named_before_its_missing_sizes(tmp_path):
    """The unsupported model_type is the sentence, not "vocab_size is missing ... use the model's own
    config.json", which the published gemma-3-4b-it config.json got before the gemma3 wrapper was read."""
    (tmp_path / "config.json").write_text(json.dumps({**GEMMA3_4B_IT, "model_type": "paligemma"}))
    with pytest.raises(UserError) as caught:
        check_model_fits(tmp_path, 1)
    assert str(caught.value).startswith(
        "model_type='paligemma' is not supported by the Megatron trainer; supported: "
    )


def test_the_checks_import_no_torch(tmp_path):
    """Every family's checks and LoRA names (the context-parallel check of the families that
    refuse CP imported megatron-core, 20 s at each register of a Qwen3.5, GPT-OSS or DeepSeek-V3)."""
    from tests.real_size_configs import DEEPSEEK_V3
    from tests.trainer.gpt_oss_configs import GPT_OSS_20B
    from tests.trainer.qwen3_5_configs import QWEN3_5_35B_A3B, QWEN3_6_27B

    models = [_config(tmp_path)]
    for name, config in (("q", QWEN3_6_27B), ("qm", QWEN3_5_35B_A3B), ("g", GPT_OSS_20B), ("d", DEEPSEEK_V3)):
        (tmp_path / name).mkdir()
        models.append(_config(tmp_path / name, **config))
    code = (
        "import sys\n"
        "from art_mega.trainer.model_builder import check_model_fits\n"
        "from art_mega.trainer.peft_config import check_adapter_config\n"
        "from art_mega.backend import MegatronBackend\n"
        f"for model in {[str(m) for m in models]!r}:\n"
        "    check_model_fits(model, 2)\n"
        "    MegatronBackend()._lora_settings(model)\n"
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "found,sentence",
    [
        (
            {"r": 16},
            "the warm-start adapter /a does not match this backend's LoRA: it has r=16 where the backend's "
            "lora_rank=8; pass MegatronBackend(lora_rank=16) to train it, or warm-start from an adapter "
            "trained with the backend's settings",
        ),
        (
            {"target_modules": ["q_proj", "v_proj"]},
            "the warm-start adapter /a does not match this backend's LoRA: it has target_modules=['q_proj', "
            f"'v_proj'] where the backend's LoRA covers {ALL}; warm-start from an adapter trained with "
            "the backend's settings",
        ),
        (
            {"target_modules": ["o_proj", "q_proj", "k_proj", "v_proj"], "lora_alpha": 32},
            "the warm-start adapter /a does not match this backend's LoRA: it has lora_alpha=32 where the "
            "backend's lora_alpha=16.0, and target_modules=['o_proj', 'q_proj', 'k_proj', 'v_proj'] where "
            f"the backend's LoRA covers {ALL}; pass MegatronBackend(lora_alpha=32, lora_targets=('k_proj', "
            "'o_proj', 'q_proj', 'v_proj')) to train it, or warm-start from an adapter trained with the "
            "backend's settings",
        ),
        (
            {"use_dora": True},
            "the warm-start adapter /a has use_dora=True, but art-mega trains plain LoRA adapters only; "
            "convert it to a plain LoRA adapter (peft_type 'LORA', no DoRA, rsLoRA or per-module "
            "patterns) or warm-start from an adapter trained with the backend's settings",
        ),
        ({"r": "8"}, "the warm-start adapter /a does not match this backend's LoRA: it has r='8' where"),
    ],
)
def test_a_warm_start_adapter_unlike_the_backends_lora_is_one_sentence(found, sentence):
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ALL, **found}
    with pytest.raises(AdapterMismatchError) as caught:
        check_adapter_config(config, "/a", **LORA)
    assert str(caught.value).startswith(sentence), str(caught.value)


def test_a_matching_adapter_passes_and_unreadable_configs_are_named(tmp_path):
    check_adapter_config(
        {"r": 8, "lora_alpha": 16.0, "target_modules": list(reversed(ALL))}, tmp_path, **LORA
    )
    with pytest.raises(UserError, match="is not a PEFT adapter directory"):
        read_adapter_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(UserError, match="adapter_config.json is not valid JSON"):
        read_adapter_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text("[1]")
    with pytest.raises(UserError, match="holds a JSON list, not an object"):
        read_adapter_config(tmp_path)


def test_resuming_a_run_with_another_lora_is_refused_naming_the_committed_step(tmp_path):
    """The committed checkpoint's adapter is what the ranks load on a resume (the warm start is
    ignored then); a backend with another LoRA rank failed inside the ranks before."""
    from art_mega.backend import MegatronBackend
    from art_mega.basemodels.resolve import ResolvedModel

    (tmp_path / "model").mkdir()
    model = ResolvedModel(_config(tmp_path / "model"))
    adapter = tmp_path / "run" / "checkpoints" / "0003"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 16, "target_modules": ALL})
    )
    topology = _topology()
    with pytest.raises(AdapterMismatchError) as caught:
        MegatronBackend(lora_rank=8)._check_model_and_adapter(
            topology.trainer, topology.replicas, model, tmp_path / "run", 3
        )
    assert str(caught.value) == (
        f"the adapter of this run's committed step 3 at {adapter} does not match this backend's LoRA: "
        "it has r=4 where the backend's lora_rank=8; pass MegatronBackend(lora_rank=4) to train it, "
        "or give the model another name to start a new run"
    )
    MegatronBackend(lora_rank=4)._check_model_and_adapter(
        topology.trainer, topology.replicas, model, tmp_path / "run", 3
    )


@pytest.mark.parametrize(
    "trainer_tp,replica_tp,sentence",
    [
        (
            3,
            1,
            "TrainerSpec.tp=3 cannot split this llama model (4 attention heads, 2 KV heads, FFN size 256)",
        ),
        (
            1,
            3,
            "InferenceSpec.tp=3 cannot split this llama model (4 attention heads, 2 KV heads, FFN size 256)",
        ),
    ],
)
def test_register_names_which_spec_cannot_split_the_model(tmp_path, trainer_tp, replica_tp, sentence):
    """A vLLM replica with tp=3 failed after minutes of start-up before, the trainer ranks inside
    megatron-core."""
    from art_mega.backend import MegatronBackend
    from art_mega.basemodels.resolve import ResolvedModel

    topology = _topology(trainer_tp, replica_tp)
    with pytest.raises(ModelSplitError) as caught:
        MegatronBackend()._check_model_and_adapter(
            topology.trainer, topology.replicas, ResolvedModel(_config(tmp_path)), tmp_path / "run", None
        )
    assert str(caught.value) == f"{sentence}; use tp in {{1, 2, 4}}."


def _topology(trainer_tp: int = 1, replica_tp: int = 1):
    """A one-host topology with 3 GPUs the trainer (tp `trainer_tp`) and one replica (tp
    `replica_tp`) share; compiled only, nothing starts."""
    from art_mega.topology import ClusterSpec, HostSpec, InferenceSpec, TrainerSpec, compile_topology

    host = HostSpec(
        host_id="h", node_rank=0, worker_address="tcp://127.0.0.1:0", cpu_slots=2, gpu_ids=(0, 1, 2)
    )
    cluster = ClusterSpec(
        hosts=(host,), controller_host_id="h", artifact_root="/tmp/unused", cache_root="/tmp/unused"
    )
    return compile_topology(
        cluster,
        trainer=TrainerSpec(tp=trainer_tp, master_port=29999),
        inference=InferenceSpec(replicas=1, tp=replica_tp, api_port=30001, shared_gpus=True),
    )


@pytest.mark.parametrize("sizes", [{"pp": 2, "cp": 2}])
def test_register_refuses_trainer_sizes_of_a_topology_not_compiled_here(sizes, tmp_path):
    """A topology edited after `compile_topology` (which refuses pp with cp itself) is refused at
    register, from the spec alone, before the model is read and before any start."""
    from types import SimpleNamespace

    from art_mega.backend import MegatronBackend
    from art_mega.errors import TopologyError
    from art_mega.topology import ClusterSpec, HostSpec, InferenceSpec, TrainerSpec, compile_topology
    from tests.unit.topology.test_topology_compile import PP_REFUSED

    host = HostSpec(host_id="h", node_rank=0, worker_address="tcp://127.0.0.1:1", cpu_slots=2)
    cluster = ClusterSpec(
        hosts=(host,), controller_host_id="h", artifact_root=str(tmp_path), cache_root="/tmp/c"
    )
    topology = compile_topology(
        cluster, trainer=TrainerSpec(cpu_ranks_per_host=2), inference=InferenceSpec(replicas=1)
    )
    trainer = topology.trainer.model_copy(update=sizes)
    resolved = SimpleNamespace(model_dir=tmp_path / "no-model-here", warm_start=None)
    with pytest.raises(TopologyError) as caught:
        MegatronBackend()._check_model_and_adapter(trainer, topology.replicas, resolved, tmp_path / "run", None)
    assert str(caught.value) == PP_REFUSED
    assert list(tmp_path.iterdir()) == []
