"""A PEFT LoRA adapter's adapter_config.json, read and checked against a LoRA config, without torch.

The controller checks a warm-start adapter (and a run's committed checkpoint) this way at
`register`, before any trainer rank or replica starts; a trainer rank checks again before it
loads the tensors (`peft_io.import_adapter`), so both say the same sentence.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from art_mega.errors import AdapterMismatchError, UserError
from art_mega.trainer.families import LORA_NAMES

ADAPTER_CONFIG = "adapter_config.json"

_UNSUPPORTED = (
    "use_dora",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "layers_to_transform",
    "layer_replication",
    "lora_bias",
    "trainable_token_indices",
)
"""adapter_config.json keys art-mega's LoRA has no counterpart for (when set / non-empty): the
weights they add (full copies of `modules_to_save`, LoRA biases, token rows) or the layers they
leave out would be dropped or trained where the adapter has none."""


def read_adapter_config(adapter_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The adapter_config.json of the PEFT adapter in `adapter_dir`, as a dict.

    Raises:
        UserError: the file is missing, not valid JSON, or not a JSON object.
    """
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{Path(adapter_dir)} is not a PEFT adapter directory ({path} is missing).") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); re-export the adapter.") from None
    if not isinstance(found, dict):
        raise UserError(f"{path} holds a JSON {type(found).__name__}, not an object; re-export the adapter.")
    return found


def check_adapter_config(
    found: dict[str, Any],
    adapter_dir: str | os.PathLike[str],
    *,
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    target_parameters: Sequence[str] = (),
    what: str = "the warm-start adapter",
    otherwise: str = "or warm-start from an adapter trained with the backend's settings",
) -> None:
    """Refuse an adapter config (`found`, from `read_adapter_config`) that the trainer's LoRA
    (`rank`, `alpha`, HF `target_modules` and, in this order, `target_parameters`: the fields of
    `LoraNames.peft_targets`) cannot load exactly.

    `what` names the adapter in the sentence; `otherwise` is the second fix offered (the first
    is the `MegatronBackend(...)` arguments that match the adapter).

    Raises:
        AdapterMismatchError: one sentence naming each differing value of the adapter, the
            backend's value and the fix; for a non-LoRA adapter, DoRA / rsLoRA / per-module
            patterns, trained biases, `modules_to_save` or a subset of layers, that art-mega
            trains plain LoRA only.
    """
    directory = str(Path(adapter_dir))
    unsupported = {key: found[key] for key in _UNSUPPORTED if found.get(key)}
    if found.get("bias", "none") not in (None, "none"):  # PEFT trains the layers' biases too
        unsupported["bias"] = found["bias"]
    if found.get("peft_type", "LORA") != "LORA":
        unsupported = {"peft_type": found.get("peft_type"), **unsupported}
    if unsupported:
        listed = " and ".join(f"{key}={value!r}" for key, value in unsupported.items())
        raise AdapterMismatchError(
            f"{what} {directory} has {listed}, but art-mega trains plain LoRA adapters only; "
            "convert it to a plain LoRA adapter (peft_type 'LORA', no DoRA, rsLoRA or per-module "
            f"patterns) {otherwise}",
            directory,
            {key: (value, None) for key, value in unsupported.items()},
        )
    mismatches: dict[str, tuple[Any, Any]] = {}
    wanted = sorted(target_modules)
    found_rank, found_alpha, found_targets = (
        found.get("r"),
        found.get("lora_alpha"),
        found.get("target_modules"),
    )
    parts: list[str] = []
    fixes: list[str | None] = []  # the MegatronBackend argument that matches; None: none can
    if isinstance(found_rank, bool) or not isinstance(found_rank, int) or found_rank != rank:
        mismatches["r"] = (found_rank, rank)
        parts.append(f"r={found_rank!r} where the backend's lora_rank={rank}")
        usable = isinstance(found_rank, int) and not isinstance(found_rank, bool) and found_rank >= 1
        fixes.append(f"lora_rank={found_rank!r}" if usable else None)
    if not _same_number(found_alpha, alpha):
        mismatches["lora_alpha"] = (found_alpha, alpha)
        parts.append(f"lora_alpha={found_alpha!r} where the backend's lora_alpha={alpha!r}")
        fixes.append(f"lora_alpha={found_alpha!r}" if _positive_number(found_alpha) else None)
    if not (isinstance(found_targets, list) and sorted(map(str, found_targets)) == wanted):
        mismatches["target_modules"] = (found_targets, wanted)
        parts.append(f"target_modules={found_targets!r} where the backend's LoRA covers {wanted}")
        fixes.append(_targets_argument(found_targets))
    found_parameters = found.get("target_parameters") or []
    if found_parameters != list(target_parameters):  # PEFT nests the wrappers in this order
        mismatches["target_parameters"] = (found_parameters, list(target_parameters))
        parts.append(
            f"target_parameters={found_parameters!r} where the backend's LoRA covers {list(target_parameters)}"
        )
        fixes.append(None)
    if parts:
        if all(fixes):
            fix = f"pass MegatronBackend({', '.join(f for f in fixes if f)}) to train it, {otherwise}"
        else:  # art-mega's LoRA cannot take the adapter's value as it is
            fix = otherwise.removeprefix("or ")
        raise AdapterMismatchError(
            f"{what} {directory} does not match this backend's LoRA: it has {', and '.join(parts)}; {fix}",
            directory,
            mismatches,
        )


def _targets_argument(found: Any) -> str | None:
    """`lora_targets=(...)` covering exactly the HF modules `found`, or None when no LoRA of
    art-mega can (not a list of names, an unknown module, or part of a fused layer)."""
    if not isinstance(found, list) or not found or not all(isinstance(name, str) for name in found):
        return None
    try:
        targets = LORA_NAMES.normalise(tuple(found))
    except UserError:
        return None
    if LORA_NAMES.hf_target_modules(targets) != sorted(found):
        return None
    return f"lora_targets={tuple(sorted(found))!r}"


def _same_number(found: Any, expected: float) -> bool:
    """True when `found` is a number (not a bool) equal to `expected`."""
    if isinstance(found, bool) or not isinstance(found, (int, float)):
        return False
    return float(found) == float(expected)


def _positive_number(found: Any) -> bool:
    """True when `found` is a finite number (not a bool) above 0: a LoRA alpha the backend takes."""
    return (
        not isinstance(found, bool) and isinstance(found, (int, float)) and math.isfinite(found) and found > 0
    )
