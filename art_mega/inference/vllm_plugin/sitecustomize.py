"""Run at every start of a replica's interpreters (this folder is first on their PYTHONPATH):
hide a torchvision/torchaudio/torchcodec that does not match the installed CPU torch, before vLLM imports
them (`art_mega/torch_extensions.py`, read by path: this interpreter may not have art_mega)."""

import runpy
from pathlib import Path

_source = Path(__file__).resolve().parents[2] / "torch_extensions.py"
if _source.is_file():
    runpy.run_path(str(_source))["hide_mismatched"]()
