"""Which interpreter the backend runs its replicas under, when the topology has several
InferenceSpecs (each may name its own `python`)."""

from __future__ import annotations

import pytest

from art_mega.backend import replica_python
from art_mega.errors import UserError
from art_mega.topology import InferenceSpec, compile_topology
from tests.helpers import loopback_cluster

BIG = "/opt/vllm-big/bin/python"
SMALL = "/opt/vllm-small/bin/python"


def topology(*inference: InferenceSpec):
    return compile_topology(loopback_cluster(2, cpu_slots=2), inference=inference)


def two_specs(big: str | None, small: str | None):
    return topology(
        InferenceSpec(name="big", replicas=1, host_ids=("host0",), python=big),
        InferenceSpec(name="small", replicas=1, host_ids=("host1",), python=small, api_port=8100),
    )


def test_each_spec_python_or_the_backend_fallback() -> None:
    assert replica_python(two_specs(BIG, BIG), None) == BIG
    assert replica_python(two_specs(None, None), SMALL) == SMALL
    # a spec without python runs under the backend's interpreter; both agree here
    assert replica_python(two_specs(BIG, None), BIG) == BIG
    assert replica_python(topology(InferenceSpec(python=SMALL)), BIG) == SMALL


@pytest.mark.parametrize(
    ("big", "small", "fallback"),
    [(BIG, SMALL, None), (BIG, None, SMALL), (None, SMALL, BIG)],
)
def test_second_spec_with_another_python_is_refused(big, small, fallback) -> None:
    # before: every replica ran under the first spec's python, the second spec's was ignored
    with pytest.raises(UserError) as info:
        replica_python(two_specs(big, small), fallback)
    message = str(info.value)
    assert message.startswith("InferenceSpec 'big' runs vLLM under ")
    assert f"InferenceSpec 'small' under {(small or fallback)!r}" in message
    assert message.endswith("give the specs the same python") and "\n" not in message
