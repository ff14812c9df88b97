"""Bodies and routes of the agent's own control plane: identity, health, lease, shutdown, free port.

Pydantic models, JSON on the wire: nothing received from the network is unpickled, every body is
validated against these models. Each service declares its own routes and bodies in its own
protocol module (`rollouts.protocol`, `preflight.protocol`, `trainer.protocol`, ...).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from art_mega.agent.auth import AgentIdentity
from art_mega.agent.routes import Route

READY_PREFIX = "ART_MEGA_READY "
"""An agent prints this prefix and a JSON object on stdout once it listens."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChildStatus(_Body):
    """One supervised child process of an agent."""

    child_id: str
    role: str
    pid: int
    returncode: int | None = None
    log_path: str | None = None


class HealthResponse(_Body):
    """What an agent says about itself; `pid` and `launch_id` prove which process answers."""

    launch_id: str
    pid: int
    hostname: str
    address: str
    boot_id: str
    python: str
    art_mega_version: str
    started_at: float
    children: tuple[ChildStatus, ...] = ()
    controller_lease_s: float | None = None
    """Seconds this agent waits for its controller before it stops its children and exits."""


class ShutdownResponse(_Body):
    stopped: tuple[ChildStatus, ...] = ()


class LeaseRequest(_Body):
    """The controller's heartbeat (`hold`) or its release of the agent (`hold=False`, at its end)."""

    hold: bool = True


class FreePortRequest(_Body):
    host: str


class FreePortResponse(_Body):
    port: int


HEALTH = Route("GET", "/health", None, HealthResponse)
IDENTITY = Route("GET", "/identity", None, AgentIdentity)
"""Whom to sign for (the one route a request signed for no agent may call, see `auth`)."""
LEASE = Route("POST", "/lease", LeaseRequest, HealthResponse)
SHUTDOWN = Route("POST", "/shutdown", None, ShutdownResponse)
FREE_PORT = Route("POST", "/free-port", FreePortRequest, FreePortResponse)
