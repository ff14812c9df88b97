"""Managed vLLM replicas: start and stop through the host agents, adapter publication per step,
and policy-versioned routing (`<model>@<step>`). Nothing here imports vLLM or torch.
"""

from art_mega.inference.adapters import AdapterPublisher, PublishReport
from art_mega.inference.protocol import ReplicaLaunch, lora_rank_slot
from art_mega.inference.recovery import RecoveryEvent, ReplicaRecovery
from art_mega.inference.remote import check_serving_mode, start_replicas, stop_replicas
from art_mega.inference.router import PolicyRouter, ReplicaEndpoint, Route, inference_name
from art_mega.inference.server_api import ReplicaClient

__all__ = [
    "AdapterPublisher",
    "PolicyRouter",
    "PublishReport",
    "RecoveryEvent",
    "ReplicaClient",
    "ReplicaEndpoint",
    "ReplicaLaunch",
    "ReplicaRecovery",
    "Route",
    "check_serving_mode",
    "inference_name",
    "lora_rank_slot",
    "start_replicas",
    "stop_replicas",
]
