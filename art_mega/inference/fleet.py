"""Which replica of a fleet takes a request: least-loaded, with affinity for shared prefixes.

A request goes to the replica (among those up) with the fewest requests in flight from this
process; ties go round-robin. A request with an affinity key (`affinity_key`: by default the
conversation up to its first user message, so one trajectory's turns and one group's identical
prompts share a key) goes to the replica that took the key first, as long as that replica is
up: its prefix cache then holds the shared prompt. A key seen for the first time, or whose
replica went down (crashed, restarting, or reloading its adapters: `PolicyRouter.mark_down`),
goes to the least-loaded replica and is pinned there.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from art_mega.errors import HyperParameterError

AFFINITY = contextvars.ContextVar[str | None]("art_mega_replica_affinity", default=None)
"""An explicit affinity key for the requests made in this context (see `affinity`)."""

PINNED_KEYS = 4096
"""How many affinity keys a fleet remembers (least recently used forgotten first): far more
than the trajectories in flight at once, few enough to stay a few hundred KiB."""


@contextlib.contextmanager
def affinity(key: str) -> Iterator[None]:
    """Route every request made inside this block with affinity key `key` (instead of the
    prompt's), e.g. `with affinity(f"episode-{i}"):` around a rollout whose turns do not share
    their first messages. Raises `HyperParameterError` for a key that is not a non-empty str."""
    if not isinstance(key, str) or not key:
        raise HyperParameterError(
            f"affinity(key={key!r}) must be a non-empty string; name the trajectory or group whose requests share a replica",
            "key",
            key,
        )
    token = AFFINITY.set(key)
    try:
        yield
    finally:
        AFFINITY.reset(token)


def affinity_key(options: Mapping[str, Any]) -> str | None:
    """The affinity key of a request's keyword arguments (`chat.completions.create` or
    `completions.create`): the key of the enclosing `affinity` block; else a sha256 of the
    `messages` up to and including the first user message (every turn of a trajectory starts
    with them, and a group's requests repeat them); else of the `prompt`'s first 2048
    characters; None when the request has neither."""
    explicit = AFFINITY.get()
    if explicit is not None:
        return explicit
    messages = options.get("messages")
    if messages:
        head = []
        for message in messages:
            # a Choice's message (pydantic) is hashed as its dict, as the request would send it
            record = message if isinstance(message, Mapping) else _as_dict(message)
            head.append(record)
            if record.get("role") == "user":
                break
        text = json.dumps(head, sort_keys=True, default=str)
    elif isinstance(options.get("prompt"), str):
        text = options["prompt"][:2048]
    else:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _as_dict(message: Any) -> Mapping[str, Any]:
    dump = getattr(message, "model_dump", None)
    return dump() if callable(dump) else {"text": str(message)}


class FleetLoad:
    """In-flight request counts and affinity pins of one fleet of replicas (by name).

    `pick(up, key)` chooses the replica; `request(name)` counts a request in flight for its
    duration. Not thread-safe: one event loop drives it.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names: tuple[str, ...] = tuple(names)
        self._in_flight: dict[str, int] = dict.fromkeys(self.names, 0)
        self._pins: OrderedDict[str, str] = OrderedDict()
        self._turn = 0

    def in_flight(self) -> dict[str, int]:
        """Replica name -> requests from this process it has not answered yet."""
        return dict(self._in_flight)

    def pick(self, up: Sequence[str], key: str | None = None) -> str:
        """The replica among `up` (names, non-empty) for a request with affinity `key`: the
        key's pinned replica when it is up, else the one with the fewest requests in flight
        (ties: the next in turn after the last pick), then pinned for `key`."""
        if key is not None and self._pins.get(key) in up:
            self._pins.move_to_end(key)
            return self._pins[key]
        order = [self.names[(self._turn + i) % len(self.names)] for i in range(len(self.names))]
        name = min((n for n in order if n in up), key=lambda n: self._in_flight[n])
        self._turn = (self.names.index(name) + 1) % len(self.names)
        if key is not None:
            self._pins[key] = name
            self._pins.move_to_end(key)
            while len(self._pins) > PINNED_KEYS:
                self._pins.popitem(last=False)
        return name

    @contextlib.contextmanager
    def request(self, name: str) -> Iterator[None]:
        """Count one request in flight on replica `name` while the block runs."""
        self._in_flight[name] += 1
        try:
            yield
        finally:
            self._in_flight[name] -= 1
