"""Non-finite numbers inside a real trainer rank (TP=1, this process, gloo): a step whose loss or
gradient norm is NaN/inf is aborted before the optimizer update (weights, Adam state and step
count as before, the next good step the same as if the bad one never came), a job naming its step
writes no checkpoint, and a checkpoint with a NaN/inf LoRA or optimizer tensor is never staged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.trainer.common import require_trainer_deps

require_trainer_deps()

from art_mega.errors import NonFiniteCheckpointError, NonFiniteStepError  # noqa: E402
from tests.trainer.engine_scenarios import LORA, OPTIMIZER, grpo_batch  # noqa: E402


def snapshot(engine: Any) -> dict[str, Any]:
    """Copies of the engine's LoRA weights, every Adam state tensor and its step count."""
    import torch

    from art_mega.trainer.rank.engine import _sub_optimizers
    from art_mega.trainer.rank.lora import lora_parameters

    state = {f"lora {n}": p.detach().clone() for n, p in lora_parameters(engine.ddp.module).items()}
    for k, sub in enumerate(_sub_optimizers(engine.optimizer)):
        for i, (param, values) in enumerate(sub.optimizer.state.items()):
            state[f"main {k}.{i}"] = param.detach().clone()
            for key, value in values.items():
                if torch.is_tensor(value):
                    state[f"adam {k}.{i} {key}"] = value.detach().clone()
    state["steps"] = engine.steps
    return state


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    import torch

    assert before.keys() == after.keys()
    for key, value in before.items():
        same = torch.equal(value, after[key]) if torch.is_tensor(value) else value == after[key]
        assert same, key


@pytest.fixture(scope="module")
def engines(megatron_world, tiny_dirs: dict[str, Path]) -> tuple[Any, Any, Any]:
    """Two identical engines of the tiny llama, each after one good GRPO step, and the batch."""
    import torch

    from art_mega.trainer.rank.engine import TrainerEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        built = [
            TrainerEngine(tiny_dirs["llama"], megatron_world, lora=LORA, optimizer=OPTIMIZER)
            for _ in range(2)
        ]
        batch = grpo_batch(built[0])
        for engine in built:
            engine.train_step(batch)
        yield built[0], built[1], batch
    finally:
        torch.set_num_threads(threads)


def poisoned(batch: Any, advantage: float) -> Any:
    """`batch` with the advantage of its trained tokens set to `advantage`."""
    from art_mega.trainer.batch import TrainBatch

    bad = TrainBatch(**{name: value.copy() for name, value in vars(batch).items()})
    bad.advantages = np.where(bad.loss_mask > 0, np.float32(advantage), bad.advantages).astype(np.float32)
    return bad


@pytest.mark.parametrize("advantage", [float("inf"), float("nan")])
def test_a_nonfinite_loss_aborts_before_the_optimizer_and_the_next_step_is_unaffected(
    engines: tuple[Any, Any, Any], advantage: float
) -> None:
    engine, twin, batch = engines
    before = snapshot(engine)
    with pytest.raises(NonFiniteStepError) as info:
        engine.train_step(poisoned(batch, advantage))
    assert info.value.quantity == "loss/policy" and not np.isfinite(info.value.value)
    assert_same(before, snapshot(engine))
    # The next good step trains from the last good weights: the same as on the twin, which never
    # saw the bad batch (the aborted step's gradients leave nothing behind).
    first = engine.train_step(batch, learning_rate=1e-2)
    second = twin.train_step(batch, learning_rate=1e-2)
    assert first == second
    assert_same(snapshot(twin), snapshot(engine))


def test_a_nonfinite_gradient_norm_with_a_finite_loss_aborts_too(engines: tuple[Any, Any, Any]) -> None:
    engine, twin, batch = engines
    before = snapshot(engine)
    # advantages of 1e37 keep the loss finite (about 1e37), but the gradient's squared norm overflows
    with pytest.raises(NonFiniteStepError) as info:
        engine.train_step(poisoned(batch, 1e37))
    print(f"\n{info.value}")
    assert info.value.quantity == "loss/grad_norm" and info.value.value == float("inf")
    assert_same(before, snapshot(engine))


def test_a_job_with_a_nonfinite_loss_names_its_step_and_writes_no_checkpoint(
    megatron_world, engines: tuple[Any, Any, Any], tmp_path: Path
) -> None:
    from art_mega.trainer.protocol import RLJob
    from art_mega.trainer.rank.jobs import run_train_job

    engine, _, batch = engines
    (tmp_path / "batch").mkdir()
    poisoned(batch, float("nan")).save(tmp_path / "batch" / "dp0.safetensors")
    checkpoints = tmp_path / "checkpoints"
    job = RLJob(
        step=8,
        batch_dir=str(tmp_path / "batch"),
        checkpoint_dir=str(checkpoints / "0008"),
        learning_rate=1e-2,
    )
    before = snapshot(engine)
    with pytest.raises(NonFiniteStepError) as info:
        run_train_job(job, megatron_world, engine, {}, last_step=7)
    assert str(info.value) == (
        "training step 8 was aborted before the optimizer update because loss/policy is nan; nothing "
        "was committed and the served step did not move; look for extreme rewards or advantages, or "
        "lower learning_rate"
    )
    assert info.value.step == 8
    assert not checkpoints.exists()  # not even a staging folder
    assert_same(before, snapshot(engine))


@pytest.mark.parametrize("where", ["lora", "adam"])
def test_a_checkpoint_with_a_nonfinite_tensor_is_never_staged(
    megatron_world, tiny_dirs: dict[str, Path], engines: tuple[Any, Any, Any], tmp_path: Path, where: str
) -> None:
    import torch

    from art_mega.trainer.rank.engine import TrainerEngine, _sub_optimizers
    from art_mega.trainer.rank.jobs import write_checkpoint
    from art_mega.trainer.rank.lora import lora_parameters

    _, _, batch = engines
    engine = TrainerEngine(tiny_dirs["llama"], megatron_world, lora=LORA, optimizer=OPTIMIZER)
    engine.train_step(batch)
    assert engine.first_nonfinite_tensor() is None
    write_checkpoint(engine, megatron_world, 1, str(tmp_path / "0001"))  # a finite one commits
    assert (tmp_path / "0001" / "manifest.json").is_file()
    with torch.no_grad():
        if where == "lora":
            name, param = next(iter(lora_parameters(engine.ddp.module).items()))
            param.view(-1)[0] = float("nan")
        else:  # the fp32 optimizer holds the LoRA parameters themselves: named by them
            names = {id(p): n for n, p in lora_parameters(engine.ddp.module).items()}
            param, state = next(iter(_sub_optimizers(engine.optimizer)[0].optimizer.state.items()))
            name = names[id(param)]
            state["exp_avg_sq"].view(-1)[-1] = float("inf")
    with pytest.raises(NonFiniteCheckpointError) as info:
        write_checkpoint(engine, megatron_world, 2, str(tmp_path / "0002"))
    print(f"\n{info.value}")
    expected = (
        f"rank 0's LoRA parameter {name}"
        if where == "lora"
        else f"rank 0's optimizer state 'exp_avg_sq' of {name}"
    )
    assert info.value.tensor == expected and info.value.step == 2
    assert str(info.value).startswith(f"the checkpoint of step 2 was not committed because {expected}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0001"]
