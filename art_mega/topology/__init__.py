"""Typed, frozen specs of a launch (hosts, trainer, inference) and `compile_topology`.

Pure data and validation: no I/O and nothing heavy imported; the runtime executes the result.
"""

from art_mega.topology.cluster import ClusterSpec, HostSpec
from art_mega.topology.compile import compile_topology
from art_mega.topology.compiled import CompiledTopology, ProcessSpec, ReplicaSpec, TrainerRank
from art_mega.topology.endpoint import EndpointSpec
from art_mega.topology.groups import ParallelGroups, parallel_groups, rank_coordinates
from art_mega.topology.inference import InferenceSpec
from art_mega.topology.trainer import TrainerSpec
from art_mega.topology.transport import NcclTransportSpec, NixlTransportSpec

__all__ = [
    "ClusterSpec",
    "CompiledTopology",
    "EndpointSpec",
    "HostSpec",
    "InferenceSpec",
    "NcclTransportSpec",
    "NixlTransportSpec",
    "ParallelGroups",
    "ProcessSpec",
    "ReplicaSpec",
    "TrainerRank",
    "TrainerSpec",
    "compile_topology",
    "parallel_groups",
    "rank_coordinates",
]
