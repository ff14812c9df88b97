"""Policy-versioned routing: which step is served, under which model name, by which replica.

The served step moves only through `PolicyRouter.advance`, which the adapter publisher calls
once every replica has loaded that step's adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from art_mega.errors import NoReplicaUpError
from art_mega.inference.fleet import FleetLoad
from art_mega.topology.compiled import ReplicaSpec

log = logging.getLogger(__name__)

REFUSED = "refused or reset a connection"
"""How a down reason set by `PolicyRouter.fail_over` begins: a request's connection to the
replica was refused or reset before any answer (`policy_client.FailoverTransport`): its process
is gone, or not listening. Set by a client, not the replica's agent: `ReplicaRecovery` routes to
such a replica again once it answers its health check while its process runs."""


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
    """Least-loaded routing over the replicas that are up (ties round-robin; affinity keys
    stay on one replica: `inference.fleet`), always to the latest served step.

    `model_name` is the replicas' `--served-model-name`. Before the first `advance`, requests go
    to the base model (`served_step` is None). A replica marked down (`mark_down`, e.g. it
    crashed) gets no traffic until `mark_up` (after it was restarted and reloaded). Raises
    `ValueError` for no replicas or repeated replica names.
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
        self.load = FleetLoad(names)
        self._listeners: list[Callable[[int], None]] = []
        self._down: dict[str, str] = {}

    @property
    def served_step(self) -> int | None:
        """The step every replica serves and new requests get (None: base model only)."""
        return self._served_step

    def inference_name(self) -> str:
        """The model name of the served step: `<model_name>@<served_step>`."""
        return inference_name(self.model_name, self._served_step)

    def route(self, key: str | None = None) -> Route:
        """The replica that is up for a request with affinity `key` (`FleetLoad.pick`: the
        key's replica, else the least-loaded, ties in turn), with the served step's model name;
        record `step` with the answer to know which policy produced it. Count the request in
        flight with `self.load.request(route.replica)`.

        Raises `NoReplicaUpError` (naming each replica and why it is down) when none is up.
        """
        up = [r.name for r in self.replicas if r.name not in self._down]
        if up:
            replica = self.endpoint(self.load.pick(up, key))
            return Route(replica.name, replica.url, self.inference_name(), self._served_step)
        reasons = "; ".join(f"{r.name} ({r.url}): {self._down[r.name]}" for r in self.replicas)
        raise NoReplicaUpError(self.model_name, reasons)

    def up(self) -> tuple[ReplicaEndpoint, ...]:
        """The replicas that take traffic (and receive new adapters), in order."""
        return tuple(r for r in self.replicas if r.name not in self._down)

    def down(self) -> dict[str, str]:
        """Replica name -> why it is down, for every replica that is down."""
        return dict(self._down)

    def endpoint(self, name: str) -> ReplicaEndpoint:
        """The replica called `name`. Raises `ValueError` naming the known replicas."""
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise ValueError(f"no replica {name!r}; the router has {[r.name for r in self.replicas]}")

    def replica_at(self, url: str) -> ReplicaEndpoint | None:
        """The replica whose server is at `url`'s scheme, host and port (any path), or None."""
        where = urlsplit(url)
        for replica in self.replicas:
            mine = urlsplit(replica.url)
            if (mine.scheme, mine.hostname, mine.port) == (where.scheme, where.hostname, where.port):
                return replica
        return None

    def fail_over(self, name: str, cause: str, key: str | None = None) -> Route:
        """Replica `name` refused or reset a request's connection (`cause`: the error): mark it down at
        once (unless it is already down; reason `REFUSED`...) and return the route of another
        replica that is up for the request's affinity `key` (which moves there, once). Logs the
        move. Raises `NoReplicaUpError` when no other replica is up."""
        if name not in self._down:
            self.mark_down(name, f"{REFUSED} ({cause})")
            log.warning("replica %s %s (%s): no more requests go to it until it is back", name, REFUSED, cause)
        route = self.route(key)
        log.warning(
            "request moved from replica %s to %s (%s)%s",
            name,
            route.replica,
            route.url,
            "" if key is None else f", affinity key {key[:12]} with it",
        )
        return route

    def mark_down(self, name: str, reason: str) -> None:
        """Send no more requests to replica `name` (`reason`: why, shown in errors)."""
        self.endpoint(name)
        self._down[name] = reason

    def mark_up(self, name: str) -> None:
        """Route to replica `name` again. Only the publisher calls this, once the replica has
        loaded every adapter of the keep window (see `AdapterPublisher.restore`)."""
        self.endpoint(name)
        self._down.pop(name, None)

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
