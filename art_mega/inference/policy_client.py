"""The OpenAI client rollouts use: each request goes to a replica that is up, each choice is
tagged with the policy step that served it, and a failed request names its replica.
"""

from __future__ import annotations

from typing import Any

from art_mega.errors import ReplicaRequestError
from art_mega.inference.fleet import affinity_key
from art_mega.inference.replies import checked_reply
from art_mega.inference.router import PolicyRouter
from art_mega.trainer.behaviour import tag_request_sampling
from art_mega.trajectories import POLICY_STEP_FIELD


def served_step(router: PolicyRouter, served_model: str) -> int | None:
    """The step in a reply's `model` field (`<name>@<step>`, as vLLM names the adapter that
    answered); None for the base model or another name."""
    prefix = f"{router.model_name}@"
    if served_model.startswith(prefix) and served_model[len(prefix) :].isdigit():
        return int(served_model[len(prefix) :])
    return None


def tag_choices(router: PolicyRouter, reply: Any) -> Any:
    """Set `policy_step` (see `art_mega.trajectories.POLICY_STEP_FIELD`) on every choice of a
    (non-streamed) completion reply from the reply's own `model` field: the server's word on
    which adapter produced it, not the router's guess. Where the reply has the prompt's token
    ids (`return_token_ids`), each choice also keeps them as `prompt_token_ids`: training then
    trains the choice after exactly the prompt vLLM tokenized (`trainer.tokenize`). Returns `reply`."""
    step = served_step(router, str(getattr(reply, "model", "")))
    prompt = getattr(reply, "prompt_token_ids", None)
    for choice in getattr(reply, "choices", None) or ():
        setattr(choice, POLICY_STEP_FIELD, step)
        if prompt is not None:
            choice.prompt_token_ids = list(prompt)
    return reply


def policy_client(router: PolicyRouter, training_defaults: bool = True, **kwargs: Any) -> Any:
    """An `openai.AsyncOpenAI` over `router`'s replicas (`kwargs` go to its constructor).

    `chat.completions.create` and `completions.create` pick a replica per request
    (`router.route(inference.fleet.affinity_key(options))`: the replica already holding the
    request's prompt prefix, else the least-loaded one that is up), count it in flight
    there until it is answered, tag each choice of a
    non-streamed reply with its policy step (`tag_choices`) once it reads as a completion
    (`inference.replies.checked_reply`), and turn an `openai.APIError` into
    `ReplicaRequestError` naming the replica. With `training_defaults`, chat completions
    ask for `logprobs=True` and `extra_body={"return_token_ids": True}` unless the caller says
    otherwise (training then never re-tokenizes sampled text).

    Raises (from `create`): `NoReplicaUpError` when every replica is down, `ReplicaRequestError`,
    `CompletionReplyError` when a replica answers without choices, or a choice without its
    message (chat) or text (completions).
    """
    import openai

    client = openai.AsyncOpenAI(base_url=f"{router.replicas[0].url}/v1", **{"api_key": "art-mega", **kwargs})

    def routed(pick: Any, chat: bool) -> Any:
        async def create(*args: Any, **options: Any) -> Any:
            if chat and training_defaults:
                options.setdefault("logprobs", True)
                extra = dict(options.get("extra_body") or {})
                extra.setdefault("return_token_ids", True)
                options["extra_body"] = extra
            route = router.route(affinity_key(options))
            target = pick(client.with_options(base_url=route.base_url))
            try:
                with router.load.request(route.replica):
                    reply = await target.create(*args, **options)
            except openai.APIError as exc:
                raise ReplicaRequestError(route.replica, route.url, route.model, exc) from exc
            if options.get("stream"):
                return reply
            server = f"replica {route.replica} ({route.url})"
            reply = tag_choices(router, checked_reply(reply, server, str(options.get("model")), chat))
            return tag_request_sampling(reply, options) if chat else reply

        return create

    client.chat.completions.create = routed(lambda c: c.chat.completions, chat=True)  # type: ignore[method-assign]
    client.completions.create = routed(lambda c: c.completions, chat=False)  # type: ignore[method-assign]
    return client
