"""The quickstart's output, written to a file, reads as issue 34 asks: the run folder at start and
end, one summary line per step, progress over the real steps only (no bar, no remaining-time
estimate past them).

The quickstart (`scripts/quickstart.sh`) installs, converts SmolLM2 and then execs one command,
`art-mega local --program examples/multinode/train.py:main`, which takes ~9 minutes for its 6
steps. This test runs that same command, read from the script, on the program's own knobs
(ART_MEGA_STEPS=3, ART_MEGA_GROUP_SIZE=2, ART_MEGA_BASE_MODEL=tiny-llama: the program is not
changed, only sized down), with standard output and error redirected to a file as
`bash scripts/quickstart.sh > run.log 2>&1` would: about 2 minutes on 2 cores.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require_vllm

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
"""3 steps of 4 questions are one epoch of the 12 training questions: the program's planned
steps (`iterate_dataset`'s total) equal the steps it runs."""


def quickstart_command() -> list[str]:
    """The command the quickstart's last line execs, as argv for this interpreter."""
    last = [line for line in (REPO / "scripts" / "quickstart.sh").read_text().splitlines() if line.strip()][-1]
    argv = shlex.split(last)
    assert argv[:2] == ["exec", ".venv/bin/art-mega"], last
    return [sys.executable, "-m", "art_mega", *argv[2:]]


@pytest.mark.timeout(900)
def test_quickstart_output_in_a_file(tmp_path):
    pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")
    require_vllm()
    argv = quickstart_command()
    assert argv[3:] == ["local", "--program", "examples/multinode/train.py:main"]
    argv[-1] = f"{REPO}/examples/multinode/train.py:main"
    env = {
        **os.environ,
        "ART_MEGA_STEPS": str(STEPS),
        "ART_MEGA_GROUP_SIZE": "2",
        "ART_MEGA_BASE_MODEL": "tiny-llama",
        "ART_MEGA_CACHE": str(Path.home() / ".cache" / "art-mega"),
        "PYTHONPATH": str(REPO),
    }
    env.pop("WANDB_API_KEY", None)
    env.pop("ART_MEGA_PROGRESS", None)
    log = tmp_path / "run.log"
    with log.open("w") as out:
        proc = subprocess.run(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=850)
    text = log.read_text()
    print(text[-4000:])
    assert proc.returncode == 0, text[-3000:]
    assert "ART_MEGA_TRAIN_DONE" in text

    run = (tmp_path / ".art" / "art-mega-quickstart" / "models" / "yes-no").resolve()
    folders = re.findall(r"^art-mega: run folder (\S+)$", text, re.M)
    assert len(folders) == 2 and {Path(f).resolve() for f in folders} == {run}, folders  # start and end
    assert text.index(f"art-mega: run folder {folders[0]}") < text.index("art-mega: step 0/")

    # step k/N, reward, loss (none on a step whose groups all had equal rewards: nothing trained),
    # trained tokens, rollout time and the step's wall time
    summary = r"^art-mega: step (\d+)/(\d+), reward (\S+)(?:, loss \S+)?, trained tokens (\d+), .*step ([0-9.]+) s$"
    summaries = re.findall(summary, text, re.M)
    assert [(int(k), int(n)) for k, n, *_ in summaries] == [(k, STEPS) for k in range(STEPS)], summaries
    for _, _, reward, _, seconds in summaries:
        assert 0.0 <= float(reward) <= 1.0 and float(seconds) > 0
    assert len(re.findall(r"^art-mega: step ", text, re.M)) == STEPS  # one line a step, no more
    # no bar and no estimate past the real steps: no carriage return, no bar glyphs, no tqdm ETA
    assert "\r" not in text and "━" not in text and "█" not in text
    assert not re.search(r"<\d+:\d\d", text), "a remaining-time estimate"
    # every "k/N" a line shows about steps names N = the steps run, never the dataset's epochs
    for k, n in re.findall(r"\bstep (\d+)/(\d+)\b", text):
        assert int(n) == STEPS and int(k) < STEPS, (k, n)
    assert (run / "checkpoints" / "LATEST").read_text().strip() == str(STEPS)
