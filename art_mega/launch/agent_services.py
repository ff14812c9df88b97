"""The services an `art-mega agent` process serves: each one's `register(router, supervisor)`.

The agent (`agent.app`) imports no service; its entry point passes this list. Services register
in this order, and at the agent's close stop what they hold in the same order.
"""

from __future__ import annotations

from art_mega.agent.app import Service
from art_mega.inference import routes as inference_routes
from art_mega.preflight import routes as preflight_routes
from art_mega.rollouts import routes as rollout_routes
from art_mega.trainer import routes as trainer_routes
from art_mega.transfer import files as artifact_files
from art_mega.transfer import routes as adapter_routes

AGENT_SERVICES: tuple[Service, ...] = (
    rollout_routes.register,
    preflight_routes.register,
    inference_routes.register,
    adapter_routes.register,
    artifact_files.register,
    trainer_routes.register,
)
