"""`art_mega.torch_extensions.hide_mismatched` on fake installs (a folder of packages and their
dist-info, the only entry of a fresh interpreter's path): a CUDA torchvision beside a `+cpu` torch
is hidden so that importing it fails as if absent, a `+cpu` one is kept, and nothing is hidden
beside a CUDA torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[3] / "art_mega" / "torch_extensions.py"
PROBE = f"""
import importlib.util, runpy, sys
hidden = runpy.run_path({str(SOURCE)!r})["hide_mismatched"]()
print(",".join(hidden))
print(",".join(n for n in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(n) is not None))
try:
    import torchvision
    print("imported")
except ImportError:
    print("absent")
"""


def _install(site: Path, name: str, version: str, body: str = "") -> None:
    (site / name).mkdir()
    (site / name / "__init__.py").write_text(body)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _probe(site: Path) -> list[str]:
    code = (
        f"import sys; sys.path[:] = [{str(site)!r}] + [p for p in sys.path if 'site-packages' not in p]\n"
        + PROBE
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize(
    ("torch", "vision", "audio", "hidden", "left", "imported"),
    [
        ("2.13.0+cpu", "0.28.0", "2.11.1+cpu", "torchvision", "torchaudio", "absent"),
        ("2.13.0+cpu", "0.28.0+cpu", "2.11.1", "torchaudio", "torchvision", "imported"),
        ("2.13.0", "0.28.0", "2.11.1", "", "torchvision,torchaudio", "imported"),
    ],
)
def test_hides_only_a_cuda_build_beside_a_cpu_torch(tmp_path, torch, vision, audio, hidden, left, imported):
    _install(tmp_path, "torch", torch)
    # the CUDA build's import error, as PyPI's torchvision raises it beside a CPU torch
    _install(
        tmp_path,
        "torchvision",
        vision,
        ""
        if "+cpu" in vision or "+cpu" not in torch
        else "raise RuntimeError('operator torchvision::nms does not exist')",
    )
    _install(tmp_path, "torchaudio", audio)
    assert _probe(tmp_path) == [hidden, left, imported]
