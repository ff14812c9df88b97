"""The preflight collective in a replica's own Python environment (`InferenceSpec.python`).

Two loopback hosts, one replica each: the cluster proof runs the collective under the replicas'
interpreter on both before anything is allocated. An interpreter whose torch cannot be imported is
named with its hosts; the real vLLM environment passes, is named in the report, and is not proved
a second time while nothing changed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from art_mega import ArtRuntime, InferenceSpec, compile_topology
from art_mega.errors import PreflightError
from tests.conftest import REPO
from tests.helpers import loopback_cluster

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def replicas_on_two_hosts(python: str, tmp: Path):
    cluster = loopback_cluster(2, tmp=str(tmp), startup_timeout_s=60)
    return compile_topology(cluster, inference=InferenceSpec(replicas=2, python=python))


def broken_torch_interpreter(tmp: Path) -> Path:
    """An interpreter (a wrapper script) whose environment's torch has no torch.distributed."""
    shadow = tmp / "site" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        'raise ImportError("this torch was built without torch.distributed")\n'
    )
    wrapper = tmp / "bin" / "python"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={shadow.parent} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


async def test_a_replica_interpreter_without_torch_distributed_is_named_before_any_replica(tmp_path):
    python = broken_torch_interpreter(tmp_path)
    with pytest.raises(PreflightError) as raised:
        await ArtRuntime.start_local(replicas_on_two_hosts(str(python), tmp_path))
    error = str(raised.value)
    assert error.startswith(f"preflight collective in the vllm environment ({python}) failed on host host")
    assert (
        "cannot import torch.distributed (ImportError: this torch was built without torch.distributed)"
        in error
    )
    assert "Traceback" not in error and "did not arrive" not in error


async def test_a_replica_interpreter_that_does_not_exist_is_named(tmp_path):
    python = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(PreflightError) as raised:
        await ArtRuntime.start_local(replicas_on_two_hosts(str(python), tmp_path))
    error = str(raised.value)  # both hosts, or the first and "the other ranks' probes were stopped"
    assert error.startswith(f"preflight collective in the vllm environment ({python}) failed on host host")
    assert f": cannot run the interpreter {python}: No such file or directory" in error


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is not installed (ART_MEGA_WITH_VLLM=1)")
async def test_the_vllm_environment_is_proved_named_and_not_proved_twice(tmp_path):
    runtime = await ArtRuntime.start_local(replicas_on_two_hosts(str(VLLM_PYTHON), tmp_path))
    try:
        (report,) = runtime.preflight.collectives
        assert (report.environment, report.python, report.host_ids) == (
            "vllm",
            str(VLLM_PYTHON),
            ("host0", "host1"),
        )
        assert [(m["host"], m["rank"], m["backend"]) for m in report.members] == [
            ("host0", 0, "gloo"),
            ("host1", 1, "gloo"),
        ]
        import torch

        # .venv-vllm pins the same torch build as the trainer's environment
        assert {m["torch"] for m in report.members} == {torch.__version__}
        again = await runtime.prove()
        assert again.collectives == (report,) and again.phases_s["collective"] == 0.0  # cached
    finally:
        await runtime.close()
