"""Plain assistant messages (dicts, not sampled) in GRPO follow ART (issue 17, item 4): they are
context unless `allow_training_without_logprobs`, and then they train with the current policy as
their old one (NaN old logprob in the batch, ratio 1 in the loss). SFT trains them as before.

Before, GRPO trained them with old logprob 0.0: the ratio was the token's probability, so a
negative-advantage token below probability 0.8 was clipped and got no gradient."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
import torch
from openai.types.chat.chat_completion import Choice

import art_mega as art
from art_mega.backend import MegatronBackend
from art_mega.errors import HyperParameterError, TokenizationError
from art_mega.trainer.batch import TrainBatch, pack
from art_mega.trainer.prepare.tokenize import grpo_documents, sft_documents
from art_mega.trainer.protocol import GRPOLossConfig
from art_mega.trainer.rank.loss import grpo_loss, known_logprobs

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "hi there"}
PLAIN = {"role": "assistant", "content": "hello"}
AGAIN = {"role": "user", "content": "again"}


def choice(token_ids: list[int], logprobs: list[float]) -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "x"},
            "token_ids": token_ids,
            "logprobs": {
                "content": [
                    {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(token_ids, logprobs)
                ]
            },
        }
    )


SAMPLED = ([7, 8, 2], [-0.1, -0.2, -0.3])
RIVAL = ([9, 2], [-0.4, -0.5])


def conversation(sampled: tuple[list[int], list[float]]) -> list[Any]:
    return [SYSTEM, USER, PLAIN, AGAIN, choice(*sampled)]


def group() -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=conversation(SAMPLED), reward=1.0),
            art.Trajectory(messages_and_choices=conversation(RIVAL), reward=0.0),
        ]
    )


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def render(tok: Any, messages: list[Any]) -> list[int]:
    return encode(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


# ---------------------------------------------------------------- tokenization


def test_a_plain_assistant_turn_is_context_by_default(tiny_tokenizer) -> None:  # noqa: ANN001
    tok = tiny_tokenizer
    documents, stats = grpo_documents(tok, [group()])
    first, second = documents
    context = render(tok, [SYSTEM, USER, PLAIN, AGAIN])  # the plain turn is in it, untrained
    assert tok.decode(context).count("hello") == 1
    assert first.input_ids == context + SAMPLED[0]
    assert first.loss_mask == [0.0] * len(context) + [1.0, 1.0, 1.0]
    assert first.old_logprobs == [0.0] * len(context) + SAMPLED[1]
    assert second.input_ids == context + RIVAL[0]
    assert second.loss_mask == [0.0] * len(context) + [1.0, 1.0]
    assert second.old_logprobs == [0.0] * len(context) + RIVAL[1]
    assert (first.weight, second.weight) == (pytest.approx(1 / 3), pytest.approx(1 / 2))
    assert stats.trajectories_used == 2 and stats.trained_tokens == 5


def test_with_the_flag_a_plain_turn_trains_with_unknown_old_logprobs(tiny_tokenizer) -> None:  # noqa: ANN001
    tok = tiny_tokenizer
    documents, stats = grpo_documents(tok, [group()], allow_training_without_logprobs=True)
    first, second = documents
    before = render(tok, [SYSTEM, USER])
    plain = encode(tok, "hello<|im_end|>")  # through the end-of-turn token, as vLLM stops
    assert len(plain) == 3
    context = render(tok, [SYSTEM, USER, PLAIN, AGAIN])
    assert context[: len(before) + 3] == before + plain  # one sequence: the context extends it
    start, end = len(before), len(before) + 3
    assert first.input_ids == context + SAMPLED[0]
    expected_mask = [0.0] * len(context) + [1.0] * 3
    expected_mask[start:end] = [1.0, 1.0, 1.0]
    assert first.loss_mask == expected_mask
    old = first.old_logprobs
    assert [k for k, lp in enumerate(old) if math.isnan(lp)] == [start, start + 1, start + 2]
    assert old[:start] == [0.0] * start
    assert old[end:] == [0.0] * (len(context) - end) + SAMPLED[1]
    assert first.weight == pytest.approx(1 / 6) and second.weight == pytest.approx(1 / 5)
    assert stats.trained_tokens == 11
    # packed and written as the rank reads it: NaN only on the plain turn's trained tokens
    batch = pack(documents, seq_len=64)[0]
    assert np.isnan(batch.old_logprobs).sum() == 6
    assert (batch.loss_mask[np.isnan(batch.old_logprobs)] == 1.0).all()


def test_batch_files_keep_the_unknown_marker(tiny_tokenizer, tmp_path) -> None:  # noqa: ANN001
    documents, _ = grpo_documents(tiny_tokenizer, [group()], allow_training_without_logprobs=True)
    (batch,) = pack(documents, seq_len=64)
    batch.save(tmp_path / "dp0.safetensors")
    back = TrainBatch.load(tmp_path / "dp0.safetensors")
    np.testing.assert_array_equal(np.isnan(back.old_logprobs), np.isnan(batch.old_logprobs))
    finite = ~np.isnan(batch.old_logprobs)
    np.testing.assert_array_equal(back.old_logprobs[finite], batch.old_logprobs[finite])


def test_sft_trains_plain_turns_with_old_logprob_zero(tiny_tokenizer) -> None:  # noqa: ANN001
    tok = tiny_tokenizer
    (document,), stats = sft_documents(tok, [art.Trajectory(messages_and_choices=conversation(SAMPLED))])
    before = render(tok, [SYSTEM, USER])
    assert document.loss_mask[len(before) : len(before) + 3] == [1.0, 1.0, 1.0]
    assert not any(math.isnan(lp) for lp in document.old_logprobs)
    assert document.old_logprobs[len(before) : len(before) + 3] == [0.0, 0.0, 0.0]
    assert stats.trained_tokens == 6


def plain_only(reward: float) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[USER, PLAIN], reward=reward)


def test_a_trajectory_of_plain_turns_only_trains_nothing_by_default(tiny_tokenizer) -> None:  # noqa: ANN001
    documents, stats = grpo_documents(
        tiny_tokenizer, [art.TrajectoryGroup([plain_only(1.0), plain_only(0.0)])]
    )
    assert documents == []
    metrics = stats.as_metrics()
    assert metrics["data/trajectories_dropped_no_assistant_tokens"] == 2.0
    assert metrics["data/trajectories_used"] == 0.0 and metrics["data/trained_tokens"] == 0.0
    # the step's batch is then all padding: the rank reports loss/nothing_trainable (engine test)
    (batch,) = pack(documents, seq_len=16)
    assert batch.shape == (1, 16) and batch.trained_tokens == 0


@pytest.fixture
def backend(tiny_llama_dir) -> MegatronBackend:  # noqa: ANN001
    """The tiny model registered in name only; `_step_with` returns what would be trained."""
    backend = MegatronBackend()
    backend._model = art.TrainableModel(name="m", project="p", base_model="tiny")
    backend._model_dir = tiny_llama_dir

    async def step_with(steps, metrics, kind, learning_rates, loss, started, **packing):  # noqa: ANN001
        # an rl step is one document list (`_step_with` takes SFT's several)
        return {"documents": steps[0], "metrics": metrics, "loss": loss}

    backend._step_with = step_with  # type: ignore[method-assign]
    return backend


def train(backend: MegatronBackend, groups: Any, **options: Any) -> Any:
    return asyncio.run(backend.train(backend._model, groups, **options))


def test_backend_train_takes_the_flag_and_checks_it(backend: MegatronBackend) -> None:
    plain = [art.TrajectoryGroup([plain_only(1.0), plain_only(0.0)])]
    job = train(backend, plain)
    assert job["documents"] == []
    assert job["metrics"]["data/trajectories_dropped_no_assistant_tokens"] == 2.0
    job = train(backend, plain, allow_training_without_logprobs=True)
    assert len(job["documents"]) == 2 and job["metrics"]["data/trajectories_used"] == 2.0
    old = np.array(job["documents"][0].old_logprobs)
    mask = np.array(job["documents"][0].loss_mask)
    np.testing.assert_array_equal(np.isnan(old), mask > 0)
    assert "allow_training_without_logprobs" not in job["loss"]  # tokenization only: no job field
    with pytest.raises(HyperParameterError) as info:
        train(backend, plain, allow_training_without_logprobs="yes")
    assert str(info.value) == (
        "backend.train(allow_training_without_logprobs='yes') must be True or False (a str); "
        "pass e.g. allow_training_without_logprobs=True"
    )


# ---------------------------------------------------------------- the loss


def loss_case() -> dict[str, torch.Tensor]:
    """One sequence of 4 tokens: a prompt token, a sampled token (old -0.7), two plain ones (NaN)."""
    return {
        "new": torch.tensor([[-1.0, -0.5, -2.0, -0.3]], dtype=torch.float64, requires_grad=True),
        "old": torch.tensor([[0.0, -0.7, math.nan, math.nan]], dtype=torch.float64),
        "mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=torch.float64),
    }


def test_unknown_old_logprobs_give_ratio_one_by_hand() -> None:
    case = loss_case()
    advantage = -0.5
    out = grpo_loss(case["new"], case["old"], torch.tensor([advantage], dtype=torch.float64), case["mask"])
    # token 1: r = e^0.2 = 1.2214 > 1.2, but with A < 0 min(rA, clip(r)A) = rA: unclipped
    r1 = math.exp(0.2)
    # tokens 2, 3: r = 1 (old := new, detached); with old = 0.0 they were e^-2 and e^-0.3,
    # and token 2 (r = 0.135 < 0.8) was clipped: no gradient
    expected = -(r1 * advantage + advantage + advantage) / 3
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    out.loss.backward()
    grad = case["new"].grad[0].tolist()
    assert grad == pytest.approx([0.0, -r1 * advantage / 3, -advantage / 3, -advantage / 3], abs=1e-12)
    assert out.ratio_mean == pytest.approx((r1 + 2.0) / 3, abs=1e-12)
    assert out.clipped_fraction == pytest.approx(1 / 3, abs=1e-12)  # token 1 is outside [0.8, 1.2]
    assert all(math.isfinite(v) for v in (out.ratio_p95, out.ratio_p99, out.kl))


def test_unknown_old_logprobs_in_a_gspo_sequence_ratio() -> None:
    case = loss_case()
    config = GRPOLossConfig(importance_sampling_level="sequence", epsilon_low=0.2)
    out = grpo_loss(
        case["new"], case["old"], torch.tensor([0.5], dtype=torch.float64), case["mask"], config=config
    )
    s = math.exp((0.2 + 0.0 + 0.0) / 3)  # the plain tokens add log-ratio 0 to the mean
    assert out.loss.item() == pytest.approx(-s * 0.5, abs=1e-12)
    out.loss.backward()
    assert case["new"].grad[0].tolist() == pytest.approx([0.0] + [-s * 0.5 / 3] * 3, abs=1e-12)


def test_unknown_inference_logprobs_give_tis_weight_one() -> None:
    case = loss_case()
    old = torch.tensor([[0.0, -0.7, -1.9, -0.4]], dtype=torch.float64)  # the trainer's recomputation
    inference = case["old"].clone()
    inference[0, 1] = -0.9  # the sampled token: TIS weight e^0.2; the plain ones are NaN
    config = GRPOLossConfig(tis_cap=2.0)
    out = grpo_loss(
        case["new"],
        old,
        torch.tensor([1.0], dtype=torch.float64),
        case["mask"],
        config=config,
        inference_logprobs=inference,
    )
    r = [math.exp(0.2), math.exp(-0.1), math.exp(0.1)]
    surrogate = [min(r[0], 1.2), r[1], r[2]]  # A = 1: min(r, clip(r)); token 1 clipped at 1.2
    tis = [math.exp(0.2), 1.0, 1.0]
    expected = -sum(t * s for t, s in zip(tis, surrogate)) / 3
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    out.loss.backward()
    assert case["new"].grad[0].tolist() == pytest.approx([0.0, 0.0, -r[1] / 3, -r[2] / 3], abs=1e-12)


def test_a_nan_old_logprob_outside_the_trained_tokens_still_poisons_the_loss() -> None:
    """No tokenization writes one there: it is a real NaN, for the engine's check to refuse."""
    case = loss_case()
    case["old"][0, 0] = math.nan
    out = grpo_loss(case["new"], case["old"], torch.tensor([1.0], dtype=torch.float64), case["mask"])
    assert math.isnan(out.loss.item())
    new = torch.tensor([[math.nan, -1.0]])
    filled = known_logprobs(torch.tensor([[math.nan, math.nan]]), new, torch.tensor([[0.0, 1.0]]))
    assert math.isnan(filled[0, 0].item()) and filled[0, 1].item() == -1.0


# ---------------------------------------------------------------- a Choice without token ids


def logprobs_only(tokens: list[str], logprobs: list[float]) -> Choice:
    """A Choice as litellm converts vLLM's reply: logprobs kept, `token_ids` gone."""
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "x"},
            "logprobs": {
                "content": [
                    {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(tokens, logprobs)
                ]
            },
        }
    )


def test_a_choice_without_token_ids_takes_them_from_its_logprobs(tiny_tokenizer) -> None:  # noqa: ANN001
    from art_mega.trainer.prepare.tokenize import tokenize_history

    tok = tiny_tokenizer
    ids, logprobs = SAMPLED
    (reference,) = tokenize_history(tok, [USER, choice(ids, logprobs)])
    as_ids = logprobs_only([f"token_id:{i}" for i in ids], logprobs)  # return_tokens_as_token_ids
    as_pieces = logprobs_only(tok.convert_ids_to_tokens(ids), logprobs)  # vocabulary tokens
    for converted in (as_ids, as_pieces):
        (seq,) = tokenize_history(tok, [USER, converted])
        assert (seq.input_ids, seq.loss_mask, seq.old_logprobs) == (
            reference.input_ids,
            reference.loss_mask,
            reference.old_logprobs,
        )
    assert seq.input_ids[-3:] == ids and seq.old_logprobs[-3:] == logprobs


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (
            " hello",  # vLLM's default: the decoded text, which no vocabulary token is
            r"trajectory 1 of group 0: messages_and_choices\[1\] is a sampled Choice without token_ids "
            r"whose logprobs.content\[1\].token ' hello' is neither 'token_id:<id>' nor a token of this "
            r"model's vocabulary; request completions with extra_body=\{'return_token_ids': True\}",
        ),
        (
            "token_id:99999",
            r"trajectory 1 of group 0: messages_and_choices\[1\] has logprobs.content\[1\].token "
            r"'token_id:99999', not a token id of this model's \d+-token vocabulary",
        ),
    ],
)
def test_logprob_tokens_that_name_no_token_are_refused(tiny_tokenizer, token: str, message: str) -> None:  # noqa: ANN001
    good = art.Trajectory(messages_and_choices=[USER, choice(*SAMPLED)], reward=1.0)
    bad = art.Trajectory(
        messages_and_choices=[USER, logprobs_only(["token_id:7", token], [-0.1, -0.2])], reward=0.0
    )
    with pytest.raises(TokenizationError, match=message):
        grpo_documents(tiny_tokenizer, [art.TrajectoryGroup([good, bad])])
