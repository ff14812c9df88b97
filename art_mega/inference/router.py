"""Policy-versioned routing: which step is served, under which model name, by which replica.

The served step moves only through `PolicyRouter.advance`, which the adapter publisher calls
once every replica has loaded that step's adapter.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from art_mega.topology.compiled import ReplicaSpec


@dataclass(frozen=True)
class ReplicaEndpoint:
    """A replica's name (its process name, "NAME-INDEX") and server URL (http://HOST:PORT)."""

    name: str
    url: str

    @classmethod
    def from_spec(cls, spec: ReplicaSpec) -> ReplicaEndpoint:
        return cls(name=spec.process_name, url=spec.endpoint.url)


@dataclass(frozen=True)
class Route:
    """Where one request goes: replica, its URL, the model name to ask for, and the step it
    names (None: the base model, before any adapter was published). `base_url` is what an
    OpenAI client takes."""

    replica: str
    url: str
    model: str
    step: int | None

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def inference_name(model_name: str, step: int | None) -> str:
    """`<model_name>@<step>`, or `model_name` itself (the base model) when `step` is None."""
    return model_name if step is None else f"{model_name}@{step}"


class PolicyRouter:
    """Round-robin routing over `replicas`, always to the latest served step.

    `model_name` is the replicas' `--served-model-name`. Before the first `advance`, requests go
    to the base model (`served_step` is None). Raises `ValueError` for no replicas or repeated
    replica names.
    """

    def __init__(self, model_name: str, replicas: Sequence[ReplicaEndpoint]) -> None:
        if not replicas:
            raise ValueError("a PolicyRouter needs at least one replica")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names repeat: {names}")
        self.model_name = model_name
        self.replicas: tuple[ReplicaEndpoint, ...] = tuple(replicas)
        self._served_step: int | None = None
        self._turn = itertools.cycle(range(len(self.replicas)))
        self._listeners: list[Callable[[int], None]] = []

    @property
    def served_step(self) -> int | None:
        """The step every replica serves and new requests get (None: base model only)."""
        return self._served_step

    def inference_name(self) -> str:
        """The model name of the served step: `<model_name>@<served_step>`."""
        return inference_name(self.model_name, self._served_step)

    def route(self) -> Route:
        """The next replica in turn with the served step's model name; record `step` with the
        answer to know which policy produced it."""
        replica = self.replicas[next(self._turn)]
        return Route(replica.name, replica.url, self.inference_name(), self._served_step)

    def on_advance(self, listener: Callable[[int], None]) -> None:
        """Call `listener(step)` each time the served step advances (after it has)."""
        self._listeners.append(listener)

    def advance(self, step: int) -> None:
        """Make `step` the served step. Only the publisher calls this, after every replica has
        loaded the step's adapter. Raises `ValueError` unless `step` is above the served step."""
        if self._served_step is not None and step <= self._served_step:
            raise ValueError(f"served step can only move forward: {self._served_step} -> {step}")
        self._served_step = step
        for listener in self._listeners:
            listener(step)
