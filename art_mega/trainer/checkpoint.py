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
manifest's or unlike its own config (`check_adapter`), and step folders the commit does not
account for.

The step folder is ART's (`art.utils.output_dirs.get_step_checkpoint_dir`): ART's tools, vLLM and
`peft.PeftModel.from_pretrained` read it as an adapter directory, and ART's step count (the
largest all-digit folder name) is the step. Checkpoints of art-mega before this layout kept the
adapter in an `adapter/` sub-folder; `read_commit` refuses such a committed step with one sentence
saying how to move it (`check_layout`).

File I/O only; this module imports neither torch nor safetensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from art_mega.errors import CheckpointFileError, format_validation_error

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


def _safetensors_tensors(path: Path) -> tuple[dict[str, list[int]] | None, str | None]:
    """({tensor name: shape}, None) of a whole safetensors file at `path`, else (None, what is
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
    tensors = (
        {key: value for key, value in header.items() if key != "__metadata__"}
        if isinstance(header, dict)
        else {}
    )
    shapes: dict[str, list[int]] = {}
    end = 0
    for key, value in tensors.items():
        offsets = value.get("data_offsets") if isinstance(value, dict) else None
        shape = value.get("shape") if isinstance(value, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return None, f"is not a whole safetensors file (tensor {key!r} has no byte offsets)"
        if not (isinstance(shape, list) and all(isinstance(d, int) for d in shape)):
            return None, f"is not a whole safetensors file (tensor {key!r} has no shape)"
        shapes[key] = shape
        end = max(end, offsets[1])
    if not shapes:
        return None, "holds no tensors"
    if size != 8 + length + end:
        return (
            None,
            f"is {size} bytes where its header describes {8 + length + end}: it is truncated or was overwritten",
        )
    return shapes, None


def _lora_rank_problem(shapes: dict[str, list[int]], config: dict[str, object]) -> str | None:
    """How the tensors' LoRA ranks and modules disagree with `config` (adapter_config.json), or
    None: PEFT's `<prefix>.<module>.lora_A.weight` is [r, in] and `...lora_B.weight` [out, r],
    of a `<module>` in `target_modules` (when a list; a PEFT regex string is not checked)."""
    rank, targets = config.get("r"), config.get("target_modules")
    for key, shape in shapes.items():
        parts = key.split(".")
        if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B"):
            continue
        module = parts[-3]
        if isinstance(rank, int) and len(shape) == 2:
            found = shape[0] if parts[-2] == "lora_A" else shape[1]
            if found != rank:
                return f"tensor {key} of shape {shape} has LoRA rank {found}, but the config's r is {rank}"
        if isinstance(targets, list) and module not in targets:
            return f"tensor {key} adapts {module!r}, which is not in the config's target_modules {targets}"
    return None


def check_adapter(checkpoint: str | os.PathLike[str], manifest: Manifest | None = None) -> None:
    """Refuse a step folder whose adapter a trainer rank or replica could not load as saved: an
    `ADAPTER_FILES` file missing, an `adapter_model.safetensors` that is not a whole safetensors
    file (truncated, overwritten, no tensors), one whose sha256 is not `manifest`'s (when given),
    or tensors whose LoRA rank or modules are not the ones `adapter_config.json` says (whether
    that config suits the backend's LoRA is `peft_config.check_adapter_config`'s question).

    Reads the safetensors header and hashes the file; no tensor is loaded.

    Raises:
        CheckpointFileError: naming the file and what is wrong with it.
    """
    folder = adapter_dir(checkpoint)
    config_path, weights = (folder / name for name in ADAPTER_FILES)
    for path in (config_path, weights):
        if not path.is_file():
            raise CheckpointFileError(
                path,
                f"is missing, so the adapter of {folder} cannot be loaded (a folder holds both {' and '.join(ADAPTER_FILES)})",
            )
    shapes, problem = _safetensors_tensors(weights)
    if problem is not None:
        raise CheckpointFileError(weights, problem)
    if manifest is not None:
        digest = _sha256(weights)
        if digest != manifest.adapter_sha256:
            raise CheckpointFileError(
                weights, f"has sha256 {digest}, not the manifest's {manifest.adapter_sha256}"
            )
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointFileError(config_path, f"is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointFileError(config_path, f"holds a JSON {type(config).__name__}, not an adapter config")
    assert shapes is not None
    problem = _lora_rank_problem(shapes, config)
    if problem is not None:
        raise CheckpointFileError(weights, f"does not match {config_path}: {problem}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_resume_step(root: str | os.PathLike[str]) -> int | None:
    """The committed step a run resumes from, as `read_commit` reads it, once nothing under
    `root` (a `checkpoints_dir`) would fail later or be replaced unseen.

    Besides `read_commit`'s refusals:
    - the committed step's adapter must load as saved (`check_adapter` with its manifest);
    - a pointer naming a step whose folder holds no manifest, while step folders are there, is
      refused: the run would start afresh and its saves replace those folders;
    - a step folder above the commit must be the one save a crash can leave uncommitted (the
      next step, with its manifest; logged, and replaced when that step is saved again): one
      without a manifest (not this trainer's save, e.g. ART's) or further ahead (a pointer
      older than the run) is refused.

    Raises:
        CheckpointFileError: naming the file or folder, what is wrong and the fix.
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
        check_adapter(folder, read_manifest(folder))
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


def deletable_steps(
    steps: list[int], latest: int, scores: Mapping[int, float], protected: set[int]
) -> list[int]:
    """The steps of `steps` that `model.delete_checkpoints` removes: all but `latest`, the best
    step by `scores` (higher is better; among the steps present that have a score; the earliest
    wins a tie) and the `protected` ones (served adapters). Sorted as `steps`."""
    keep = {latest} | protected
    scored = [s for s in steps if s in scores]
    if scored:
        keep.add(max(scored, key=lambda s: scores[s]))
    return [s for s in steps if s not in keep]


def delete_step(root: str | os.PathLike[str], step: int) -> Path:
    """Remove the step folder of `step` under `root` (missing is fine); returns its path."""
    folder = step_dir(root, step)
    shutil.rmtree(folder, ignore_errors=True)
    return folder
