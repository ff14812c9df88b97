"""The behaviour-policy rule: which distribution a sampled token was drawn from, per token, and
the once-per-run warning when the trainer cannot reproduce it.

vLLM samples token t from q_t = softmax(truncate(l_t / T)) (vLLM 0.32's `v1/sample/sampler.py`:
temperature, then min_p, then top_k, then top_p, each masking logits to -inf, renormalised by
the softmax), or from a distribution the trainer cannot compute: a grammar mask (a JSON schema,
a regex, `tool_choice="required"` or a named tool; applied to the logits before the sampler),
penalties, `logit_bias`, bad words or other logits processors. The replica reports, per sampled
choice, the effective values it sampled with as `art_mega_sampling` (`SAMPLING_FIELD`) and, run
with `--logprobs-mode processed_logprobs`, the logprobs of q_t itself.

The trainer computes log q_t of the same tokens (temperature and truncation per token,
`logprobs.SamplingRows`) wherever that is computable ("exact"). A token whose choice carries no
tag is taken as sampled at T=1 without truncation (ART's and art-mega's rule before the tag;
"untagged"). A token sampled under a constraint or with processed logits ("constrained",
"processed") has a sampler logprob the trainer cannot reproduce: its behaviour logprob is
unknown, and the trainer's own (detached, before the update) stands in for it (ratio 1, TIS
weight 1), as ART does with a non-finite sampler logprob (`art/loss.py`).

Codes (`TrainBatch.sampling`, int8 per token): NOT_SAMPLED (prompt and plain assistant tokens),
EXACT, UNTAGGED, CONSTRAINED, PROCESSED.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from art_mega.errors import TokenizationError
from art_mega.trajectories import SAMPLING_FIELD

log = logging.getLogger(__name__)


NOT_SAMPLED, EXACT, UNTAGGED, CONSTRAINED, PROCESSED = 0, 1, 2, 3, 4
"""Per-token codes of `TrainBatch.sampling`."""

GREEDY_TEMPERATURE = 1e-5
"""Below this temperature vLLM samples greedily and reports logprobs at T=1 (`_SAMPLING_EPS` in
vLLM's sampler): such a token is computed at T=1."""

GAP_WARN_NATS = 0.05
"""The warning threshold: a step whose mean |sampler logprob - trainer logprob| over its trained
tokens exceeds this many nats per token warns (once per run). Matching engines differ by
~1e-3 in float32 and ~1e-2 in bfloat16; a temperature of 0.7 the trainer ignores gave 0.31."""


@dataclass(frozen=True)
class TokenSampling:
    """What one choice's tokens were sampled with (the trainer's view of `SAMPLING_FIELD`)."""

    code: int = UNTAGGED
    temperature: float = 1.0
    top_k: int = 0
    """0: no top-k (vLLM's 0 and -1 both mean off)."""
    top_p: float = 1.0
    min_p: float = 0.0


SFT_SAMPLING = TokenSampling(code=NOT_SAMPLED)
"""A token that was not sampled (prompt, plain assistant message)."""


def _number(tag: Mapping[str, Any], key: str, default: float, where: str, turn: int) -> float:
    value = tag.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TokenizationError(
            f"{where}: messages_and_choices[{turn}].{SAMPLING_FIELD}[{key!r}] is {value!r}, not a finite "
            "number; train choices as the replica tagged them",
            where,
            turn,
        )
    return float(value)


def choice_sampling(choice: Any, where: str = "the conversation", turn: int = 0) -> TokenSampling:
    """The `TokenSampling` of a sampled choice from its `SAMPLING_FIELD` (an attribute, a pydantic
    extra field or a dict key); UNTAGGED (T=1, no truncation) when it has none.

    Raises:
        TokenizationError: the tag is not a mapping or holds a value that is not a finite number
            (names `where` and the message index).
    """
    tag = getattr(choice, SAMPLING_FIELD, None)
    if tag is None:
        tag = (getattr(choice, "model_extra", None) or {}).get(SAMPLING_FIELD)
    if tag is None and isinstance(choice, Mapping):
        tag = choice.get(SAMPLING_FIELD)
    if tag is None:
        return TokenSampling()
    if hasattr(tag, "model_dump"):
        tag = tag.model_dump()
    if not isinstance(tag, Mapping):
        raise TokenizationError(
            f"{where}: messages_and_choices[{turn}].{SAMPLING_FIELD} is a {type(tag).__name__}, not an "
            "object; train choices as the replica tagged them",
            where,
            turn,
        )
    temperature = _number(tag, "temperature", 1.0, where, turn)
    top_k = int(_number(tag, "top_k", 0, where, turn))
    top_p = _number(tag, "top_p", 1.0, where, turn)
    min_p = _number(tag, "min_p", 0.0, where, turn)
    code = EXACT
    if tag.get("constrained"):
        code = CONSTRAINED
    elif tag.get("processed"):
        code = PROCESSED
    return TokenSampling(
        code=code,
        temperature=1.0 if temperature < GREEDY_TEMPERATURE else temperature,
        top_k=max(top_k, 0),
        top_p=top_p if 0.0 < top_p < 1.0 else 1.0,
        min_p=min_p if 0.0 < min_p < 1.0 else 0.0,
    )


_CONSTRAINING_EXTRAS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
_PROCESSING_EXTRAS = ("bad_words", "allowed_token_ids", "logits_processors")


def request_sampling(options: Mapping[str, Any]) -> dict[str, Any]:
    """The `SAMPLING_FIELD` tag of a chat completion request from its options (top level or in
    `extra_body`, as the OpenAI client sends them): what the replica samples with where it does
    not tag its choices itself. An option left out is vLLM's default (T=1, top_p 1, top_k off,
    min_p 0): the replicas run with `--generation-config vllm` (`MegatronBackend`), so the model's
    generation_config.json does not change them. Constrained: a `response_format` of json_schema /
    json_object, vLLM's structured_outputs or guided_* options, `tool_choice` "required" or a
    named tool. Processed: a frequency / presence / repetition penalty, `logit_bias`,
    `min_tokens`, bad words, allowed token ids or logits processors."""
    extra = options.get("extra_body") or {}

    def get(key: str, default: Any) -> Any:
        value = options.get(key, extra.get(key))
        return default if value is None else value

    response_format = get("response_format", {})
    tool_choice = get("tool_choice", "auto")
    constrained = (
        (
            isinstance(response_format, Mapping)
            and response_format.get("type") in ("json_schema", "json_object")
        )
        or any(extra.get(key) for key in _CONSTRAINING_EXTRAS)
        or tool_choice == "required"
        or isinstance(tool_choice, Mapping)
    )
    processed = (
        get("frequency_penalty", 0.0) != 0.0
        or get("presence_penalty", 0.0) != 0.0
        or get("repetition_penalty", 1.0) != 1.0
        or bool(get("logit_bias", None))
        or get("min_tokens", 0) > 0
        or any(extra.get(key) for key in _PROCESSING_EXTRAS)
    )
    return {
        "temperature": float(get("temperature", 1.0)),
        "top_p": float(get("top_p", 1.0)),
        "top_k": int(get("top_k", 0)),
        "min_p": float(get("min_p", 0.0)),
        "constrained": bool(constrained),
        "processed": bool(processed),
    }


def tag_request_sampling(reply: Any, options: Mapping[str, Any]) -> Any:
    """Set `SAMPLING_FIELD` (`request_sampling(options)`) on each choice of a chat completion
    `reply` that the replica did not tag; returns `reply`."""
    tag = None
    for choice in getattr(reply, "choices", None) or ():
        if getattr(choice, SAMPLING_FIELD, None) is None:
            tag = request_sampling(options) if tag is None else tag
            setattr(choice, SAMPLING_FIELD, dict(tag))
    return reply


GAP_MEAN = "offpolicy/sampler_logprob_gap_mean"
GAP_P95 = "offpolicy/sampler_logprob_gap_p95"
CONSTRAINED_FRACTION = "offpolicy/constrained_token_fraction"
PROCESSED_FRACTION = "offpolicy/processed_token_fraction"
UNTAGGED_FRACTION = "offpolicy/untagged_token_fraction"
"""The step metrics of the rule (ART's `offpolicy` section): the mean and p95 of |sampler logprob
- trainer logprob| over the trained tokens with a sampler logprob, from the step's forward pass
(before its update), and the fractions of trained tokens sampled under a constraint, with
processed logits, or from a choice without `SAMPLING_FIELD`."""


def behaviour_warning(metrics: Mapping[str, float]) -> str | None:
    """The warning for a step's metrics, None below `GAP_WARN_NATS`: the gap, its cause (the
    largest of the fractions, else a numerics or logprobs-mode mismatch) and the options."""
    gap = metrics.get(GAP_MEAN)
    if gap is None or not gap > GAP_WARN_NATS:
        return None
    causes = []
    if metrics.get(CONSTRAINED_FRACTION, 0.0) > 0:
        causes.append(
            f"{metrics[CONSTRAINED_FRACTION]:.0%} of the trained tokens were sampled under a constraint "
            "(a JSON schema, regex, grammar or tool_choice='required'/a named tool), whose logprobs vLLM "
            "takes after the mask"
        )
    if metrics.get(PROCESSED_FRACTION, 0.0) > 0:
        causes.append(
            f"{metrics[PROCESSED_FRACTION]:.0%} were sampled with penalties, logit_bias, bad words or "
            "logits processors"
        )
    if metrics.get(UNTAGGED_FRACTION, 0.0) > 0:
        causes.append(
            f"{metrics[UNTAGGED_FRACTION]:.0%} come from choices without {SAMPLING_FIELD}, so their "
            "temperature and truncation are unknown (taken as T=1, untruncated)"
        )
    if not causes:
        causes.append(
            "the replicas' logprobs differ from the trainer's (a replica not run with --logprobs-mode "
            "processed_logprobs, another dtype or another model)"
        )
    return (
        f"behaviour policy: the sampler's logprobs differ from the trainer's by {gap:.3f} nats per token "
        f"(mean, p95 {metrics.get(GAP_P95, float('nan')):.3f}; warned above {GAP_WARN_NATS}) because "
        + "; ".join(causes)
        + ". Those tokens train with the trainer's own logprob as their behaviour logprob (ratio 1) "
        "where the sampler's distribution is not computable. Options: sample without the constraint or "
        "processors; precalculate_logprobs=True (the trainer recomputes the old policy before the step) "
        "with truncated_importance_sampling=C (TIS caps exp(old - sampler) at C); or accept the gap."
    )


class BehaviourMonitor:
    """Logs `behaviour_warning` once per run (the first step above the threshold)."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, metrics: Mapping[str, float]) -> str | None:
        """The warning logged now (once per monitor), else None."""
        if self.warned:
            return None
        message = behaviour_warning(metrics)
        if message is not None:
            self.warned = True
            log.warning(message)
        return message
