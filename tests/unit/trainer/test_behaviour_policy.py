"""The behaviour-policy rule's data path (`art_mega.trainer.behaviour`): a choice's
`art_mega_sampling` tag -> per-token sampling fields of the packed batch, and the warning."""

import logging

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice

from art_mega import Trajectory, TrajectoryGroup
from art_mega.errors import TokenizationError
from art_mega.trainer.batch import TrainBatch, pack
from art_mega.trainer.behaviour import (
    CONSTRAINED,
    EXACT,
    NOT_SAMPLED,
    PROCESSED,
    UNTAGGED,
    BehaviourMonitor,
    behaviour_warning,
    choice_sampling,
)
from art_mega.trainer.prepare.tokenize import grpo_documents

USER = {"role": "user", "content": "hi there"}


def choice(token_ids, tag=None):
    body = {
        "index": 0,
        "finish_reason": "stop",
        "message": {"role": "assistant", "content": "hello"},
        "token_ids": token_ids,
        "logprobs": {
            "content": [
                {"token": str(t), "logprob": -0.5, "bytes": [], "top_logprobs": []} for t in token_ids
            ]
        },
    }
    if tag is not None:
        body["art_mega_sampling"] = tag
    return Choice.model_validate(body)


def tag(**changes):
    base = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.0,
        "constrained": False,
        "processed": False,
    }
    return {**base, **changes}


def test_a_tag_reads_as_the_effective_sampling():
    s = choice_sampling(choice([7], tag()))
    assert (s.code, s.temperature, s.top_k, s.top_p, s.min_p) == (EXACT, 0.7, 0, 0.9, 0.0)
    assert choice_sampling(choice([7], tag(constrained=True))).code == CONSTRAINED
    assert choice_sampling(choice([7], tag(processed=True))).code == PROCESSED
    greedy = choice_sampling(choice([7], tag(temperature=0.0, top_k=20, min_p=0.1)))
    assert (greedy.temperature, greedy.top_k, greedy.min_p) == (1.0, 20, 0.1)
    assert choice_sampling(choice([7])).code == UNTAGGED and choice_sampling(choice([7])).temperature == 1.0
    plain = choice([7])
    plain.art_mega_sampling = tag(top_p=1.0)  # set as an attribute, as a client-side tagger would
    assert choice_sampling(plain).top_p == 1.0 and choice_sampling(plain).code == EXACT


def test_a_malformed_tag_is_refused_naming_the_key():
    with pytest.raises(TokenizationError) as info:
        choice_sampling(choice([7], tag(temperature="hot")), "trajectory 2 of group 0", 3)
    assert str(info.value).startswith(
        "trajectory 2 of group 0: messages_and_choices[3].art_mega_sampling['temperature'] is 'hot', "
        "not a finite number"
    )


def test_the_packed_batch_carries_each_tokens_sampling(tiny_tokenizer):
    group = TrajectoryGroup(
        [
            Trajectory(messages_and_choices=[USER, choice([7, 8, 2], tag(top_k=5))], reward=1.0),
            Trajectory(messages_and_choices=[USER, choice([9, 2], tag(constrained=True))], reward=0.0),
            Trajectory(messages_and_choices=[USER, choice([5, 2])], reward=0.2),
        ]
    )
    documents, _ = grpo_documents(tiny_tokenizer, [group])
    (batch,) = pack(documents, 64)
    trained = batch.loss_mask > 0
    assert sorted(batch.sampling[trained].tolist()) == [EXACT] * 3 + [UNTAGGED] * 2 + [CONSTRAINED] * 2
    assert bool((batch.sampling[~trained] == NOT_SAMPLED).all())
    exact = batch.sampling == EXACT
    assert bool((batch.temperature[exact] == np.float32(0.7)).all()) and bool((batch.top_k[exact] == 5).all())
    assert bool((batch.top_p[exact] == np.float32(0.9)).all())
    untagged = batch.sampling == UNTAGGED
    assert bool((batch.temperature[untagged] == 1.0).all()) and bool((batch.top_p[untagged] == 1.0).all())
    assert bool((batch.temperature[~trained] == 1.0).all()) and bool((batch.top_k[~trained] == 0).all())


def test_the_fields_survive_the_batch_file(tmp_path):
    z = np.zeros((1, 3), np.float32)
    batch = TrainBatch(
        np.zeros((1, 3), np.int64),
        np.ones((1, 3), np.int32),
        np.zeros((1, 3), np.int64),
        z,
        z,
        z,
        z,
        temperature=np.full((1, 3), 0.7, np.float32),
        sampling=np.array([[0, 1, 3]], np.int8),
    )
    batch.save(tmp_path / "b.safetensors")
    back = TrainBatch.load(tmp_path / "b.safetensors")
    assert back.temperature.tolist() == batch.temperature.tolist() and back.sampling.tolist() == [[0, 1, 3]]
    assert back.top_k.dtype == np.int32 and back.top_p.tolist() == [[1.0, 1.0, 1.0]]


def test_the_warning_names_the_cause_and_the_options_once(caplog):
    quiet = {"offpolicy/sampler_logprob_gap_mean": 0.01, "offpolicy/sampler_logprob_gap_p95": 0.04}
    assert behaviour_warning(quiet) is None
    constrained = {
        "offpolicy/sampler_logprob_gap_mean": 5.3,
        "offpolicy/sampler_logprob_gap_p95": 7.4,
        "offpolicy/constrained_token_fraction": 0.75,
        "offpolicy/processed_token_fraction": 0.0,
        "offpolicy/untagged_token_fraction": 0.0,
    }
    monitor = BehaviourMonitor()
    caplog.set_level(logging.WARNING, logger="art_mega.trainer.behaviour")
    assert monitor.check(quiet) is None
    message = monitor.check(constrained)
    assert monitor.check(constrained) is None and monitor.check({**constrained, "x": 1.0}) is None
    assert [r.getMessage() for r in caplog.records] == [message]
    assert message == (
        "behaviour policy: the sampler's logprobs differ from the trainer's by 5.300 nats per token "
        "(mean, p95 7.400; warned above 0.05) because 75% of the trained tokens were sampled under a "
        "constraint (a JSON schema, regex, grammar or tool_choice='required'/a named tool), whose logprobs "
        "vLLM takes after the mask. Those tokens train with the trainer's own logprob as their behaviour "
        "logprob (ratio 1) where the sampler's distribution is not computable. Options: sample without the "
        "constraint or processors; precalculate_logprobs=True (the trainer recomputes the old policy before "
        "the step) with truncated_importance_sampling=C (TIS caps exp(old - sampler) at C); or accept the gap."
    )
    untagged = behaviour_warning(
        {"offpolicy/sampler_logprob_gap_mean": 0.31, "offpolicy/untagged_token_fraction": 1.0}
    )
    assert (
        "100% come from choices without art_mega_sampling, so their temperature and truncation are unknown"
        in untagged
    )
    numerics = behaviour_warning({"offpolicy/sampler_logprob_gap_mean": 0.2})
    assert "not run with --logprobs-mode processed_logprobs" in numerics


def test_a_request_without_a_replica_tag_is_tagged_from_its_options():
    from art_mega.trainer.behaviour import request_sampling, tag_request_sampling

    assert request_sampling({}) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "constrained": False,
        "processed": False,
    }
    options = {
        "temperature": 0.7,
        "top_p": 0.9,
        "extra_body": {"top_k": 20, "min_p": 0.05, "return_token_ids": True},
    }
    assert request_sampling(options) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "constrained": False,
        "processed": False,
    }
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    for constraining in (
        {"response_format": schema},
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"structured_outputs": {"regex": "[ab]+"}}},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    ):
        assert request_sampling(constraining)["constrained"], constraining
    assert not request_sampling({"tool_choice": "auto", "response_format": {"type": "text"}})["constrained"]
    for processing in (
        {"frequency_penalty": 0.5},
        {"presence_penalty": -0.1},
        {"logit_bias": {"7": 5}},
        {"extra_body": {"repetition_penalty": 1.1}},
        {"extra_body": {"min_tokens": 3}},
        {"extra_body": {"bad_words": ["x"]}},
    ):
        assert request_sampling(processing)["processed"], processing
    server = choice([7], tag(temperature=0.3))
    client = choice([7])

    class Reply:
        choices = [server, client]

    tag_request_sampling(Reply(), {"temperature": 0.9, "response_format": schema})
    assert choice_sampling(server).temperature == 0.3  # the replica's own tag is kept
    assert choice_sampling(client).temperature == 0.9 and choice_sampling(client).code == CONSTRAINED
