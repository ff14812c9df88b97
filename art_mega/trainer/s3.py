"""A run's checkpoints in an S3 bucket (ART's `_experimental_push_to_s3` / `_pull_from_s3` /
`_fork_checkpoint`), through boto3 (the `s3` extra; imported when a call needs it).

The bucket holds a run as ART lays it out: the run folder `<project>/models/<name>` (under an
optional `prefix`) mirrors the local `<artifact_root>/<project>/models/<name>`, its checkpoints
under `checkpoints/` in `art_mega.trainer.checkpoint`'s layout (step folders `0003/` with
`adapter/`, the rank state files and `manifest.json`, and the commit pointer `LATEST`). boto3
finds the endpoint and credentials as it always does (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_PROFILE`, ...); the bucket is the argument or `$BACKUP_BUCKET`, as in ART.

A pulled or forked step is downloaded or copied into its staging folder, checked (manifest of
that step, adapter sha256 equal to the manifest's), placed and only then committed with
`checkpoint.write_commit`, so a run that resumes from it cannot tell it from one trained here.
Only committed steps travel: a push uploads the step folders up to the local `LATEST` and the
pointer last; a pull reads the bucket's `LATEST` and ignores newer step folders.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_mega.errors import CheckpointFileError, UserError
from art_mega.trainer import checkpoint

log = logging.getLogger(__name__)

BUCKET_ENV = "BACKUP_BUCKET"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The PEFT weights file whose sha256 a manifest records (`peft_io.ADAPTER_WEIGHTS`; that module
imports torch, this one must not)."""


def client() -> Any:
    """A boto3 S3 client configured from the environment (endpoint, region, credentials).

    Raises:
        UserError: boto3 is not installed.
    """
    try:
        import boto3
    except ImportError:
        raise UserError(
            "S3 checkpoints need boto3, which is not installed; pip install 'art-mega[s3]'"
        ) from None
    return boto3.client("s3")


def bucket_name(s3_bucket: str | None, where: str) -> str:
    """`s3_bucket`, or `$BACKUP_BUCKET` when None (ART's default).

    Raises:
        UserError: neither is set, or `s3_bucket` is not a non-empty string.
    """
    bucket = os.environ.get(BUCKET_ENV) if s3_bucket is None else s3_bucket
    if not isinstance(bucket, str) or not bucket.strip():
        raise UserError(
            f"{where}(s3_bucket={s3_bucket!r}) names no bucket and ${BUCKET_ENV} is not set; "
            "pass s3_bucket='my-bucket' or set BACKUP_BUCKET"
        )
    return bucket


def run_key(project: str, name: str, prefix: str | None = None) -> str:
    """The key prefix of a run's folder in the bucket: `[<prefix>/]<project>/models/<name>`."""
    head = f"{prefix.strip('/')}/" if prefix and prefix.strip("/") else ""
    return f"{head}{project}/models/{name}"


def check_bucket(s3: Any, bucket: str, where: str) -> None:
    """Refuse a bucket that does not exist or cannot be reached (one HEAD request).

    Raises:
        UserError: the bucket does not exist, access to it is denied, or the endpoint does not answer.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise UserError(
                f"{where}: S3 bucket {bucket!r} does not exist at {s3.meta.endpoint_url}; "
                "create it first or name another bucket"
            ) from None
        raise UserError(
            f"{where}: S3 bucket {bucket!r} at {s3.meta.endpoint_url} refused access ({code}); "
            "check the AWS credentials in the environment"
        ) from None
    except BotoCoreError as exc:
        raise UserError(
            f"{where}: S3 bucket {bucket!r} is unreachable at {s3.meta.endpoint_url} ({exc}); "
            "check AWS_ENDPOINT_URL and the network"
        ) from None


def _keys(s3: Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return keys


def _committed_files(run_dir: Path) -> list[Path]:
    """The files a push uploads: everything under `run_dir` except uncommitted checkpoint folders
    (staging, trash, steps newer than `LATEST`) and the pointer itself (uploaded last)."""
    root = checkpoint.checkpoints_dir(run_dir)
    committed = checkpoint.read_commit(root) if root.is_dir() else None
    files = []
    for path in sorted(run_dir.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(run_dir).parts
        if rel[0] == checkpoint.CHECKPOINTS and len(rel) > 1:
            top = rel[1]
            if len(rel) == 2 or not top.isdigit() or committed is None or int(top) > committed:
                continue  # the pointer, its temp file, staging/trash, uncommitted steps
        files.append(path)
    return files


def push_run(run_dir: Path, bucket: str, key: str, *, verbose: bool = False) -> int:
    """Upload the committed part of `run_dir` to `s3://<bucket>/<key>/`, the commit pointer last;
    returns the number of files uploaded (pointer included).

    Raises:
        UserError: `run_dir` does not exist; the bucket is missing or unreachable.
        CheckpointFileError: the local pointer or committed manifest is malformed.
    """
    where = "_experimental_push_to_s3"
    if not run_dir.is_dir():
        raise UserError(f"{where}: the run folder {run_dir} does not exist; train or pull the model first")
    s3 = client()
    check_bucket(s3, bucket, where)
    files = _committed_files(run_dir)
    root = checkpoint.checkpoints_dir(run_dir)
    pointer = root / checkpoint.COMMIT_FILE
    if root.is_dir() and checkpoint.read_commit(root) is not None:
        files.append(pointer)  # last: the bucket's LATEST only ever names uploaded step folders
    for path in files:
        target = f"{key}/{path.relative_to(run_dir).as_posix()}"
        if verbose:
            print(f"upload {path} -> s3://{bucket}/{target}")
        s3.upload_file(str(path), bucket, target)
    return len(files)


def remote_commit(s3: Any, bucket: str, key: str) -> tuple[int | None, list[int]]:
    """The bucket's committed step of the run at `key` (its `LATEST`; None without one) and the
    committed steps present there (step folders up to it holding a manifest), sorted."""
    from botocore.exceptions import ClientError

    base = f"{key}/{checkpoint.CHECKPOINTS}/"
    try:
        text = s3.get_object(Bucket=bucket, Key=base + checkpoint.COMMIT_FILE)["Body"].read().decode()
    except ClientError:
        return None, []
    text = text.strip()
    if not text.isdigit():
        raise UserError(
            f"s3://{bucket}/{base}{checkpoint.COMMIT_FILE} holds {text[:40]!r}, not a step number; "
            "push the run again"
        )
    latest = int(text)
    steps = sorted(
        {
            int(parts[0])
            for k in _keys(s3, bucket, base)
            if len(parts := k[len(base) :].split("/")) == 2
            and parts[0].isdigit()
            and parts[1] == checkpoint.MANIFEST_FILE
        }
    )
    return latest, [s for s in steps if s <= latest]


def _check_step(folder: Path, step: int, source: str) -> None:
    """Refuse a copied step folder whose manifest is malformed, names another step, or whose
    adapter's sha256 differs from the manifest's (`source` names where it came from)."""
    manifest = checkpoint.read_manifest(folder)  # CheckpointFileError: malformed
    if manifest.step != step:
        raise CheckpointFileError(
            f"{source}/{checkpoint.MANIFEST_FILE}",
            f"says step {manifest.step}, but it is the folder of step {step}",
        )
    weights = checkpoint.adapter_dir(folder) / ADAPTER_WEIGHTS
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else "missing"
    if digest != manifest.adapter_sha256:
        raise CheckpointFileError(
            f"{source}/{ADAPTER_WEIGHTS}",
            f"has sha256 {digest}, not the manifest's {manifest.adapter_sha256}",
        )


def place_step(root: Path, step: int, source: str, fill: Callable[[Path], None]) -> Path:
    """Stage step `step` under `root` (a `checkpoints_dir`) with `fill(staging)`, check it
    (`_check_step`) and place it as the step's folder; the caller commits. Returns the folder."""
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint.step_dir(root, step)
    staging = checkpoint.prepare_staging(final)
    try:
        fill(staging)
        _check_step(staging, step, source)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    checkpoint.place_folder(staging, final)
    return final


def download_step(s3: Any, bucket: str, key: str, step: int, root: Path, *, verbose: bool = False) -> Path:
    """Download the bucket's step folder `step` of the run at `key` into `root` (staged, checked,
    placed; not committed). Returns the placed folder."""
    base = f"{key}/{checkpoint.CHECKPOINTS}/{checkpoint.step_dir('', step).name}"

    def fill(staging: Path) -> None:
        for k in _keys(s3, bucket, base + "/"):
            target = staging / k[len(base) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            if verbose:
                print(f"download s3://{bucket}/{k} -> {target}")
            s3.download_file(bucket, k, str(target))

    return place_step(root, step, f"s3://{bucket}/{base}", fill)


def pull_run(
    run_dir: Path, bucket: str, key: str, only_step: int | str | None, *, verbose: bool = False
) -> int | None:
    """Download the run at `s3://<bucket>/<key>` into `run_dir`; returns the local committed step after.

    `only_step` None: every committed step and the run's other files (history, logs,
    trajectories); an int: that committed step only; "latest": the bucket's committed step only.
    Steps the local run already holds with the same manifest are not downloaded again; the local
    pointer moves to the newest step now present (never back). A bucket that holds no committed
    checkpoint of the run (a first run: nothing pushed yet) pulls nothing, with one logged line,
    as ART's pull of an empty prefix syncs nothing; returns the local committed step (None).

    Raises:
        UserError: the bucket is missing or unreachable; it holds committed checkpoints of the run
            but not step `only_step`; a committed local step differs from the bucket's.
        CheckpointFileError: a downloaded or local manifest is malformed or does not match its adapter.
    """
    where = "_experimental_pull_from_s3"
    s3 = client()
    check_bucket(s3, bucket, where)
    latest, steps = remote_commit(s3, bucket, key)
    if latest is None:
        log.warning(
            "%s: s3://%s/%s holds no committed checkpoint (no %s/%s), so nothing is pulled and the "
            "run starts from its base model, as in ART (check the model name, project and prefix if it should)",
            where,
            bucket,
            key,
            checkpoint.CHECKPOINTS,
            checkpoint.COMMIT_FILE,
        )
        return checkpoint.read_commit(checkpoint.checkpoints_dir(run_dir))
    if only_step == "latest":
        steps = [latest]
    elif only_step is not None:
        if only_step not in steps:
            raise UserError(
                f"{where}(only_step={only_step!r}): s3://{bucket}/{key} holds the committed steps "
                f"{steps}; pass one of them, 'latest' or None"
            )
        steps = [only_step]
    root = checkpoint.checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    checkpoint.clean_uncommitted(root)
    local = checkpoint.read_commit(root)
    for step in steps:
        here = checkpoint.step_dir(root, step)
        if local is not None and step <= local and checkpoint.manifest_file(here).is_file():
            theirs = s3.get_object(
                Bucket=bucket, Key=f"{key}/{checkpoint.CHECKPOINTS}/{here.name}/{checkpoint.MANIFEST_FILE}"
            )["Body"].read()
            ours = checkpoint.read_manifest(here)
            if checkpoint.Manifest.model_validate_json(theirs).adapter_sha256 != ours.adapter_sha256:
                raise UserError(
                    f"{where}: the local run {run_dir} and s3://{bucket}/{key} hold different "
                    f"checkpoints of step {step}; pull into a model of another name"
                )
            continue
        download_step(s3, bucket, key, step, root, verbose=verbose)
    if only_step is None:
        for k in _keys(s3, bucket, key + "/"):
            rel = k[len(key) + 1 :]
            if rel.split("/")[0] == checkpoint.CHECKPOINTS:
                continue
            target = run_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, k, str(target))
    newest = max(steps)
    if local is None or newest > local:
        checkpoint.write_commit(root, newest)  # last: LATEST only names placed folders
        local = newest
    return local


def fork_step(
    source_root: Path | None,
    dest_root: Path,
    *,
    not_after_step: int | None,
    s3_source: tuple[str, str] | None,
    describe: str,
    verbose: bool = False,
) -> int:
    """Copy the newest committed step <= `not_after_step` (any, when None) of a source run into
    the empty run whose checkpoints folder is `dest_root`, and commit it there; returns the step.

    The source is `source_root` (a local `checkpoints_dir`) or, with `s3_source` = (bucket, key),
    the run at `s3://<bucket>/<key>`; `describe` names it in refusals ("model 'a' of project 'p'").

    Raises:
        UserError: the destination already has a committed checkpoint; the source has none; none
            at or before `not_after_step`; the bucket is missing or unreachable.
        CheckpointFileError: the source's pointer or the chosen step's manifest is malformed, or
            its adapter does not match the manifest (a local source's: missing, truncated or
            unlike its own config too, `checkpoint.check_adapter`).
    """
    where = "_experimental_fork_checkpoint"
    if dest_root.is_dir():
        checkpoint.clean_uncommitted(dest_root)
        mine = checkpoint.read_commit(dest_root)
        if mine is not None:
            raise UserError(
                f"{where}: the model to fork into already has checkpoints (committed step {mine} in "
                f"{dest_root}); fork into a model of a new name, or delete that run folder first"
            )
    if s3_source is not None:
        bucket, key = s3_source
        s3 = client()
        check_bucket(s3, bucket, where)
        _, steps = remote_commit(s3, bucket, key)
        place = f"s3://{bucket}/{key}"
    else:
        committed = None
        if source_root is not None and source_root.is_dir():
            committed = checkpoint.read_commit(source_root)
        steps = []
        if committed is not None:
            steps = [
                s
                for s in checkpoint.step_folders(source_root)
                if s <= committed and checkpoint.manifest_file(checkpoint.step_dir(source_root, s)).is_file()
            ]
        place = str(source_root)
    if not steps:
        raise UserError(
            f"{where}: {describe} has no committed checkpoint at {place}; check from_model and "
            "from_project (and from_s3_bucket for a run kept in S3)"
        )
    chosen = [s for s in steps if not_after_step is None or s <= not_after_step]
    if not chosen:
        raise UserError(
            f"{where}(not_after_step={not_after_step!r}): {describe} has no checkpoint at or before "
            f"step {not_after_step} (its committed steps: {steps}); pass not_after_step >= {steps[0]}"
        )
    step = chosen[-1]
    if s3_source is not None:
        download_step(s3, bucket, key, step, dest_root, verbose=verbose)
    else:
        source = checkpoint.step_dir(source_root, step)

        def fill(staging: Path) -> None:
            checkpoint.check_adapter(source, checkpoint.read_manifest(source))  # named at the source
            shutil.copytree(source, staging, dirs_exist_ok=True)

        place_step(dest_root, step, str(source), fill)
    checkpoint.write_commit(dest_root, step)  # last, after the folder is placed
    if verbose:
        print(f"forked step {step} of {describe} from {place} into {dest_root}")
    return step
