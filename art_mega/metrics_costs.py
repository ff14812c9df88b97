"""What an API call cost in USD, from the provider's response: ART's pricing rules for
`art_mega.metrics.track_api_cost` and `MetricsBuilder.add_response_cost`.

A response that states its own cost (OpenRouter's `usage.cost`, LiteLLM's response-cost header)
is taken as is; else a provider's cost extractor registered on the builder; else the token usage
priced per million tokens (`TokenPricing`: registered on the builder, then `MODEL_TOKEN_PRICING`,
then LiteLLM's price table when litellm is installed), read as OpenAI's or Anthropic's usage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from art_mega.errors import HyperParameterError

CostExtractor = Callable[[Any], "float | None"]
"""A provider's own pricing: the response -> its cost in USD, or None to fall back to tokens."""


@dataclass(frozen=True)
class TokenPricing:
    """USD per million tokens: prompt, completion, and (None = the prompt price) OpenAI's cached
    prompt tokens and Anthropic's cache-creation and cache-read tokens."""

    prompt_per_million: float
    completion_per_million: float
    cached_prompt_per_million: float | None = None
    cache_creation_per_million: float | None = None
    cache_read_per_million: float | None = None


MODEL_TOKEN_PRICING: dict[str, TokenPricing] = {
    "openai/gpt-4.1": TokenPricing(2.0, 8.0, cached_prompt_per_million=0.5),
    "anthropic/claude-sonnet-4-6": TokenPricing(
        3.0, 15.0, cache_creation_per_million=3.75, cache_read_per_million=0.30
    ),
}
"""The prices ART ships (model name -> pricing); others come from LiteLLM's table or
`MetricsBuilder.register_model_pricing`."""

PRICE_FIELDS = (
    "prompt_per_million",
    "completion_per_million",
    "cached_prompt_per_million",
    "cache_creation_per_million",
    "cache_read_per_million",
)


def clean_name(where: str, name: str, value: Any, example: str) -> str:
    """`value` stripped; a provider, model name or source must be a non-empty string.

    Raises:
        HyperParameterError: `value` is not a string with a character other than spaces.
    """
    if not isinstance(value, str) or not value.strip(" /"):
        raise HyperParameterError(
            f"{where}({name}={value!r}) must be a non-empty name; pass e.g. {name}={example!r}", name, value
        )
    return value.strip()


def check_price(where: str, name: str, value: Any) -> float | None:
    """`value` as a float (None stays None): a price is a finite number >= 0.

    Raises:
        HyperParameterError: a price that is not a finite number of at least 0.
    """
    from art_mega.hyperparams import check, nonnegative_problem, optional

    check(where, name, value, optional(nonnegative_problem), "2.0")
    return None if value is None else float(value)


def _field(container: Any, name: str) -> Any:
    if container is None:
        return None
    if isinstance(container, Mapping):
        return container.get(name)
    return getattr(container, name, None)


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _stated_cost(value: Any) -> float | None:
    return _number(value) if _number(value) is not None else _number(_field(value, "total_cost"))


def stated_cost(response: Any) -> float | None:
    """The USD cost a response states about itself (`usage.cost`, `usage.model_extra["cost"]`,
    LiteLLM's `llm_provider-x-litellm-response-cost` header), else None."""
    usage = _field(response, "usage")
    for value in (
        _field(usage, "cost"),
        _field(_field(usage, "model_extra"), "cost"),
        _field(
            _field(_field(response, "_hidden_params"), "additional_headers"),
            "llm_provider-x-litellm-response-cost",
        ),
    ):
        cost = _stated_cost(value)
        if cost is not None:
            return cost
    return None


def _litellm_pricing(model_name: str) -> TokenPricing | None:
    try:
        from litellm import get_model_info
    except ImportError:
        return None
    try:
        info = get_model_info(model_name)
    except Exception:  # litellm raises a bare Exception for a model it has no price for
        return None
    per_token = {key: _number(_field(info, key)) for key in ("input_cost_per_token", "output_cost_per_token")}
    if None in per_token.values():
        return None
    cache_read = _number(_field(info, "cache_read_input_token_cost"))
    cache_creation = _number(_field(info, "cache_creation_input_token_cost"))
    million = 1_000_000
    return TokenPricing(
        per_token["input_cost_per_token"] * million,
        per_token["output_cost_per_token"] * million,
        cached_prompt_per_million=None if cache_read is None else cache_read * million,
        cache_creation_per_million=None if cache_creation is None else cache_creation * million,
        cache_read_per_million=None if cache_read is None else cache_read * million,
    )


def resolve_pricing(
    model_name: str, registered: Mapping[str, TokenPricing], overrides: Mapping[str, float | None]
) -> TokenPricing:
    """The pricing of `model_name` (registered, then `MODEL_TOKEN_PRICING`, then LiteLLM's), with
    each non-None `overrides` field (a `TokenPricing` field name) in its place.

    Raises:
        HyperParameterError: no pricing is known for `model_name` and `overrides` do not give
            both the prompt and the completion price.
    """
    base = registered.get(model_name) or MODEL_TOKEN_PRICING.get(model_name) or _litellm_pricing(model_name)
    given = {k: v for k, v in overrides.items() if v is not None}
    if base is None:
        if "prompt_per_million" not in given or "completion_per_million" not in given:
            raise HyperParameterError(
                f"no token pricing is known for model_name={model_name!r}; call "
                f"model.metrics_builder().register_model_pricing({model_name!r}, prompt_per_million=..., "
                "completion_per_million=...) or pass both prompt_price_per_million and "
                "completion_price_per_million to track_api_cost",
                "model_name",
                model_name,
            )
        return TokenPricing(**given)
    return TokenPricing(**{name: given.get(name, getattr(base, name)) for name in PRICE_FIELDS})


def _per_million(tokens: float, price: float) -> float:
    return tokens * price / 1_000_000


def openai_cost(usage: Any, pricing: TokenPricing) -> float | None:
    """OpenAI's usage (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`)
    priced; None when it has none of them."""
    prompt = _number(_field(usage, "prompt_tokens"))
    completion = _number(_field(usage, "completion_tokens"))
    cached = _number(_field(_field(usage, "prompt_tokens_details"), "cached_tokens")) or 0.0
    if prompt is None and completion is None and cached == 0.0:
        return None
    prompt = prompt or 0.0
    cached = min(cached, prompt)
    cached_price = pricing.cached_prompt_per_million
    return (
        _per_million(prompt - cached, pricing.prompt_per_million)
        + _per_million(cached, pricing.prompt_per_million if cached_price is None else cached_price)
        + _per_million(completion or 0.0, pricing.completion_per_million)
    )


def anthropic_cost(usage: Any, pricing: TokenPricing) -> float | None:
    """Anthropic's usage (`input_tokens`, `output_tokens`, `cache_creation_input_tokens`,
    `cache_read_input_tokens`) priced; None when it has none of them."""
    counts = {
        key: _number(_field(usage, key))
        for key in ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    }
    if all(not value for value in counts.values()):
        return None
    creation = pricing.cache_creation_per_million
    read = pricing.cache_read_per_million
    return (
        _per_million(counts["input_tokens"] or 0.0, pricing.prompt_per_million)
        + _per_million(
            counts["cache_creation_input_tokens"] or 0.0,
            pricing.prompt_per_million if creation is None else creation,
        )
        + _per_million(
            counts["cache_read_input_tokens"] or 0.0, pricing.prompt_per_million if read is None else read
        )
        + _per_million(counts["output_tokens"] or 0.0, pricing.completion_per_million)
    )


TOKEN_COSTS: dict[str, Callable[[Any, TokenPricing], float | None]] = {
    "openai": openai_cost,
    "anthropic": anthropic_cost,
}
"""The providers whose usage fields are priced by tokens (as in ART)."""


def response_cost(
    response: Any,
    *,
    provider: str,
    model_name: str,
    extractors: Mapping[str, CostExtractor],
    registered: Mapping[str, TokenPricing],
    overrides: Mapping[str, float | None],
) -> float:
    """The USD cost of one API response (see the module docstring for the order of the rules).

    `provider` and `model_name` are already cleaned (`clean_name`, provider lower-case).

    Raises:
        HyperParameterError: no pricing for `model_name` (see `resolve_pricing`), a response
            without the provider's usage fields, or a provider with neither token pricing here
            nor a registered extractor (each names the fix).
    """
    stated = stated_cost(response)
    if stated is not None:
        return stated
    extractor = extractors.get(provider)
    if extractor is not None:
        custom = _number(extractor(response))
        if custom is not None:
            return custom
    pricing = resolve_pricing(model_name, registered, overrides)
    price = TOKEN_COSTS.get(provider)
    if price is None:
        raise HyperParameterError(
            f"provider={provider!r} has no token pricing in art-mega (only "
            f"{', '.join(sorted(TOKEN_COSTS))}); register one with "
            f"model.metrics_builder().register_cost_extractor({provider!r}, fn)",
            "provider",
            provider,
        )
    cost = price(_field(response, "usage"), pricing)
    if cost is None:
        raise HyperParameterError(
            f"the response of {model_name!r} has no {provider} token usage to price; pass the provider "
            "whose response this is, or register a cost extractor for it",
            "provider",
            provider,
        )
    return cost
