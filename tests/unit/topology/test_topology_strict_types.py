"""Integer, bool and float fields of the topology specs take their own type only: pydantic's lax
mode read True as 1, "2" as 2 and "no" as False; now each is refused in one sentence naming the
field, the value and the fix."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from art_mega.errors import format_validation_error
from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, InferenceSpec, TrainerSpec

HOST = {"host_id": "h0", "node_rank": 0, "worker_address": "tcp://10.0.0.1:22222"}


def cluster(host: dict[str, Any] | None = None, **overrides: Any) -> ClusterSpec:
    fields = {
        "hosts": [HOST | (host or {})],
        "controller_host_id": "h0",
        "artifact_root": "/shared/art",
        "cache_root": "/var/cache/art",
    }
    return ClusterSpec(**(fields | overrides))


def refusal(build, model: str, **fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        build(**fields)
    message = format_validation_error(info.value, model)
    assert "\n" not in message and message.endswith(".")
    return message


@pytest.mark.parametrize(
    ("value", "kind"), [(True, "a bool"), ("2", "a string"), (2.0, "a float"), (2.5, "a float")]
)
def test_integer_fields_refuse_other_types(value: Any, kind: str) -> None:
    assert refusal(cluster, "ClusterSpec", host={"cpu_slots": value}) == (
        f"ClusterSpec.hosts[0].cpu_slots: cpu_slots {value!r} must be an integer, not {kind}; "
        "write it as a whole number without quotes."
    )
    assert refusal(cluster, "ClusterSpec", host={"node_rank": value}).startswith(
        f"ClusterSpec.hosts[0].node_rank: node_rank {value!r} must be an integer"
    )
    for field in ("tp", "cp", "ep", "etp", "pp", "cpu_ranks_per_host"):
        assert refusal(TrainerSpec, "TrainerSpec", **{field: value}).startswith(
            f"TrainerSpec.{field}: {field} {value!r} must be an integer"
        )
    for field in ("replicas", "tp", "pp", "dp", "api_port"):
        assert refusal(InferenceSpec, "InferenceSpec", **{field: value}).startswith(
            f"InferenceSpec.{field}: {field} {value!r} must be an integer"
        )
    assert refusal(TrainerSpec, "TrainerSpec", master_port=value).startswith(
        f"TrainerSpec.master_port: master_port {value!r} must be an integer"
    )
    assert refusal(EndpointSpec, "EndpointSpec", host="10.0.0.1", port=value).startswith(
        f"EndpointSpec.port: port {value!r} must be an integer"
    )


@pytest.mark.parametrize(
    ("value", "kind"), [("no", "a string"), ("true", "a string"), (0, "an int"), (1, "an int")]
)
def test_bool_fields_refuse_other_types(value: Any, kind: str) -> None:
    for field in ("shared_artifact_root", "allow_shared_kernel"):
        assert refusal(cluster, "ClusterSpec", **{field: value}) == (
            f"ClusterSpec.{field}: {field} {value!r} must be True or False, not {kind}."
        )
    assert refusal(InferenceSpec, "InferenceSpec", shared_gpus=value) == (
        f"InferenceSpec.shared_gpus: shared_gpus {value!r} must be True or False, not {kind}."
    )


@pytest.mark.parametrize(("value", "kind"), [(True, "a bool"), ("60", "a string"), (None, "None")])
def test_float_fields_refuse_other_types(value: Any, kind: str) -> None:
    for field in ("startup_timeout_s", "rpc_timeout_s"):
        assert refusal(cluster, "ClusterSpec", **{field: value}) == (
            f"ClusterSpec.{field}: {field} {value!r} must be a number, not {kind}; write it without quotes."
        )


def test_legitimate_inputs_still_accepted() -> None:
    spec = cluster(
        {"cpu_slots": np.int64(3), "node_rank": np.int32(0), "gpu_ids": [0, 1]},
        shared_artifact_root=np.bool_(False),
        allow_shared_kernel=True,
        startup_timeout_s=5,
        rpc_timeout_s=np.float64(2.5),
    )
    first = spec.hosts[0]
    assert first.cpu_slots == 3 and type(first.cpu_slots) is int and first.gpu_ids == (0, 1)
    assert spec.shared_artifact_root is False and spec.allow_shared_kernel is True
    assert spec.startup_timeout_s == 5.0 and spec.rpc_timeout_s == 2.5
    assert TrainerSpec(tp=np.int64(2), host_ids=["h0"]).tp == 2
    assert InferenceSpec(replicas=2, gpu_ids=(0, "1"), shared_gpus=True).gpu_ids == (0, 1)
    assert (
        HostSpec.model_validate_json(
            '{"host_id": "h1", "node_rank": 1, "worker_address": {"host": "10.0.0.2", "port": 22222}, "cpu_slots": 2}'
        ).cpu_slots
        == 2
    )
    # a spec sent over the wire comes back equal
    assert ClusterSpec.model_validate_json(spec.model_dump_json()) == spec
