"""`art-mega slurm` under a real Slurm (Debian's slurmctld, slurmd, munged): a controller and three
nodes in network namespaces (`slurm_cluster.SlurmCluster`), jobs submitted with sbatch running
examples/multinode/slurm.sbatch as a user would."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.integration.conftest import require_netns
from tests.integration.slurm_cluster import SlurmCluster, slurm_unavailable_reason

pytestmark = pytest.mark.root
SBATCH = str(REPO / "examples" / "multinode" / "slurm.sbatch")
HOLD = "tests/integration/programs/prog_hold_workers.py:main"
LEASE_S = 20.0  # the agents' default --controller-lease


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    require_netns()
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(3) as cluster:
        yield cluster


def _env(**extra: str) -> dict[str, str]:
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def _submit(
    slurm: SlurmCluster, tmp_path: Path, *args: str, chdir: Path = REPO, **env: str
) -> tuple[str, Path]:
    out = tmp_path / "job-%j.out"
    result = slurm.client(
        ["sbatch", "--parsable", "-N", "3", f"--output={out}", f"--chdir={chdir}", *args, SBATCH],
        env=_env(**env),
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip().split(";")[0]
    return job, tmp_path / f"job-{job}.out"


def _art_mega_processes(slurm: SlurmCluster) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for host in slurm.nodes:
        for pid in host.pids():
            try:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            if "art_mega" in cmdline or "art-mega" in cmdline:
                found.setdefault(slurm.node_name(host), []).append(f"{pid}: {cmdline[:120]}")
    return found


def test_sbatch_runs_smoke_across_three_nodes(slurm, tmp_path):
    job, out = _submit(slurm, tmp_path)
    state = slurm.wait_job(job, 120)
    text = out.read_text(errors="replace") if out.exists() else "(no output)"
    assert state == "COMPLETED", f"{state}\n{text[-4000:]}"
    assert "ART_MULTINODE_SMOKE_PASS hosts=3" in text, text[-4000:]
    assert f"art-mega slurm: job {job}, 3 nodes (n1 is the controller)" in text
    assert _art_mega_processes(slurm) == {}


def test_scancel_mid_run_leaves_no_process_on_any_node(slurm, tmp_path):
    job, out = _submit(slurm, tmp_path, ART_MEGA_PROGRAM=HOLD, ART_MEGA_PORT="22300")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (out.exists() and "PIDS " in out.read_text(errors="replace")):
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), out.read_text(errors="replace")
        time.sleep(0.2)
    text = out.read_text(errors="replace")
    assert "PIDS " in text, text[-3000:]
    running = _art_mega_processes(slurm)
    assert sorted(running) == ["n1", "n2", "n3"], running  # agents and workers on every node
    cancelled = time.monotonic()
    assert slurm.client(["scancel", job], timeout=15).returncode == 0
    left = running
    while left and time.monotonic() - cancelled < LEASE_S:
        time.sleep(0.1)
        left = _art_mega_processes(slurm)
    gone_after = time.monotonic() - cancelled
    assert left == {}, f"after {gone_after:.1f} s: {left}"
    print(f"scancel: every art-mega process on 3 nodes gone {gone_after:.1f} s after scancel")
    assert slurm.wait_job(job, 30) == "CANCELLED"


def test_bad_nodelist_is_one_sentence(slurm, tmp_path):
    script = tmp_path / "bad.sbatch"
    script.write_text(
        "#!/bin/bash\nexport ART_MEGA_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')\n"
        "srun --ntasks-per-node=1 env 'SLURM_JOB_NODELIST=n[3-1]' .venv/bin/art-mega slurm "
        "--program examples/multinode/program.py:main\necho exit=$?\n"
    )
    out = tmp_path / "bad.out"
    result = slurm.client(
        ["sbatch", "--parsable", "-N", "1", f"--output={out}", f"--chdir={REPO}", str(script)],
        env=_env(),
        timeout=30,
    )
    job = result.stdout.strip().split(";")[0]
    slurm.wait_job(job, 60)
    text = out.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith("art-mega: error: ")]
    assert errors == [
        "art-mega: error: SLURM_JOB_NODELIST='n[3-1]' is not a Slurm hostlist (the range '3-1' in [3-1] runs "
        "backwards); Slurm sets it: do not override it"
    ], text
    assert "Traceback" not in text
    assert re.search(r"^exit=2$", text, re.M), text


def test_sbatch_runs_grpo_across_three_nodes(slurm, tmp_path):
    """The main job's GRPO program (tiny Llama; one trainer rank per node, DP=3 over gloo; one vLLM
    replica on node 0) runs one step to completion from the same sbatch file."""
    pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")
    from art_mega.backend import default_vllm_python
    from art_mega.errors import UserError

    try:
        vllm_python = default_vllm_python()
    except UserError as exc:
        pytest.skip(str(exc))
    job, out = _submit(
        slurm,
        tmp_path,
        chdir=tmp_path,  # the run folder ./.art goes there
        ART_MEGA=str(REPO / ".venv" / "bin" / "art-mega"),
        ART_MEGA_PROGRAM=f"{REPO}/examples/multinode/train.py:main",
        ART_MEGA_PORT="22400",
        ART_MEGA_STEPS="1",
        ART_MEGA_GROUP_SIZE="4",
        ART_MEGA_BASE_MODEL="tiny-llama",
        ART_MEGA_VLLM_PYTHON=vllm_python,
        ART_MEGA_CACHE=str(tmp_path / "cache"),
    )
    state = slurm.wait_job(job, 900)
    text = out.read_text(errors="replace") if out.exists() else "(no output)"
    assert state == "COMPLETED", f"{state}\n{text[-4000:]}"
    assert "ART_MEGA_TRAIN_DONE" in text, text[-4000:]
    assert re.search(
        r"^art-mega: step 0/\d+, reward \d\.\d{3}, loss \S+, trained tokens [1-9]\d*, ", text, re.M
    )
    assert _art_mega_processes(slurm) == {}
