"""Trajectories -> token sequences with trained-token masks and sampling logprobs -> Documents.

Sampled assistant turns (openai `Choice` objects) use the exact token ids and logprobs the
inference server returned (request them with `logprobs=True` and
`extra_body={"return_token_ids": True}`): sampled text is never re-tokenized. Plain messages use
the tokenizer's chat template; an assistant turn's tokens are the difference between the
template of the conversation up to and including it and the template up to it (with the
generation prompt), cut after the first end-of-turn token. Tools are passed to the template.
`additional_histories` become separate sequences that share the trajectory's advantage and weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from art_mega.errors import UserError
from art_mega.trainer.advantages import group_advantages, token_weight
from art_mega.trainer.batch import Document
from art_mega.trajectories import Trajectory, TrajectoryGroup


@dataclass
class TokenizedSequence:
    """One sequence: token ids, 1.0 on trained tokens, and each trained token's sampling logprob."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[float] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)

    def extend(self, ids: Sequence[int], trained: bool, logprobs: Sequence[float] | None = None) -> None:
        self.input_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([1.0 if trained else 0.0] * len(ids))
        self.old_logprobs.extend(list(logprobs) if logprobs is not None else [0.0] * len(ids))

    @property
    def trained_tokens(self) -> int:
        return int(sum(1 for m in self.loss_mask if m > 0))


def _template(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool
) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True
        )
    except Exception as exc:  # the model's own Jinja template: any error is about this input
        raise UserError(
            f"the model's chat template could not render the conversation through messages[{len(messages) - 1}] "
            f"({type(exc).__name__}: {exc}); give that message the fields the template reads (a string "
            "'content') or train a model whose chat template supports it (tools, tool_calls)"
        ) from None
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(i) for i in ids]


def _is_choice(item: Any) -> bool:
    return hasattr(item, "message") and hasattr(item, "finish_reason")


def _choice_tokens(choice: Any) -> tuple[list[int], list[float]]:
    token_ids = getattr(choice, "token_ids", None)
    if token_ids is None and getattr(choice, "model_extra", None):
        token_ids = choice.model_extra.get("token_ids")
    if not token_ids:
        raise UserError(
            "a sampled Choice has no token_ids; request completions with "
            "extra_body={'return_token_ids': True} (model.openai_client() does) so training never re-tokenizes"
        )
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if not content or len(content) != len(token_ids):
        raise UserError(
            f"a sampled Choice has {len(content or [])} logprobs for {len(token_ids)} tokens; request logprobs=True"
        )
    return [int(t) for t in token_ids], [float(c.logprob) for c in content]


def _message_of(item: Any) -> dict[str, Any]:
    if _is_choice(item):
        return item.message.model_dump(exclude_none=True)
    return dict(item)


def _assistant_span(tokenizer: Any, ids: list[int]) -> int:
    """How many tokens of an assistant turn to train: through the first end-of-turn token."""
    eos = tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    for i, token in enumerate(ids):
        if token in eos_ids:
            return i + 1
    return len(ids)


def tokenize_history(
    tokenizer: Any,
    messages_and_choices: Sequence[Any],
    tools: Any = None,
    assistant_turns: Literal["all", "last"] = "all",
) -> TokenizedSequence:
    """One conversation as a TokenizedSequence (see the module docstring for the rules).

    Raises:
        UserError: a Choice without token ids or logprobs, a chat template that fails on the
            conversation (names the message), or one that is not prefix-consistent (the
            conversation so far is not a prefix of the next template).
    """
    items = list(messages_and_choices)
    trainable = [
        i for i, item in enumerate(items) if _is_choice(item) or _message_of(item).get("role") == "assistant"
    ]
    if assistant_turns == "last":
        trainable = trainable[-1:]
    sequence = TokenizedSequence()
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if index in trainable:
            prompt = _template(tokenizer, messages, tools, generation_prompt=True)
            if prompt[: len(sequence.input_ids)] != sequence.input_ids:
                raise UserError(
                    "the chat template is not prefix-consistent for this conversation (turn "
                    f"{index} re-renders earlier turns differently); art-mega cannot align trained tokens"
                )
            sequence.extend(prompt[len(sequence.input_ids) :], trained=False)
            if _is_choice(item):
                ids, logprobs = _choice_tokens(item)
                sequence.extend(ids, trained=True, logprobs=logprobs)
            else:
                full = _template(tokenizer, [*messages, _message_of(item)], tools, generation_prompt=False)
                turn = full[len(prompt) :]
                span = _assistant_span(tokenizer, turn)
                sequence.extend(turn[:span], trained=True)
        messages.append(_message_of(item))
    return sequence


def tokenize_trajectory(
    tokenizer: Any, trajectory: Trajectory, assistant_turns: Literal["all", "last"] = "all"
) -> list[TokenizedSequence]:
    """The trajectory's main history and each `additional_histories` entry, tokenized."""
    sequences = [
        tokenize_history(tokenizer, trajectory.messages_and_choices, trajectory.tools, assistant_turns)
    ]
    for history in trajectory.additional_histories:
        sequences.append(
            tokenize_history(
                tokenizer, history.get("messages_and_choices", []), history.get("tools"), assistant_turns
            )
        )
    return sequences


@dataclass
class BatchStats:
    """What building a GRPO batch kept and dropped."""

    groups: int = 0
    groups_skipped_zero_variance: int = 0
    trajectories_used: int = 0
    trajectories_dropped_zero_advantage: int = 0
    trained_tokens: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {f"data/{k}": float(v) for k, v in self.__dict__.items()}


def grpo_documents(
    tokenizer: Any, groups: Sequence[TrajectoryGroup], scale_rewards: bool = True
) -> tuple[list[Document], BatchStats]:
    """Advantages per group, zero-variance groups skipped, zero-advantage trajectories dropped,
    then each kept trajectory tokenized with weight 1 / (its assistant tokens)."""
    stats = BatchStats(groups=len(groups))
    documents: list[Document] = []
    for group in groups:
        advantages = group_advantages([t.reward for t in group.trajectories], scale_rewards)
        if advantages.skipped:
            stats.groups_skipped_zero_variance += 1
            continue
        for trajectory, advantage in zip(group.trajectories, advantages.advantages):
            if advantage == 0.0:
                stats.trajectories_dropped_zero_advantage += 1
                continue
            sequences = tokenize_trajectory(tokenizer, trajectory)
            weight = token_weight(sum(s.trained_tokens for s in sequences))
            if weight == 0.0:
                stats.trajectories_dropped_zero_advantage += 1
                continue
            stats.trajectories_used += 1
            for s in sequences:
                stats.trained_tokens += s.trained_tokens
                documents.append(Document(s.input_ids, s.loss_mask, s.old_logprobs, advantage, weight))
    return documents, stats


def sft_documents(
    tokenizer: Any, trajectories: Sequence[Trajectory], assistant_turns: Literal["all", "last"] = "all"
) -> tuple[list[Document], BatchStats]:
    """Each trajectory's assistant tokens as SFT documents (advantage 0, weight 1/its tokens)."""
    stats = BatchStats()
    documents: list[Document] = []
    for trajectory in trajectories:
        sequences = tokenize_trajectory(tokenizer, trajectory, assistant_turns)
        weight = token_weight(sum(s.trained_tokens for s in sequences))
        stats.trajectories_used += 1
        for s in sequences:
            stats.trained_tokens += s.trained_tokens
            documents.append(Document(s.input_ids, s.loss_mask, s.old_logprobs, 0.0, weight))
    return documents, stats
