"""The one owner of a run's checkpoints: folder layout, manifest, commit pointer, resume, keep/delete.

Every other module asks this one for paths and calls it to stage, place and commit; none spells a
file name of the layout. A run's checkpoints live in `<run>/checkpoints/` (`checkpoints_dir`):

    0003/                 the checkpoint of step 3 (`step_dir`: the step, zero-padded to 4 digits)
      adapter_config.json         the HF PEFT adapter, in the step folder itself as ART keeps
      adapter_model.safetensors   it (`adapter_dir`, `ADAPTER_FILES`; `peft_io.export_adapter`)
      rank00000.pt        each global rank's LoRA shards, optimizer state and step count
                          (`rank_state_file`; written by `TrainerEngine.save_state`)
      manifest.json       `Manifest`: step, adapter sha256, base model, parallel layout
    .staging-0004/        a save in progress (`staging_dir`); renamed to `0004` once whole
      .leader-rank<r>     host-local roots only: rank r leads this host's copy (`mark_leader`)
    .trash-0004/          an uncommitted `0004` of an earlier attempt, moved aside to be deleted
    LATEST                the commit pointer: the last committed step, as "3\\n"
    .LATEST.tmp           the pointer being replaced (`write_commit`)

A save is two-phase. The trainer ranks write everything into the staging folder, fsync it and
rename it to its step folder (`place_folder`): a crash never leaves a half checkpoint under a
step's name. The controller then moves the commit pointer (`write_commit`: temp file, fsync,
rename), last, so `LATEST` only ever names a whole checkpoint. A resume reads the pointer
(`read_commit`) and ignores every other folder: staging and trash folders of a crashed save
(removed by `clean_uncommitted`) and step folders newer than the commit (a later save of the same
step replaces them). `read_resume_step`, what `register` resumes from, also refuses what would
fail later or be replaced unseen: the committed step's adapter missing, truncated, not the
manifest's, unlike its own config, not fitting the base model or holding NaN or inf
(`check_adapter`), and step folders the commit does not account for.

The step folder is ART's (`art.utils.output_dirs.get_step_checkpoint_dir`): ART's tools, vLLM and
`peft.PeftModel.from_pretrained` read it as an adapter directory, and ART's step count (the
largest all-digit folder name) is the step. Checkpoints of art-mega before this layout kept the
adapter in an `adapter/` sub-folder; `read_commit` refuses such a committed step with one sentence
saying how to move it (`check_layout`).

File I/O only; this module imports neither torch nor safetensors (an adapter's tensors are read
with numpy, `adapter_problem`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from art_mega.errors import BaseModelError, CheckpointFileError, format_validation_error

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMMIT_FILE = "LATEST"
MANIFEST_FILE = "manifest.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""The adapter's files in a step folder, the names PEFT, vLLM and ART read; what an adapter
transfer to another host sends (the rank state and manifest stay with the trainer)."""
SAFETENSORS_HEADER_LIMIT = 100_000_000
"""The largest safetensors JSON header read (the safetensors library's own bound)."""
LEGACY_ADAPTER_DIR = "adapter"
"""The sub-folder the adapter lived in before checkpoints took ART's layout (only refused)."""
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
LEADER_MARK = ".leader-rank"
STEP_DIGITS = 4
RANK_DIGITS = 5


class ManifestLayout(BaseModel):
    """The parallel layout the checkpoint's rank files were written with."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    world_size: int = Field(ge=1)
    tp: int = Field(ge=1)
    dp: int = Field(ge=1)


class Manifest(BaseModel):
    """`manifest.json` of a checkpoint; written last into the staging folder by the committing rank.

    Attributes:
        step: the policy step the checkpoint holds (equal to its folder's number).
        adapter_sha256: hex sha256 of the adapter's `adapter_model.safetensors`.
        base_model: the base model directory the trainer loaded.
        layout: the trainer's parallel layout.
        written_at: seconds since the epoch when the manifest was made.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    step: int = Field(ge=0)
    adapter_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    base_model: str
    layout: ManifestLayout
    written_at: float = Field(allow_inf_nan=False)


# ---------------------------------------------------------------------------- paths


def run_dir(root: str | os.PathLike[str], project: str, name: str) -> Path:
    """`<root>/<project>/models/<name>`: a model's run folder (history, logs, checkpoints) under
    an artifact root (the backend's) or a base path (a model that is not registered)."""
    return Path(root) / project / "models" / name


DEFAULT_ROOT = ".art"
"""ART's default root, relative to the working directory: runs of `LocalBackend(path=None)`, of a
launch's `homogeneous_cluster(artifact_root=None)` and of a model that is not registered
(`base_path`) live in `./.art/<project>/models/<name>` (ART 0.5.23: `Model.base_path = ".art"`,
`LocalBackend` -> `utils.output_dirs.get_default_art_path()`, `<repo root or .>/.art`)."""

EARLIER_ROOTS = {"artifact_root": os.path.join(".art-mega", "artifacts"), "base_path": ".art-mega"}
"""art-mega's default roots before it took ART's: a backend's artifact root and a model's base
path. A run that exists only there is still read (`root_holding_run`)."""

_EARLIER_RUNS_LOGGED: set[Path] = set()


def root_holding_run(kind: str, project: str, name: str) -> Path:
    """The absolute default root (`DEFAULT_ROOT` under the working directory) for the run
    `project`/`name`, or art-mega's earlier default root of that `kind` ("artifact_root" or
    "base_path", `EARLIER_ROOTS`) when the run folder exists only there, so that a run started
    before the change resumes where it is; the first time for each such run one warning names
    both folders."""
    root = Path(os.path.abspath(DEFAULT_ROOT))
    earlier = Path(os.path.abspath(EARLIER_ROOTS[kind]))
    if run_dir(root, project, name).exists() or not run_dir(earlier, project, name).is_dir():
        return root
    if (found := run_dir(earlier, project, name)) not in _EARLIER_RUNS_LOGGED:
        _EARLIER_RUNS_LOGGED.add(found)
        log.warning(
            "art-mega: reading the run at %s (art-mega's earlier default root); new runs go to %s "
            "(ART's default root): move the folder there to keep them together",
            found,
            run_dir(root, project, name),
        )
    return earlier


def warn_earlier_launch_run(root: str | os.PathLike[str], project: str, name: str) -> bool:
    """For an artifact root fixed before the model was known (a launch's cluster, which
    `root_holding_run` cannot redirect): when `root` is the default root, the run is not under it
    and it exists under the earlier default artifact root, one warning names both folders and
    says how to resume the earlier run. Returns whether it warned."""
    new = run_dir(root, project, name)
    found = run_dir(os.path.abspath(EARLIER_ROOTS["artifact_root"]), project, name)
    if Path(root) != Path(os.path.abspath(DEFAULT_ROOT)) or new.exists() or not found.is_dir():
        return False
    log.warning(
        "art-mega: a new run starts at %s (ART's default root); the run at %s (art-mega's earlier "
        "default root) is not read: pass launch.homogeneous_cluster(artifact_root=%r) to resume it",
        new,
        found,
        os.path.abspath(EARLIER_ROOTS["artifact_root"]),
    )
    return True


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    """`<run>/checkpoints`: the folder holding a run's step folders and its commit pointer."""
    return Path(run_dir) / CHECKPOINTS


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The checkpoint folder of `step` under `root` (a `checkpoints_dir`), e.g. `<root>/0003`."""
    return Path(root) / f"{step:0{STEP_DIGITS}d}"


def staging_dir(checkpoint: str | os.PathLike[str]) -> Path:
    """The hidden folder beside `checkpoint` that its save is written into before the rename."""
    final = Path(checkpoint)
    return final.parent / f"{STAGING_PREFIX}{final.name}"


def adapter_dir(checkpoint: str | os.PathLike[str]) -> Path:
    """The PEFT adapter folder of a checkpoint (or of its staging folder): the folder itself, where
    ART keeps `adapter_config.json` and `adapter_model.safetensors` (`ADAPTER_FILES`)."""
    return Path(checkpoint)


def rank_state_file(checkpoint: str | os.PathLike[str], rank: int) -> Path:
    """Global rank `rank`'s state file inside a checkpoint (or its staging folder): `rank00003.pt`."""
    return Path(checkpoint) / f"rank{rank:0{RANK_DIGITS}d}.pt"


def manifest_file(checkpoint: str | os.PathLike[str]) -> Path:
    """The manifest inside a checkpoint (or its staging folder)."""
    return Path(checkpoint) / MANIFEST_FILE


def step_folders(root: str | os.PathLike[str]) -> list[int]:
    """The steps of every step folder under `root`, sorted; committed or not (staging, trash and
    the pointer are not step folders)."""
    # isascii: str.isdigit also holds for digits int() does not read ("²")
    return sorted(
        int(p.name) for p in Path(root).iterdir() if p.is_dir() and p.name.isdigit() and p.name.isascii()
    )


# ---------------------------------------------------------------------------- writing


@contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary handle on `.<name>.tmp` beside `path`, flushed, fsynced and renamed to `path` when
    the block ends without an exception: readers see the old file or the whole new one. On an
    exception the temp file is left for the next write to replace, and the exception propagates."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp")
    with open(tmp, "wb") as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(final)


def prepare_staging(checkpoint: str | os.PathLike[str]) -> Path:
    """An empty staging folder for `checkpoint` (a leftover of an earlier attempt is removed first);
    returns it.

    Raises:
        FileExistsError: something that is not a folder holds the staging folder's name.
    """
    staging = staging_dir(checkpoint)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def mark_leader(staging: Path, rank: int) -> None:
    """Host-local roots: record in `staging` that global rank `rank` leads its host's copy."""
    (staging / f"{LEADER_MARK}{rank}").touch()


def leader_marks(staging: Path) -> list[int]:
    """The ranks whose leader marks are in `staging`, sorted (more than one: the hosts share a disk)."""
    return sorted(int(p.name[len(LEADER_MARK) :]) for p in staging.glob(f"{LEADER_MARK}*"))


def clear_leader_marks(staging: Path, ranks: list[int]) -> None:
    """Remove the leader marks of `ranks` from `staging` before it is placed."""
    for rank in ranks:
        (staging / f"{LEADER_MARK}{rank}").unlink()


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write `manifest` into `folder` (a staging folder; `place_folder` fsyncs it)."""
    manifest_file(folder).write_text(json.dumps(manifest.model_dump(), indent=2))


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def place_folder(staging: Path, checkpoint: str | os.PathLike[str]) -> None:
    """Fsync everything in `staging`, then rename it to `checkpoint`.

    An existing `checkpoint` (an uncommitted folder of an earlier attempt: the commit pointer
    never names a step that is saved again) is first renamed to its trash folder and deleted, so a
    crash while deleting it never leaves part of it under the step's name.
    """
    final = Path(checkpoint)
    _fsync_tree(staging)
    if final.exists():
        trash = final.parent / f"{TRASH_PREFIX}{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
        shutil.rmtree(trash)
    staging.rename(final)


def write_commit(root: str | os.PathLike[str], step: int) -> None:
    """Move the commit pointer under `root` to `step` (temp file, fsync, rename): called last, after
    the step's folder was placed."""
    with atomic_write(Path(root) / COMMIT_FILE) as handle:
        handle.write(f"{step}\n".encode())


# ---------------------------------------------------------------------------- reading


def read_manifest(checkpoint: str | os.PathLike[str]) -> Manifest:
    """The manifest of a checkpoint folder.

    Raises:
        CheckpointFileError: the manifest is missing, not JSON, or not a `Manifest` (named with
            its path and the first wrong field).
    """
    path = manifest_file(checkpoint)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CheckpointFileError(path, f"cannot be read ({exc.strerror or exc})") from None
    try:
        return Manifest.model_validate_json(text)
    except ValidationError as exc:
        raise CheckpointFileError(
            path, f"is not a checkpoint manifest: {format_validation_error(exc, 'manifest').rstrip('.')}"
        ) from None


def check_layout(checkpoint: str | os.PathLike[str]) -> None:
    """Refuse a step folder in art-mega's earlier layout (the adapter in `adapter/`, nothing at
    ART's place), which neither ART's tools nor this trainer read.

    Raises:
        CheckpointFileError: `<checkpoint>/adapter/` holds the adapter and the folder itself does
            not (the sentence says which two files to move up).
    """
    folder = Path(checkpoint)
    legacy = folder / LEGACY_ADAPTER_DIR
    if (legacy / ADAPTER_FILES[0]).is_file() and not (folder / ADAPTER_FILES[0]).is_file():
        raise CheckpointFileError(
            legacy,
            f"is art-mega's earlier checkpoint layout (ART's tools and this trainer read the adapter "
            f"from the step folder itself): move {' and '.join(ADAPTER_FILES)} from it up into {folder}",
        )


def read_commit(root: str | os.PathLike[str]) -> int | None:
    """The last committed step under `root` (a `checkpoints_dir`), the step a run resumes from.

    None when nothing is committed: no pointer, or a pointer whose step folder holds no manifest
    (its folder was removed; the run then starts afresh). Uncommitted folders are never read.

    Raises:
        CheckpointFileError: the pointer does not hold a step number, the committed step's
            manifest is malformed or names another step (named with its path), or the committed
            step is in art-mega's earlier layout (`check_layout`).
    """
    pointer = Path(root) / COMMIT_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text(errors="replace").strip()
    # the length bound: int() refuses more than 4300 digits with a ValueError
    if not text.isdigit() or not text.isascii() or len(text) > 40:
        raise CheckpointFileError(pointer, f"holds {text[:40]!r}, not the number of the last committed step")
    step = int(text)
    folder = step_dir(root, step)
    if not manifest_file(folder).is_file():
        return None
    found = read_manifest(folder).step
    if found != step:
        raise CheckpointFileError(
            manifest_file(folder), f"says step {found}, but the commit pointer {pointer} names step {step}"
        )
    check_layout(folder)
    return step


class _Tensor(NamedTuple):
    """One tensor of a safetensors header: its dtype ("F32", "BF16", ...), shape and the
    [begin, end) byte range of its data in the file (absolute offsets)."""

    dtype: str
    shape: list[int]
    begin: int
    end: int


_FLOAT_BITS = {
    "F64": ("<u8", 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F32": ("<u4", 0x7F800000, 0x007FFFFF),
    "F16": ("<u2", 0x7C00, 0x03FF),
    "BF16": ("<u2", 0x7F80, 0x007F),
}
"""The safetensors float dtypes an adapter's tensors may have: (numpy unsigned integer of the same
width, exponent bits, mantissa bits). All exponent bits set is inf (mantissa 0) or NaN: read
from the bits, so bfloat16 needs neither torch nor a numpy bfloat16."""


def _safetensors_tensors(path: Path) -> tuple[dict[str, _Tensor] | None, str | None]:
    """({tensor name: `_Tensor`}, None) of a whole safetensors file at `path`, else (None, what is
    wrong with it), read from its header alone: 8 bytes of header length (little-endian), the
    JSON header (each tensor's dtype, shape and [begin, end) byte offsets into the data), then
    the data, which must end where the last tensor does."""
    size = path.stat().st_size
    if size < 8:
        return None, f"is {size} bytes, shorter than a safetensors header"
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if not 0 < length <= min(size - 8, SAFETENSORS_HEADER_LIMIT):
            return (
                None,
                f"announces a {length}-byte header in {size} bytes: it is truncated or not a safetensors file",
            )
        text = handle.read(length)
    try:
        header = json.loads(text)
    except ValueError:
        return None, "is not a whole safetensors file (its header is not JSON)"
    entries = (
        {key: value for key, value in header.items() if key != "__metadata__"}
        if isinstance(header, dict)
        else {}
    )
    tensors: dict[str, _Tensor] = {}
    end = 0
    for key, value in entries.items():
        offsets = value.get("data_offsets") if isinstance(value, dict) else None
        shape = value.get("shape") if isinstance(value, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return None, f"is not a whole safetensors file (tensor {key!r} has no byte offsets)"
        if not (isinstance(shape, list) and all(isinstance(d, int) for d in shape)):
            return None, f"is not a whole safetensors file (tensor {key!r} has no shape)"
        tensors[key] = _Tensor(
            str(value.get("dtype")), shape, 8 + length + offsets[0], 8 + length + offsets[1]
        )
        end = max(end, offsets[1])
    if not tensors:
        return None, "holds no tensors"
    if size != 8 + length + end:
        return (
            None,
            f"is {size} bytes where its header describes {8 + length + end}: it is truncated or was overwritten",
        )
    return tensors, None


def _lora_rank_problem(shapes: dict[str, list[int]], config: dict[str, object]) -> str | None:
    """How the tensors' LoRA ranks and modules disagree with `config` (adapter_config.json), or
    None: PEFT's `<prefix>.<module>.lora_A.weight` is [r, in] and `...lora_B.weight` [out, r],
    of a `<module>` in `target_modules` (when a list; a PEFT regex string is not checked). A LoRA
    on a 3-D parameter of `target_parameters` (`mlp.experts.gate_up_proj`: keys under
    `mlp.experts[.base_layer]`) is [E r, in] and [out, r E]: r divides its rank dimension."""
    rank, targets = config.get("r"), config.get("target_modules")
    parameters = config.get("target_parameters")
    wrapped = (
        {"base_layer"} | {str(p).rsplit(".", 2)[-2] for p in parameters if "." in str(p)}
        if (isinstance(parameters, list) and parameters)
        else set()
    )
    for key, shape in shapes.items():
        parts = key.split(".")
        if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B"):
            continue
        module = parts[-3]
        if module in wrapped:
            found = shape[0] if parts[-2] == "lora_A" else shape[-1]
            if isinstance(rank, int) and rank > 0 and (len(shape) != 2 or found % rank):
                return f"tensor {key} of shape {shape} is not a LoRA of rank {rank} on a parameter of experts"
            continue
        if isinstance(rank, int) and len(shape) == 2:
            found = shape[0] if parts[-2] == "lora_A" else shape[1]
            if found != rank:
                return f"tensor {key} of shape {shape} has LoRA rank {found}, but the config's r is {rank}"
        if isinstance(targets, list) and module not in targets:
            return f"tensor {key} adapts {module!r}, which is not in the config's target_modules {targets}"
    return None


def _model_fit_problem(
    tensors: dict[str, _Tensor], config: dict[str, object], model_dir: Path
) -> tuple[str | None, tuple[tuple[str, ...], ...]]:
    """(how the tensors do not fit the model at `model_dir` (an HF directory) as the trainer
    loads them, or None; the keys of each fused layer's lora_A matrices), both from
    `peft_io.adapter_layout` of the config's r and target_modules. A misfit: a tensor the model
    has no place for, one of another shape, or one missing.

    Raises:
        UserError: the model's config.json is unreadable or its family unsupported, or the
            config's target_modules name an unknown module or part of a fused layer.
    """
    from art_mega.trainer.hf_checkpoint import read_hf_config
    from art_mega.trainer.peft_io import adapter_layout

    rank, targets = config.get("r"), config.get("target_modules")
    if not isinstance(rank, int) or not (
        isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)
    ):
        return (
            f"its config's r={rank!r} and target_modules={targets!r} are not a LoRA rank and a list "
            "of HF module names, so its tensors cannot be checked against the model"
        ), ()
    parameters = config.get("target_parameters") or []
    if not (isinstance(parameters, list) and all(isinstance(p, str) for p in parameters)):
        return f"its config's target_parameters={parameters!r} is not a list of parameter names", ()
    layout = adapter_layout(read_hf_config(model_dir), rank, targets, parameters)
    for key, tensor in tensors.items():
        expected = layout.shapes.get(key)
        if expected is None:
            return (
                f"tensor {key} is not one the trainer loads into {model_dir} ({layout.num_layers} "
                f"layers, LoRA on {sorted(targets)}): the adapter was made for another base model, or "
                "it is not a plain LoRA"
            ), ()
        if tuple(tensor.shape) != expected:
            side = "in_features" if key.endswith("lora_A.weight") else "out_features"
            return (
                f"tensor {key} has shape {tensor.shape}, where {model_dir} takes {list(expected)} "
                f"({side} {expected[1] if side == 'in_features' else expected[0]}): the adapter was "
                "trained on another base model"
            ), ()
    missing = [key for key in layout.shapes if key not in tensors]
    if missing:
        return (
            f"has no tensor {missing[0]} ({len(missing)} missing), which its config's target_modules "
            f"{sorted(targets)} call for on the {layout.num_layers} layers of {model_dir}"
        ), ()
    return None, layout.shared_a


def _float_values(bits: Any, dtype: str) -> Any:
    """The float64 values (a numpy array) of a safetensors tensor's raw bits (`bits`: the numpy
    `_FLOAT_BITS` unsigned view of dtype `dtype`; BF16 is the upper half of an F32, so it is
    widened through F32)."""
    import numpy as np

    if dtype == "BF16":  # astype converts the values, so this is byte-order safe
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(_FLOAT_BITS[dtype][0].replace("u", "f")).astype(np.float64)  # "<u4" -> "<f4"


def _values_problem(
    path: Path, tensors: dict[str, _Tensor], shared_a: tuple[tuple[str, ...], ...]
) -> str | None:
    """What is wrong with the tensors' data in the safetensors file at `path`, or None: a dtype
    that is not a float of `_FLOAT_BITS`, data whose length is not its shape's, a NaN or an
    infinity, or lora_A matrices of one fused layer (`shared_a`) whose values differ (compared as
    numbers, as the trainer compares them: -0.0 equals 0.0, and a BF16 copy equals an F32 one
    holding the same values; a digest of each one's float64 values is kept, not the values).
    Reads every tensor (numpy on the raw bits, one tensor at a time)."""
    import numpy as np

    digests: dict[str, bytes] = {}
    shared = {key for keys in shared_a for key in keys}
    with open(path, "rb") as handle:
        for key, tensor in tensors.items():
            if tensor.dtype not in _FLOAT_BITS:
                return f"tensor {key} has dtype {tensor.dtype}; LoRA tensors are floats ({', '.join(_FLOAT_BITS)})"
            view, exponent, mantissa = _FLOAT_BITS[tensor.dtype]
            count = math.prod(tensor.shape)
            if tensor.end - tensor.begin != count * np.dtype(view).itemsize:
                return (
                    f"is not a whole safetensors file (tensor {key}'s {tensor.end - tensor.begin} bytes "
                    f"are not its shape {tensor.shape} of {tensor.dtype})"
                )
            handle.seek(tensor.begin)
            data = handle.read(tensor.end - tensor.begin)
            bits = np.frombuffer(data, dtype=view)
            special = (bits & exponent) == exponent
            if special.any():
                nan = int(np.count_nonzero(special & ((bits & mantissa) != 0)))
                return (
                    f"tensor {key} holds {nan} NaN and {int(np.count_nonzero(special)) - nan} infinite "
                    f"values (of {count}), which would reach the optimizer and the served adapter"
                )
            if key in shared:  # the values' digest: + 0.0 makes -0.0 0.0 (NaN was refused above)
                digests[key] = hashlib.sha256((_float_values(bits, tensor.dtype) + 0.0).tobytes()).digest()
    for keys in shared_a:
        for key in keys[1:]:
            if digests[key] != digests[keys[0]]:
                return (
                    f"tensors {keys[0]} and {key} differ, but the trainer fuses their modules into one "
                    "layer with one lora_A and needs them equal (a PEFT adapter trained apart from "
                    "art-mega has one lora_A per module)"
                )
    return None


def adapter_problem(
    folder: str | os.PathLike[str],
    manifest: Manifest | None = None,
    model_dir: str | os.PathLike[str] | None = None,
) -> tuple[Path, str] | None:
    """(the file, what is wrong with it) for a PEFT adapter folder (a step folder, or a
    warm-start adapter) whose adapter a trainer rank or replica could not load as saved, or
    None. In order: an `ADAPTER_FILES` file missing; an `adapter_model.safetensors` that is not
    a whole safetensors file (truncated, overwritten, no tensors); one whose sha256 is not
    `manifest`'s (when given); tensors whose LoRA rank or modules are not the ones
    `adapter_config.json` says; with `model_dir` (the base model's HF directory), tensors that
    do not fit it (`_model_fit_problem`); then the data (`_values_problem`: non-float dtypes,
    wrong lengths, NaN or inf; with `model_dir` also a fused layer's unequal lora_A). Whether the
    config suits the backend's LoRA is `peft_config.check_adapter_config`'s question.

    Reads the header, then every tensor's data (adapters are small); imports no torch.

    Raises:
        UserError: from `_model_fit_problem` (the model itself unreadable or unsupported).
    """
    folder = adapter_dir(folder)
    config_path, weights = (folder / name for name in ADAPTER_FILES)
    for path in (config_path, weights):
        if not path.is_file():
            return path, (
                f"is missing, so the adapter of {folder} cannot be loaded (a folder holds both "
                f"{' and '.join(ADAPTER_FILES)})"
            )
    tensors, problem = _safetensors_tensors(weights)
    if problem is not None:
        return weights, problem
    assert tensors is not None
    if manifest is not None:
        digest = _sha256(weights)
        if digest != manifest.adapter_sha256:
            return weights, f"has sha256 {digest}, not the manifest's {manifest.adapter_sha256}"
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        return config_path, f"is not valid JSON ({exc})"
    if not isinstance(config, dict):
        return config_path, f"holds a JSON {type(config).__name__}, not an adapter config"
    problem = _lora_rank_problem({key: t.shape for key, t in tensors.items()}, config)
    if problem is not None:
        return weights, f"does not match {config_path}: {problem}"
    shared_a: tuple[tuple[str, ...], ...] = ()
    if model_dir is not None:
        problem, shared_a = _model_fit_problem(tensors, config, Path(model_dir))
        if problem is not None:
            return weights, problem
    problem = _values_problem(weights, tensors, shared_a)
    return None if problem is None else (weights, problem)


def check_adapter(
    checkpoint: str | os.PathLike[str],
    manifest: Manifest | None = None,
    model_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Refuse a step folder whose adapter a trainer rank or replica could not load as saved
    (`adapter_problem`: missing, truncated, not `manifest`'s, unlike its config, not fitting
    `model_dir` when given, non-finite).

    Raises:
        CheckpointFileError: naming the file and what is wrong with it.
        UserError: the model at `model_dir` is unreadable or unsupported.
    """
    found = adapter_problem(checkpoint, manifest, model_dir)
    if found is not None:
        raise CheckpointFileError(*found)


def check_warm_start(
    adapter: str | os.PathLike[str], model_dir: str | os.PathLike[str], base_model: str
) -> None:
    """Refuse a warm-start adapter (`TrainableModel.base_model`, resolved to `adapter`) that the
    trainer ranks could not load into the model at `model_dir`, or whose values are not finite
    (`adapter_problem`), before any rank or replica starts.

    Raises:
        BaseModelError: one sentence naming base_model, the file, what is wrong and the fix.
        UserError: the model at `model_dir` is unreadable or unsupported.
    """
    found = adapter_problem(adapter, model_dir=model_dir)
    if found is not None:
        path, problem = found
        raise BaseModelError(
            f"base_model {base_model!r} is a warm-start adapter the trainer cannot load: {path} "
            f"{problem}; warm-start from a whole adapter with finite values trained on {model_dir}",
            base_model,
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_resume_step(
    root: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None = None
) -> int | None:
    """The committed step a run resumes from, as `read_commit` reads it, once nothing under
    `root` (a `checkpoints_dir`) would fail later or be replaced unseen.

    Besides `read_commit`'s refusals:
    - the committed step's adapter must load as saved, with finite values, and with `model_dir`
      (the base model's HF directory) into that model (`check_adapter` with its manifest);
    - a pointer naming a step whose folder holds no manifest, while step folders are there, is
      refused: the run would start afresh and its saves replace those folders;
    - a step folder above the commit must be the one save a crash can leave uncommitted (the
      next step, with its manifest; logged, and replaced when that step is saved again): one
      without a manifest (not this trainer's save, e.g. ART's) or further ahead (a pointer
      older than the run) is refused.

    Raises:
        CheckpointFileError: naming the file or folder, what is wrong and the fix.
        UserError: the model at `model_dir` is unreadable or unsupported.
    """
    root = Path(root)
    committed = read_commit(root)
    steps = step_folders(root) if root.is_dir() else []
    pointer = root / COMMIT_FILE
    if committed is None and pointer.is_file() and steps:
        named = int(pointer.read_text().strip())  # read_commit read it as a step number
        raise CheckpointFileError(
            pointer,
            f"names step {named}, whose folder {step_dir(root, named)} holds no {MANIFEST_FILE}, while "
            f"the step folders {steps} are there (a fresh start would replace them); write the step "
            "to resume from into it",
        )
    base = -1 if committed is None else committed
    for step in (s for s in steps if s > base):
        folder = step_dir(root, step)
        if not manifest_file(folder).is_file():
            raise CheckpointFileError(
                folder,
                f"is a step folder above the committed step ({committed}, {pointer}) without the "
                f"{MANIFEST_FILE} this trainer saves (e.g. a run of ART's), which training would "
                f"replace; move it out of {root}",
            )
        if step != base + 1:
            raise CheckpointFileError(
                folder,
                f"holds a saved step {step}, more than one step above the committed step ({committed}, "
                f"{pointer}), which a pointer older than the run or one set back by hand leaves; to "
                f"resume from step {committed}, move the step folders above {base + 1} out of {root}, "
                "else write the step to resume from into the pointer",
            )
        log.warning(
            "%s is a save of step %d that was not committed (the commit is %s); it is replaced when "
            "step %d is saved again",
            folder,
            step,
            committed,
            step,
        )
    if committed is not None:
        folder = step_dir(root, committed)
        check_adapter(folder, read_manifest(folder), model_dir)
    return committed


def clean_uncommitted(root: str | os.PathLike[str]) -> list[Path]:
    """Remove what a crashed save left under `root`: staging and trash folders and a half-written
    pointer; returns what was removed. Call it only while no trainer rank saves into `root`. Step
    folders are kept (newer ones than the commit are replaced when their step is saved again)."""
    removed = []
    for path in sorted(Path(root).iterdir()):
        if path.is_dir() and path.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(path)
            removed.append(path)
        elif path.name == f".{COMMIT_FILE}.tmp":
            path.unlink()
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------- keep / delete


def best_step(rows: Iterable[Mapping[str, Any]], metric: str) -> int | None:
    """ART's best step for `model.delete_checkpoints` (ART 0.5.23 `Model.delete_checkpoints`):
    the history rows (history.jsonl) that hold `metric` (a number, not null), grouped by their
    "step", each step scored by the mean of its values; the step of the highest mean. None when
    no row holds it (ART then keeps the latest step only). A NaN value is left out (ART's polars
    sort would make a NaN step the best); among equal means the earliest step wins (ART's order
    is unspecified there). The step may have no checkpoint left: nothing more is kept then."""
    values: dict[int, list[float]] = {}
    for row in rows:
        value = row.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            values.setdefault(int(row["step"]), []).append(float(value))
    if not values:
        return None
    means = {step: sum(v) / len(v) for step, v in values.items()}
    return max(sorted(means), key=lambda step: means[step])


def deletable_steps(steps: list[int], latest: int, best: int | None) -> list[int]:
    """The steps of `steps` that `model.delete_checkpoints` removes, by ART's rule: all but
    `latest` and `best` (`best_step`; None: only the latest stays). Sorted as `steps`."""
    return [s for s in steps if s not in (latest, best)]


def delete_step(root: str | os.PathLike[str], step: int) -> Path:
    """Remove the step folder of `step` under `root` (missing is fine); returns its path."""
    folder = step_dir(root, step)
    shutil.rmtree(folder, ignore_errors=True)
    return folder
