"""An agent's lease on its controller: no agent outlives a controller it can no longer hear.

The controller's first heartbeat (`POST /v1/lease`) arms the lease; from then on every signed
request renews it. An agent whose armed lease runs out (its controller was killed, or its host
was cut off without a FIN reaching anyone) stops its children and exits, freeing its port. A
controller that ends normally releases the lease (`hold=False`): the agent waits for the next
controller, as an agent nobody has claimed yet does.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Mapping

from art_mega.errors import UserError

LEASE_ENV = "ART_MEGA_CONTROLLER_LEASE"
DEFAULT_CONTROLLER_LEASE_S = 20.0
"""Seconds without a word from the controller before an agent stops its children and exits."""
MIN_CONTROLLER_LEASE_S = 1.0
"""The shortest lease: the controller beats a quarter lease apart (at most every 0.5 s), so a
shorter one (1e-300 is > 0) turns the heartbeat into a busy loop and expires on any pause."""
_SECONDS = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""A non-negative decimal number in ASCII digits (`float()` alone also takes '٣', 'inf', 'nan')."""


def parse_controller_lease(
    value: float | str | None, env: Mapping[str, str] | None = None, option: str = "--controller-lease"
) -> float:
    """The lease in seconds: `value` when given, else `$ART_MEGA_CONTROLLER_LEASE`, else 20.

    An empty variable counts as unset (the Unix convention); anything else, like `value`, must be
    a number of seconds in ASCII digits without surrounding spaces (as every other option and
    ART_MEGA_* variable), from MIN_CONTROLLER_LEASE_S (1) up.

    Raises:
        UserError: the chosen value is not a finite number of seconds >= 1 (one sentence naming
            the option or variable, the value and the fix).
    """
    env = os.environ if env is None else env
    if value is None and env.get(LEASE_ENV, ""):
        value, option = env[LEASE_ENV], LEASE_ENV
    if value is None:
        return DEFAULT_CONTROLLER_LEASE_S
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        seconds = float(value) if isinstance(value, str) and _SECONDS.fullmatch(value) else math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UserError(
            f"{option} {value!r} is not a finite positive number of seconds written in ASCII digits; "
            f"give e.g. {DEFAULT_CONTROLLER_LEASE_S:g} (the default)"
        )
    if seconds < MIN_CONTROLLER_LEASE_S:
        raise UserError(
            f"{option} {value!r} is under {MIN_CONTROLLER_LEASE_S:g} s, shorter than the controller's "
            f"heartbeats can hold; give e.g. {DEFAULT_CONTROLLER_LEASE_S:g} (the default)"
        )
    return seconds


class ControllerLease:
    """The agent's side of the lease: armed by a heartbeat, renewed by every signed request.

    Times are `time.monotonic()` seconds; `lease_s` is the bound in seconds.
    """

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._last_heard: float | None = None
        self.expired = False

    @property
    def armed(self) -> bool:
        return self._last_heard is not None

    def hold(self) -> None:
        """A controller heartbeat: arm the lease (if it was not) and renew it."""
        self._last_heard = time.monotonic()

    def renew(self) -> None:
        """A signed request: renew the lease if a controller holds it."""
        if self._last_heard is not None:
            self._last_heard = time.monotonic()

    def release(self) -> None:
        """The controller ended normally: no controller holds this agent until the next heartbeat."""
        self._last_heard = None

    def silent_s(self) -> float:
        """Seconds since the controller was last heard from (0 while no controller holds the lease)."""
        return 0.0 if self._last_heard is None else time.monotonic() - self._last_heard

    async def wait_expired(self) -> None:
        """Return once an armed lease has gone `lease_s` seconds unrenewed; sets `expired`.

        Only time this agent's own event loop could run counts: after a stall (the host
        overloaded, the agent stopped and continued) heartbeats that arrived meanwhile wait
        unread in its sockets, so the stall beyond one check interval is excused, not taken
        for the controller's silence.
        """
        step = min(0.25, self.lease_s / 8)
        due = time.monotonic() + step
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            self._excuse(now - due - step)
            if self.silent_s() >= self.lease_s:
                break
            due = now + step
        self.expired = True

    def _excuse(self, seconds: float) -> None:
        """Take `seconds` (ignored unless positive) in which this agent could not listen out of
        the controller's silence (never beyond now)."""
        if self._last_heard is not None and seconds > 0:
            self._last_heard = min(time.monotonic(), self._last_heard + seconds)
