"""Parallel state from the rank table: what a one-rank CPU world reports, and what is refused."""

from __future__ import annotations

import pytest

from art_mega.errors import TopologyError
from art_mega.topology.compiled import TrainerRank
from art_mega.topology.groups import rank_coordinates
from art_mega.topology.trainer import TrainerSpec
from art_mega.trainer.rank.cpu_compat import PATCHES, applied_patches
from art_mega.trainer.rank.parallel import init_parallel
from tests.trainer.common import require_trainer_deps
from tests.unit.topology.test_topology_compile import PP_REFUSED

require_trainer_deps()


def test_cpu_world_of_one(megatron_world) -> None:
    state = megatron_world
    assert (state.device, state.backend, state.world_size) == ("cpu", "gloo", 1)
    assert (state.tp, state.dp, state.tp_rank, state.dp_rank) == (1, 1, 0, 0)
    assert applied_patches() == tuple(PATCHES)


@pytest.mark.parametrize(("spec", "message"), [(TrainerSpec(pp=2, cp=2), PP_REFUSED)])
def test_unsupported_sizes_are_refused_before_joining(spec: TrainerSpec, message: str) -> None:
    rank = TrainerRank(
        rank=0, host_id="local", local_rank=0, **rank_coordinates(0, 4, pp=spec.pp, cp=spec.cp, etp=spec.etp)
    )
    with pytest.raises(TopologyError) as caught:
        init_parallel(rank, spec, 4, master_addr="127.0.0.1", master_port=1)
    assert str(caught.value) == message
