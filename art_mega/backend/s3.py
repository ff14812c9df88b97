"""MegatronBackend's checkpoints in S3 and forks: push, pull, fork from another run."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from art_mega.backend.serving import remote_trainer_hosts
from art_mega.errors import UserError
from art_mega.trainer import checkpoint

log = logging.getLogger(__name__)


class S3Mixin:
    """Checkpoints in S3 and forks (part of `MegatronBackend`)."""

    # ------------------------------------------------------------------ checkpoints in S3 / forks

    def _artifact_root(self) -> Path:
        """The folder runs live under before `register`: the runtime's artifact_root, else the
        local default (`launch.context.default_artifact_root`)."""
        if self._runtime is not None:
            return Path(self._runtime.topology.cluster.artifact_root)
        from art_mega.launch.context import default_artifact_root

        return Path(default_artifact_root())

    def _offline_run_dir(self, model: Any, where: str) -> Path:
        """`model`'s run folder, for a call that writes checkpoints no rank is training.

        Raises:
            UserError: this backend has `model` registered; the runtime's artifact_root is
                host-local with trainer ranks on other hosts (they would not see the files).
        """
        name = getattr(model, "name", model)
        if self._model is not None and self._model.name == name:
            raise UserError(
                f"{where}: model {name!r} is registered with this backend and its ranks hold its "
                "checkpoints; call it before model.register(backend)"
            )
        if self._runtime is not None and remote_trainer_hosts(self._runtime.topology):
            raise UserError(
                f"{where}: the runtime's artifact_root is host-local and trainer ranks run on other "
                "hosts, which would not see the copied checkpoint; use a shared artifact_root"
            )
        return checkpoint.run_dir(self._artifact_root(), model.project, model.name)

    async def _experimental_push_to_s3(
        self,
        model: Any,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> None:
        """ART's push: upload `model`'s run folder (committed checkpoints, history, logs) to
        `s3://<s3_bucket or $BACKUP_BUCKET>/[<prefix>/]<project>/models/<name>/`, the commit
        pointer last (`art_mega.trainer.s3.push_run`). Runs in a worker thread.

        Raises:
            UserError: `delete=True` (not supported); no bucket named; the bucket is missing
                (differs from ART, which creates it) or unreachable; the run folder is missing.
            CheckpointFileError: the run's pointer or committed manifest is malformed.
        """
        from art_mega.trainer import s3

        if delete:
            raise UserError(
                "_experimental_push_to_s3(delete=True) is not supported: art-mega never removes "
                "objects from the bucket; leave delete out"
            )
        bucket = s3.bucket_name(s3_bucket, "_experimental_push_to_s3")
        run_dir = checkpoint.run_dir(self._artifact_root(), model.project, model.name)
        await asyncio.to_thread(
            s3.push_run, run_dir, bucket, s3.run_key(model.project, model.name, prefix), verbose=verbose
        )

    async def _experimental_pull_from_s3(
        self,
        model: Any,
        *,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        only_step: int | str | None = None,
        step: int | None = None,
        exclude: list[str] | None = None,
        latest_only: bool = False,
    ) -> None:
        """ART's pull: download `model`'s run from the bucket into its local run folder, committed
        through `art_mega.trainer.checkpoint` so `register` resumes from it (`trainer.s3.pull_run`).

        `only_step`: None every committed step (and history, logs); an int that step; "latest" the
        bucket's committed step. `step` and `latest_only` are ART's deprecated spellings of it.

        Raises:
            UserError: `delete=True` or `exclude` (not supported); the model is registered here;
                no bucket; the bucket is missing or unreachable, or holds committed checkpoints of
                the run but not `only_step`; a committed local step differs from the bucket's. A
                bucket without a committed checkpoint of the run pulls nothing (one logged line),
                as in ART: a first run goes on from its base model.
            CheckpointFileError: a manifest is malformed or does not match its adapter.
        """
        from art_mega.trainer import s3

        where = "_experimental_pull_from_s3"
        if delete or exclude is not None:
            raise UserError(
                f"{where}(delete={delete!r}, exclude={exclude!r}) is not supported: art-mega pulls "
                "the run's committed checkpoints (all, or only_step) and its files; leave both out"
            )
        if step is not None:
            only_step = step
        elif latest_only and only_step is None:
            only_step = "latest"
        if (
            only_step is not None
            and only_step != "latest"
            and (isinstance(only_step, bool) or not isinstance(only_step, int) or only_step < 0)
        ):
            raise UserError(f"{where}(only_step={only_step!r}) must be a step number >= 0, 'latest' or None")
        run_dir = self._offline_run_dir(model, where)
        bucket = s3.bucket_name(s3_bucket, where)
        await asyncio.to_thread(
            s3.pull_run,
            run_dir,
            bucket,
            s3.run_key(model.project, model.name, prefix),
            only_step,
            verbose=verbose,
        )

    async def _experimental_fork_checkpoint(
        self,
        model: Any,
        from_model: str,
        from_project: str | None = None,
        from_s3_bucket: str | None = None,
        not_after_step: int | None = None,
        verbose: bool = False,
        prefix: str | None = None,
    ) -> None:
        """ART's fork: start `model` from the checkpoint of `from_model` (of `from_project`,
        default `model.project`) at the newest committed step <= `not_after_step` (the newest
        when None), read from the local artifact root or, with `from_s3_bucket`, from
        `s3://<bucket>/[<prefix>/]<from_project>/models/<from_model>`. Call it before `register`.

        The step keeps its number, as in ART, and is committed in `model`'s run, so `register`
        resumes from it: the next `train` makes step n+1. The whole checkpoint folder is copied:
        the adapter, and the rank state files, so the forked run also continues the source's
        optimizer state (Adam moments, step count) where ART's fork carries the adapter only;
        on another trainer layout the moments are re-sharded (`TrainerEngine.load_portable`).

        Raises:
            UserError: `model` is registered here; `model` already has a committed checkpoint
                (ART would add the step folder beside them); `from_model` has no committed
                checkpoint in that project (or bucket); none at or before `not_after_step`;
                the bucket is missing or unreachable.
            CheckpointFileError: the chosen step's manifest is malformed or does not match its adapter.
        """
        from art_mega.trainer import s3

        where = "_experimental_fork_checkpoint"
        if not_after_step is not None and (
            isinstance(not_after_step, bool) or not isinstance(not_after_step, int) or not_after_step < 0
        ):
            raise UserError(f"{where}(not_after_step={not_after_step!r}) must be a step number >= 0 or None")
        if not isinstance(from_model, str) or not from_model:
            raise UserError(f"{where}(from_model={from_model!r}) must name the model to fork from")
        project = from_project or model.project
        dest = checkpoint.checkpoints_dir(self._offline_run_dir(model, where))
        describe = f"model {from_model!r} of project {project!r}"
        if from_s3_bucket is not None:
            bucket = s3.bucket_name(from_s3_bucket, where)
            source = (bucket, s3.run_key(project, from_model, prefix))
            await asyncio.to_thread(
                s3.fork_step,
                None,
                dest,
                not_after_step=not_after_step,
                s3_source=source,
                describe=describe,
                verbose=verbose,
            )
        else:
            root = checkpoint.checkpoints_dir(checkpoint.run_dir(self._artifact_root(), project, from_model))
            await asyncio.to_thread(
                s3.fork_step,
                root,
                dest,
                not_after_step=not_after_step,
                s3_source=None,
                describe=describe,
                verbose=verbose,
            )
