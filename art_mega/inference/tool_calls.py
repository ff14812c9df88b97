"""Which vLLM tool-call parser serves a model: by its HF `model_type` and its tokenizer.

ART 0.5.18 starts every vLLM server with `enable_auto_tool_choice=True` and
`tool_call_parser="hermes"`, whatever the model. Hermes is right for Qwen (its chat templates
write `<tool_call>{json}</tool_call>`), so Qwen keeps ART's parser. Llama 3 and Mistral write
tool calls in their own formats, which hermes does not find, so they get vLLM's parser for that
format — when the tokenizer has the format's marker token: vLLM refuses to start a parser whose
marker its tokenizer lacks (`<|python_tag|>` is Llama 3's; a Llama 2 or SmolLM tokenizer has
none), and such a model gets ART's hermes. Any other model type gets hermes too.

Reads only JSON files (no tokenizer library).
"""

from __future__ import annotations

import json
import os
from collections.abc import Container
from pathlib import Path

DEFAULT_TOOL_CALL_PARSER = "hermes"
"""ART's parser, for model types the table does not name or whose tokenizer lacks the marker."""

TOOL_CALL_PARSERS: dict[str, tuple[str, str | None]] = {
    "qwen2": ("hermes", None),
    "qwen2_moe": ("hermes", None),
    "qwen3": ("hermes", None),
    "qwen3_moe": ("hermes", None),
    "llama": ("llama3_json", "<|python_tag|>"),
    "mistral": ("mistral", "[TOOL_CALLS]"),
    "gemma3_text": ("hermes", None),  # Gemma 3's template has no tool format; ART serves it with hermes
    "gemma3": ("hermes", None),  # the multimodal Gemma 3 wrapper (gemma-3-4b/12b/27b-it): the same template
    "gemma4_text": ("gemma4", "<|tool_call>"),  # Gemma 4's native <|tool_call>call:name{args}<tool_call|>
    "gemma4": ("gemma4", "<|tool_call>"),  # the multimodal Gemma 4 wrapper (every google/gemma-4-*): the same
    "gpt_oss": ("openai", None),  # the harmony format's parser, as ART's GPT-OSS handler names it
    "qwen3_5": ("qwen3_xml", None),  # as ART's Qwen3.5 handler (vllm_server_args)
    "qwen3_5_text": ("qwen3_xml", None),
    "qwen3_5_moe": ("qwen3_xml", None),
    "qwen3_5_moe_text": ("qwen3_xml", None),
    # DeepSeek-V3's native <｜tool▁calls▁begin｜> blocks (vLLM's deepseek_v3 parser); hermes without it
    "deepseek_v3": ("deepseek_v3", "<｜tool▁calls▁begin｜>"),
    # Kimi-K2's <|tool_calls_section_begin|> blocks (vLLM's kimi_k2 parser, `vllm/parser/kimi_k2.py`)
    "kimi_k2": ("kimi_k2", "<|tool_calls_section_begin|>"),
}
"""HF `model_type` -> (vLLM `--tool-call-parser` name, the token it needs in the tokenizer)."""


def tool_call_parser(model_type: object, tokens: Container[str]) -> str:
    """The vLLM tool-call parser for a model of HF `model_type` whose tokenizer holds `tokens`
    (its added and special tokens, see `added_tokens`)."""
    if not isinstance(model_type, str) or model_type not in TOOL_CALL_PARSERS:
        return DEFAULT_TOOL_CALL_PARSER
    parser, marker = TOOL_CALL_PARSERS[model_type]
    return parser if marker is None or marker in tokens else DEFAULT_TOOL_CALL_PARSER


def added_tokens(model_dir: str | os.PathLike[str]) -> frozenset[str]:
    """The added tokens of the HF tokenizer in `model_dir` (tokenizer.json's `added_tokens` and
    tokenizer_config.json's `added_tokens_decoder`); a missing or unreadable file adds none."""
    found: set[str] = set()
    for name, entries in (
        ("tokenizer.json", "added_tokens"),
        ("tokenizer_config.json", "added_tokens_decoder"),
    ):
        try:
            data = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        listed = data.get(entries) if isinstance(data, dict) else None
        items = listed.values() if isinstance(listed, dict) else listed if isinstance(listed, list) else ()
        found.update(
            item["content"]
            for item in items
            if isinstance(item, dict) and isinstance(item.get("content"), str)
        )
    return frozenset(found)
