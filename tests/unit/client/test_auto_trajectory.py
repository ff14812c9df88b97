"""ART's auto_trajectory / capture_auto_trajectory against a tiny OpenAI-compatible server this
test starts (uvicorn on loopback): each chat completion the rollout makes becomes a turn of the
trajectory, a conversation that does not continue it becomes an additional history."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.chat.chat_completion import Choice
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import art_mega as art
from art_mega.errors import UserError
from tests.helpers import serve_in_thread


async def _completions(request: Request) -> Response:
    body = await request.json()
    said = f"heard {len(body['messages'])}"
    if body.get("stream"):
        chunk = {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": body["model"],
            "choices": [
                {"index": 0, "finish_reason": "stop", "delta": {"role": "assistant", "content": said}}
            ],
        }
        events = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return Response(events, media_type="text/event-stream")
    return JSONResponse(
        {
            "id": "c1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": said}}
            ],
        }
    )


@pytest.fixture(scope="module")
def endpoint():
    app = Starlette(routes=[Route("/v1/chat/completions", _completions, methods=["POST"])])
    with serve_in_thread(app) as url:
        yield f"{url}/v1"


def _model(endpoint: str) -> art.Model:
    return art.Model(name="echo", project="p", inference_base_url=endpoint, inference_api_key="k")


async def _agent(model: art.Model, reward: float) -> str:
    client = model.openai_client()
    messages = [{"role": "user", "content": "hello"}]
    first = await client.chat.completions.create(model=model.get_inference_name(), messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "again"}]
    await client.chat.completions.create(model=model.get_inference_name(), messages=messages)
    # a side conversation (another prompt) is an additional history
    await client.chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "judge this"}]
    )
    art.auto_trajectory(required=True).reward = reward
    return "ignored"


def test_capture_auto_trajectory_records_every_completion_of_the_rollout(endpoint):
    model = _model(endpoint)

    async def main() -> list[art.Trajectory]:
        return await asyncio.gather(*(art.capture_auto_trajectory(_agent(model, r)) for r in (0.5, 1.0)))

    for trajectory, reward in zip(asyncio.run(main()), (0.5, 1.0)):
        assert trajectory.reward == reward
        items = trajectory.messages_and_choices
        assert [type(i).__name__ for i in items] == ["dict", "Choice", "dict", "Choice"]
        assert [i.message.content for i in items if isinstance(i, Choice)] == ["heard 1", "heard 3"]
        assert items[2] == {"role": "user", "content": "again"}
        (side,) = trajectory.additional_histories
        assert side.messages_and_choices[0] == {"role": "user", "content": "judge this"}
        assert side.messages_and_choices[1].message.content == "heard 1"
        assert trajectory.metrics["duration"] >= 0


def test_auto_trajectory_outside_a_capture_and_streamed_completions(endpoint):
    assert art.auto_trajectory() is None
    with pytest.raises(RuntimeError, match="must run inside art.capture_auto_trajectory"):
        art.auto_trajectory(required=True)

    async def streams() -> None:
        client = _model(endpoint).openai_client()
        stream = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        assert [c.choices[0].delta.content async for c in stream] == ["heard 1"]

    with pytest.raises(UserError, match="saw 1 streamed chat completion"):
        asyncio.run(art.capture_auto_trajectory(streams()))
