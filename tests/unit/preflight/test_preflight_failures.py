"""How the controller names a preflight rank whose probe ended without a result.

A warm probe can die before its config arrives (OOM killer, an operator's kill): the agent then
returns its exit status and no result, and the other ranks, waiting at the rendezvous, report
that rank missing once `timeout_s` has passed. The error must say why it never arrived.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from art_mega.errors import AgentError, PreflightError
from art_mega.preflight.collective import _raise_for_failures, environment_label, failed_on_its_own
from art_mega.preflight.probe import WARM_FLAG
from art_mega.preflight.protocol import PREFLIGHT_RUN, PreflightRunResponse

AGENTS = "the trainer environment (each agent's Python)"


@pytest.fixture(scope="module")
def killed_probe() -> PreflightRunResponse:
    """What the agent returns for a warm probe SIGKILLed before its config came."""
    probe = subprocess.Popen(
        [sys.executable, "-m", "art_mega.preflight.probe", WARM_FLAG],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    probe.send_signal(signal.SIGKILL)
    out, err = probe.communicate(timeout=60)
    assert out == b""
    return PreflightRunResponse(exit_code=probe.returncode, result=None, stderr_tail=err.decode()[-1500:])


def test_a_killed_probe_is_named_with_its_signal(killed_probe):
    with pytest.raises(PreflightError) as raised:
        _raise_for_failures({"h0": killed_probe}, ["h0"], 8.0)
    assert str(raised.value) == (
        f"preflight collective in {AGENTS} failed on host h0 (rank 0): the probe was killed by SIGKILL "
        "without a result"
    )


def test_the_rank_the_others_missed_says_why_it_never_arrived(killed_probe):
    waited = PreflightRunResponse(
        exit_code=0,
        result={"ok": False, "rank": 0, "host": "h0", "missing_ranks": [1], "error": "rendezvous timed out"},
    )
    with pytest.raises(PreflightError) as raised:
        _raise_for_failures({"h0": waited, "h1": killed_probe}, ["h0", "h1"], 8.0)
    assert str(raised.value) == (
        f"preflight collective in {AGENTS}: host h1 (rank 1) did not arrive within 8 s; every probe "
        "was stopped (host h1 (rank 1): the probe was killed by SIGKILL without a result)"
    )


def test_a_probe_that_exited_quietly_and_one_that_wrote_a_traceback():
    quiet = PreflightRunResponse(exit_code=0, result=None)  # a warm probe that saw EOF first
    crashed = PreflightRunResponse(
        exit_code=1,
        result=None,
        stderr_tail="Traceback (most recent call last):\n  ...\nImportError: no torch\n",
    )
    with pytest.raises(PreflightError) as raised:
        _raise_for_failures({"a": quiet, "b": crashed}, ["a", "b"], 8.0)
    assert str(raised.value) == (
        f"preflight collective in {AGENTS} failed on host a (rank 0): the probe exited with code 0 "
        "without a result; host b (rank 1): the probe exited with code 1 without a result; its stderr "
        "ends: ImportError: no torch"
    )


def test_which_replies_end_the_collective_at_once(killed_probe):
    """A rank that failed on its own stops the others; the timeouts every rank sees alike do not."""
    failed = PreflightRunResponse(exit_code=1, result={"ok": False, "error": "RuntimeError: bad"})
    waited = PreflightRunResponse(exit_code=1, result={"ok": False, "missing_ranks": [1]})
    watchdog = PreflightRunResponse(
        exit_code=1, result={"ok": False, "timed_out": True, "phase": "collectives"}
    )
    unreached = PreflightRunResponse(exit_code=1, result={"ok": False, "phase": "start", "error": "no store"})
    ok = PreflightRunResponse(exit_code=0, result={"ok": True})
    assert [failed_on_its_own(r) for r in (failed, killed_probe, AgentError("h", "a", "down"))] == [True] * 3
    assert [failed_on_its_own(r) for r in (waited, watchdog, unreached, ok)] == [False] * 4
    assert not failed_on_its_own(PreflightRunResponse(exit_code=None, timed_out=True))


def test_a_rank_that_failed_first_is_named_and_the_stopped_ones_are_not():
    failed = PreflightRunResponse(
        exit_code=1, result={"ok": False, "error": "cannot import torch.distributed (ImportError: x)"}
    )
    with pytest.raises(PreflightError) as raised:
        _raise_for_failures(
            {"h0": failed}, ["h0", "h1"], 60.0, stopped={"h1"}, label=environment_label("vllm", "/v/python")
        )
    assert str(raised.value) == (
        "preflight collective in the vllm environment (/v/python) failed on host h0 (rank 0): cannot import "
        "torch.distributed (ImportError: x); the other ranks' probes were stopped"
    )


class _Answers:
    """An agent client that answers the collective's two calls with a canned reply: hosts with
    two torch builds cannot be made on one machine, so the replies stand for them."""

    def __init__(self, host: str, rank: int, members: list[dict]) -> None:
        self.host, self.rank, self.members = host, rank, members

    async def free_port(self, host: str) -> int:
        return 29500

    async def call(self, route, body=None, *, timeout_s=...) -> PreflightRunResponse:
        assert route is PREFLIGHT_RUN, route
        return PreflightRunResponse(
            exit_code=0,
            result={"ok": True, "rank": self.rank, "host": self.host, "members": self.members},
        )


async def test_ranks_with_different_torch_versions_are_named_with_their_hosts():
    from art_mega.preflight.collective import run_collective

    members = [
        {"host": "h0", "rank": 0, "backend": "gloo", "torch": "2.13.0+cpu"},
        {"host": "h1", "rank": 1, "backend": "gloo", "torch": "2.12.1+cpu"},
    ]
    clients = {h: _Answers(h, r, members) for r, h in enumerate(("h0", "h1"))}
    with pytest.raises(PreflightError) as raised:
        await run_collective(clients, ["h0", "h1"], "10.0.0.1", 30.0, python="/v/python", environment="vllm")
    assert str(raised.value) == (
        "preflight collective in the vllm environment (/v/python): the ranks' torch versions differ (host h0 "
        "has torch 2.13.0+cpu, host h1 has torch 2.12.1+cpu); install one torch version in that environment "
        "on every host"
    )


def test_what_the_waiting_ranks_saw_does_not_blame_them():
    """Rank 2 never reached rank 0's store; when rank 0 gave up, rank 1 lost the store under it."""
    waited = PreflightRunResponse(
        exit_code=1,
        result={"ok": False, "phase": "rendezvous", "timed_out": True, "missing_ranks": [2], "error": "x"},
    )
    store_gone = PreflightRunResponse(
        exit_code=1,
        result={
            "ok": False,
            "phase": "rendezvous",
            "timed_out": True,
            "error": "the rendezvous store went away",
        },
    )
    unreached = PreflightRunResponse(exit_code=1, result={"ok": False, "phase": "start", "error": "no store"})
    assert not failed_on_its_own(store_gone)
    with pytest.raises(PreflightError) as raised:
        _raise_for_failures({"h0": waited, "h1": store_gone, "h2": unreached}, ["h0", "h1", "h2"], 8.0)
    assert str(raised.value) == (
        f"preflight collective in {AGENTS}: host h2 (rank 2) did not arrive within 8 s; every probe was stopped"
    )
