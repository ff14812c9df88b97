"""Policy tags on trajectories and the stale-policy check of `backend.train` (no trainer needed)."""

from __future__ import annotations

import pytest
from openai.types.chat.chat_completion import Choice

from art_mega.backend import MegatronBackend
from art_mega.errors import UserError
from art_mega.trajectories import POLICY_STEP_FIELD, Trajectory, TrajectoryGroup, off_policy


def choice(step: int | None, tagged: bool = True) -> Choice:
    data = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
    if tagged:
        data[POLICY_STEP_FIELD] = step
    return Choice.model_validate(data)


def trajectory(*steps: int | None, untagged: int = 0) -> Trajectory:
    items: list = [{"role": "user", "content": "hi"}]
    items += [choice(s) for s in steps] + [choice(None, tagged=False) for _ in range(untagged)]
    return Trajectory(messages_and_choices=items, reward=1.0)


def test_policy_steps_survive_a_json_round_trip() -> None:
    original = trajectory(3, 3, 4, None, untagged=1)
    assert original.policy_steps() == [3, 4, None]
    again = Trajectory.model_validate_json(original.model_dump_json())
    assert again.policy_steps() == [3, 4, None]
    assert trajectory(untagged=2).policy_steps() == []


def test_off_policy_lists_every_trajectory_with_another_step() -> None:
    groups = [
        TrajectoryGroup([trajectory(5), trajectory(4), trajectory(untagged=1)]),
        TrajectoryGroup([trajectory(5, 6), trajectory(5)]),
    ]
    assert off_policy(groups, 5) == [(0, 1, [4]), (1, 0, [5, 6])]
    assert off_policy(groups, 4) == [(0, 0, [5]), (1, 0, [5, 6]), (1, 1, [5])]


def test_backend_refuses_stale_trajectories_naming_the_steps() -> None:
    backend = MegatronBackend()
    backend._step = 7
    groups = [TrajectoryGroup([trajectory(7), trajectory(6)]), TrajectoryGroup([trajectory(None)])]
    with pytest.raises(UserError) as info:
        backend._check_policy_steps(groups, allow_stale=False)
    message = str(info.value)
    assert message == (
        "trajectory 1 of group 0 was sampled by policy step 6, but backend.train expects step 7 "
        "(2 stale trajectories); sample with the current model.get_inference_name() or pass "
        "allow_stale=True to train off-policy."
    )
    assert backend._check_policy_steps(groups, allow_stale=True) == 2
    assert backend._check_policy_steps([TrajectoryGroup([trajectory(7, untagged=1)])], False) == 0
    backend._step = 0  # a fresh LoRA's step 0 is the base model (B = 0): its samples are on-policy
    assert backend._check_policy_steps([groups[1]], allow_stale=False) == 0
    backend._base_is_step0 = False  # warm-started from an adapter: the base model is another policy
    with pytest.raises(UserError, match="sampled by the base model, but"):
        backend._check_policy_steps([groups[1]], allow_stale=False)


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.2])
def test_gpu_memory_utilization_outside_zero_one_is_refused(fraction: float) -> None:
    with pytest.raises(UserError, match=rf"gpu_memory_utilization={fraction}\) .* use a value in \(0, 1\]"):
        MegatronBackend(gpu_memory_utilization=fraction)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"dtype": "fp16"}, "dtype='fp16'\\) is not a trainer dtype; use 'auto', 'float32' or 'bfloat16'"),
        ({"micro_batch_rows": 0}, "micro_batch_rows=0\\) counts packed rows"),
        ({"micro_batch_rows": 2.5}, "micro_batch_rows=2.5\\) counts packed rows"),
        ({"micro_batch_rows": True}, "micro_batch_rows=True\\) counts packed rows"),
    ],
)
def test_bad_dtype_or_micro_batch_rows_is_refused(kwargs, fragment) -> None:
    with pytest.raises(UserError, match=fragment):
        MegatronBackend(**kwargs)
    backend = MegatronBackend(dtype="bfloat16", micro_batch_rows=4)
    assert (backend.dtype, backend.micro_batch_rows) == ("bfloat16", 4)


def test_unreadable_model_error_names_the_folder_of_the_lost_files() -> None:
    from pathlib import Path

    import numpy as np

    from art_mega.preflight.reach import unreadable_model_error

    folders = {
        Path("/c/model"): "base model directory",
        Path("/c/model-lora"): "warm-start adapter directory",
    }
    # "/c/model" is a string prefix of "/c/model-lora/...": the adapter folder must still be named
    error = unreadable_model_error("h1", ("/c/model-lora/adapter_model.safetensors",), folders)
    assert str(error).startswith(
        "host h1 cannot read the warm-start adapter directory /c/model-lora (1 of its files are missing "
        "there, e.g. adapter_model.safetensors)"
    )
    error = unreadable_model_error(
        "h2", ("/c/model/config.json", "/c/model/a.safetensors", "/c/model-lora/x"), folders
    )
    assert "the base model directory /c/model (2 of its files" in str(error) and "host h2" in str(error)
    # numpy integers are whole numbers too; numpy booleans are not
    assert MegatronBackend(micro_batch_rows=np.int64(4)).micro_batch_rows == 4
    with pytest.raises(UserError, match="micro_batch_rows=np.True_"):
        MegatronBackend(micro_batch_rows=np.True_)
