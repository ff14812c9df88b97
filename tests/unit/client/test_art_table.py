"""docs/art-compatibility.md's ART -> art-mega table names every public name of openpipe-art 0.5.18 and 0.5.23 with a verdict
("same", "differs: how" or "not supported: why"), and every name it does not mark "not
supported" is importable from art_mega as the table promises.

ART is not installed here, so its public names are pinned below, enumerated from the 0.5.18
wheel: the `__all__` of `art`, `art.dev`, `art.utils`, `art.local`, `art.rewards`, `art.mcp`,
`art.langgraph`, `art.serverless`; the modules programs import from (`art.types`, `art.metrics`,
`art.gather`, `art.trajectories`, `art.utils.sft`, `art.utils.iterate_dataset`,
`art.local.backend`); and the fields and public methods of the classes programs use. Plain text,
no subprocess: fast.

How a name counts as listed: it occurs in a row's ART cell (the first column) inside backticks,
fully qualified (`art.utils.sft.train_sft_from_file`), through its owner's alias (`model.log`,
`backend.train`), or bare (`finish`) in a row whose ART cell also names its owner
(`art.Trajectory`). A name counts as not supported when its row's art-mega cell starts with
"not supported", or when the name occurs in that cell after the words "not supported".
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

TABLE_PAGE = Path(__file__).resolve().parents[3] / "docs" / "art-compatibility.md"

ART_NAMES: dict[str, tuple[str, ...]] = {
    # art.__all__ (0.5.18 lists LocalBackend there but does not import it)
    "art": (
        "dev",
        "auto_trajectory",
        "capture_auto_trajectory",
        "gather_trajectories",
        "gather_trajectory_groups",
        "trajectory_group_batches",
        "Backend",
        "LocalBackend",
        "LocalTrainResult",
        "ServerlessBackend",
        "ServerlessTrainResult",
        "Messages",
        "MessagesAndChoices",
        "Tools",
        "Model",
        "TrainableModel",
        "retry",
        "TrainSFTConfig",
        "TrainConfig",
        "TrainResult",
        "Trajectory",
        "TrajectoryGroup",
        "capture_yielded_trajectory",
        "yield_trajectory",
    ),
    "art.dev": (
        "EngineArgs",
        "InternalModelConfig",
        "InitArgs",
        "PeftArgs",
        "TinkerArgs",
        "TinkerNativeArgs",
        "TinkerTrainingClientArgs",
        "TrainerArgs",
        "get_openai_server_config",
        "is_dedicated_mode",
        "OpenAIServerConfig",
        "ServerArgs",
        "TrainSFTConfig",
        "TrainConfig",
        "validate_dedicated_config",
    ),
    "art.dev.InternalModelConfig": (
        "init_args",
        "engine_args",
        "peft_args",
        "tinker_args",
        "tinker_native_args",
        "trainer_args",
        "trainer_gpu_ids",
        "inference_gpu_ids",
        "rollout_weights_mode",
        "chat_template_kwargs",
        "chat_template",
        "chat_template_path",
        "chat_template_content_format",
        "chat_template_tool_schema_format",
        "allow_unvalidated_arch",
    ),
    "art.dev.TrainConfig": (
        "advantage_balance",
        "allow_training_without_logprobs",
        "epsilon",
        "epsilon_high",
        "importance_sampling_level",
        "kl_penalty_coef",
        "kl_ref_adapter_path",
        "logprob_calculation_chunk_size",
        "mask_prob_ratio",
        "max_negative_advantage_importance_sampling_weight",
        "moe_routing_replay_bundle",
        "moe_routing_replay_path",
        "moe_routing_replay_strict",
        "num_trajectories_learning_rate_multiplier_power",
        "packed_sequence_length",
        "plot_tensors",
        "ppo",
        "precalculate_logprobs",
        "scale_learning_rate_by_reward_std_dev",
        "scale_rewards",
        "truncated_importance_sampling",
    ),
    "art.types": (
        "Message",
        "MessageOrChoice",
        "Messages",
        "MessagesAndChoices",
        "Tools",
        "TrainConfig",
        "TrainSFTConfig",
        "Verbosity",
        "TrainResult",
        "LocalTrainResult",
        "ServerlessTrainResult",
    ),
    "art.TrainConfig": ("learning_rate", "kl_penalty_coef", "grad_accumulation_sequences"),
    "art.TrainSFTConfig": ("learning_rate", "batch_size"),
    "art.TrainResult": ("step", "metrics"),
    "art.LocalTrainResult": ("checkpoint_path",),
    "art.Model": (
        "name",
        "project",
        "entity",
        "id",
        "run_id",
        "config",
        "trainable",
        "inference_api_key",
        "inference_base_url",
        "inference_model_name",
        "base_path",
        "report_metrics",
        "register",
        "openai_client",
        "litellm_completion_params",
        "get_inference_name",
        "overwrite_state",
        "write_state",
        "merge_state",
        "read_state",
        "update_wandb_config",
        "metrics_builder",
        "activate_metrics_context",
        "log",
        "get_step",
        "backend",
        "safe_model_dump",
    ),
    "art.TrainableModel": (
        "base_model",
        "_internal_config",
        "cost_calculator",
        "set_cost_calculator",
        "delete_checkpoints",
        "train_sft",
        "train",  # ART's documentation's model.train(groups, config=...)
    ),
    "art.Trajectory": (
        "messages_and_choices",
        "tools",
        "additional_histories",
        "reward",
        "initial_policy_version",
        "final_policy_version",
        "metrics",
        "metadata",
        "logs",
        "start_time",
        "log",
        "finish",
        "track_duration",
        "messages",
        "for_logging",
    ),
    "art.TrajectoryGroup": ("trajectories", "exceptions", "metadata", "metrics", "logs", "log"),
    "art.trajectories": ("Trajectory", "TrajectoryGroup", "History", "PydanticException", "get_messages"),
    "art.gather": ("gather_trajectory_groups", "gather_trajectories"),
    "art.Backend": ("close", "register", "train"),
    "art.local": ("LocalBackend",),
    "art.local.backend": ("LocalBackend",),
    "art.local.LocalBackend": (
        "close",
        "register",
        "train",
        "adapter_lease",
        "prune_model_adapters",
        "_experimental_pull_from_s3",
        "_experimental_push_to_s3",
        "_experimental_fork_checkpoint",
        "_experimental_pull_model_checkpoint",
    ),
    "art.serverless": ("ServerlessBackend",),
    "art.utils": (
        "format_message",
        "get_model_step",
        "iterate_dataset",
        "limit_concurrency",
        "log_http_errors",
        "record_provenance",
        "retry",
    ),
    "art.utils.iterate_dataset": ("iterate_dataset", "DatasetBatch"),
    "art.utils.sft": (
        "SFTChunk",
        "resolve_sft_batch_size",
        "get_file_row_count",
        "create_lr_schedule",
        "create_sft_dataset_iterator",
        "iterate_file",
        "train_sft_from_file",
    ),
    "art.metrics": ("MetricsBuilder", "track_api_cost"),
    "art.metrics.MetricsBuilder": (
        "add_cost",
        "add_response_cost",
        "add_metric",
        "add_data",
        "add_user_timing",
        "add_idle_times",
        "measure",
        "flush",
        "activate",
        "activate_context",
        "get_active",
        "for_cost_context",
        "register_cost_extractor",
        "register_model_pricing",
        "state_dict",
        "load_state_dict",
    ),
    "art.rewards": ("ruler", "ruler_score_group"),
    "art.mcp": (
        "MCPResource",
        "MCPTool",
        "GeneratedScenario",
        "GeneratedScenarioCollection",
        "complete_task_tool",
        "generate_scenarios",
    ),
    "art.langgraph": ("wrap_rollout", "init_chat_model"),
}

ALIASES = {
    "art.Model": "model",
    "art.TrainableModel": "model",
    "art.local.LocalBackend": "backend",
    "art.Backend": "backend",
}
"""How the table spells a member through an instance: `model.log`, `backend.train`."""

VERDICTS = ("same", "differs", "not supported")


def table_rows(text: str) -> list[tuple[str, str]]:
    """(ART cell, art-mega cell) of every row of the table headed `| ART | art-mega |`."""
    lines = text.splitlines()
    start = lines.index("| ART | art-mega |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 2, f"docs/art-compatibility.md ART table row without two cells: {line[:120]}"
        rows.append((cells[0], cells[1]))
    return rows


def occurs(name: str, cell: str) -> bool:
    """`name` inside a backtick span of `cell`, not part of a longer name: neither preceded by a
    name character or by `x.` (an attribute of something else; `.log()` alone is fine) nor
    followed by a name character."""
    pattern = re.compile(rf"(?<!\w)(?<!\w\.){re.escape(name)}(?!\w)")
    return any(pattern.search(span) for span in re.findall(r"`([^`]+)`", cell))


def spellings(owner: str, member: str) -> list[str]:
    """`owner.member`, and `alias.member` for an owner with an instance alias."""
    return [f"{owner}.{member}", *([f"{ALIASES[owner]}.{member}"] if owner in ALIASES else [])]


def listed_in(owner: str, member: str, rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The rows that list `owner.member`."""
    found = []
    for art_cell, mega_cell in rows:
        if any(occurs(s, art_cell) for s in spellings(owner, member)) or (
            owner != "art" and occurs(owner, art_cell) and occurs(member, art_cell)
        ):
            found.append((art_cell, mega_cell))
    return found


def not_supported(owner: str, member: str, mega_cell: str) -> bool:
    if mega_cell.startswith("not supported"):
        return True
    _, found, after = mega_cell.partition("not supported")
    return bool(found) and (occurs(member, after) or any(occurs(s, after) for s in spellings(owner, member)))


def fields_of(cls: Any) -> dict[str, Any]:
    """A class's declared fields: pydantic fields and private attributes, dataclass fields, or
    TypedDict keys; {} for anything else."""
    if not isinstance(cls, type):
        return {}
    if hasattr(cls, "model_fields"):
        return {**cls.model_fields, **getattr(cls, "__private_attributes__", {})}
    if dataclasses.is_dataclass(cls):
        return {f.name: f for f in dataclasses.fields(cls)}
    return dict(getattr(cls, "__annotations__", {}))


def resolve(qualified: str) -> Any:
    """The art_mega object `qualified` (ART's spelling, `art.` prefix) names: a module, an
    attribute, or a class's field (`fields_of`).

    Raises:
        AttributeError: art_mega lacks it.
    """
    parts = ["art_mega", *qualified.split(".")[1:]]
    cut = len(parts)
    while cut > 1:
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            cut -= 1
    else:
        obj = importlib.import_module("art_mega")
    for part in parts[cut:]:
        obj = member(obj, part)
    return obj


def member(obj: Any, part: str) -> Any:
    """`obj`'s attribute `part`, else its field of that name (`fields_of`).

    Raises:
        AttributeError: neither.
    """
    if hasattr(obj, part):
        return getattr(obj, part)
    fields = fields_of(obj)
    if part not in fields:
        raise AttributeError(f"{obj!r} has no attribute or field {part!r}")
    return fields[part]


ART_0_5_23 = json.loads((Path(__file__).parent / "data" / "art_0_5_23_api.json").read_text())["names"]
"""ART 0.5.23's public names and members, by owner (scripts/art_api.py read them from the wheel
with `ast`: the `__all__` of the same packages, the same modules and classes, and
`art.pipeline_trainer`, `art.utils.strip_logprobs`, `art.dev.LoRAConfig`)."""

NAMES = sorted(
    {
        (owner, member)
        for names in (ART_NAMES, ART_0_5_23)
        for owner, members in names.items()
        for member in members
    }
)
"""0.5.18's names and 0.5.23's: a program written for either finds its names in the table."""


def test_every_pinned_name_is_in_the_table_with_a_verdict():
    rows = table_rows(TABLE_PAGE.read_text())
    missing, unjudged = [], []
    for owner, member in NAMES:
        found = listed_in(owner, member, rows)
        if not found:
            missing.append(f"{owner}.{member}")
        unjudged += [f"{owner}.{member}: {m[:60]!r}" for _, m in found if not m.startswith(VERDICTS)]
    assert missing == [], f"ART names missing from docs/art-compatibility.md's ART table: {missing}"
    assert unjudged == [], f"rows whose art-mega cell does not start with {VERDICTS}: {unjudged}"


def test_every_name_not_marked_not_supported_imports_from_art_mega():
    rows = table_rows(TABLE_PAGE.read_text())
    failed = []
    for owner, member in NAMES:
        found = listed_in(owner, member, rows)
        if not found or any(not_supported(owner, member, mega) for _, mega in found):
            continue
        try:
            resolve(f"{owner}.{member}")
        except (AttributeError, ImportError) as exc:
            failed.append(f"{owner}.{member} ({type(exc).__name__}: {exc})")
    assert failed == [], f"docs/art-compatibility.md lists these as supported, but art_mega lacks them: {failed}"


@pytest.mark.parametrize(
    "owner,member,row,listed",
    [
        ("art.Trajectory", "finish", ("`art.Trajectory` (`finish`)", "same"), True),
        ("art.Trajectory", "log", ("`art.Trajectory` (`logs`)", "same"), False),
        ("art.Model", "log", ("`model.log(groups)`", "same"), True),
        ("art.dev", "TrainConfig", ("`art.TrainConfig`", "same"), False),
        ("art", "retry", ("`art.retry(max_attempts)`", "same"), True),
        ("art", "retry", ("`art.utils.retry`", "same"), False),
        ("art.TrajectoryGroup", "log", ("`art.TrajectoryGroup`, `.log()`", "same"), True),
    ],
)
def test_the_matching_rule(owner, member, row, listed):
    assert bool(listed_in(owner, member, [row])) is listed


def test_a_row_marked_not_supported_exempts_its_names_and_a_clause_only_the_names_in_it():
    assert not_supported("art", "ServerlessBackend", "not supported: W&B's hosted service")
    cell = "same TypedDicts; not supported: `TinkerArgs` (no Tinker backend)"
    assert not_supported("art.dev", "TinkerArgs", cell)
    assert not not_supported("art.dev", "EngineArgs", cell)
    with pytest.raises(AttributeError):
        resolve("art.Trajectory.no_such_member")
    assert resolve("art.dev.InternalModelConfig.trainer_gpu_ids") is not None
