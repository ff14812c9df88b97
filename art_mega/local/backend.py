"""ART's `art.local.backend.LocalBackend`, for programs that port by changing the import: the
embedded single-host `MegatronBackend` (one agent on loopback, one trainer rank, one vLLM replica)."""

from __future__ import annotations

from typing import Any

from art_mega.backend import MegatronBackend
from art_mega.errors import UserError


class LocalBackend(MegatronBackend):
    """ART's LocalBackend: trains and serves one model on this machine.

    Args:
        in_process: ART runs its model service in this process when True; art-mega always runs
            the trainer rank and vLLM as child processes of a loopback agent, so only False
            (ART's default) is accepted.
        path: the directory runs live under, as in ART (`<path>/<project>/models/<name>`:
            history, checkpoints, logs); None: `./.art-mega/artifacts` (ART's is `./.art`).
        gpu_cost_per_hour_usd: ART's `costs/gpu` price; art-mega logs no GPU cost, so only None.
        options: `MegatronBackend`'s keyword arguments (lora_rank, seq_len, max_model_len, ...);
            not `runtime` (a LocalBackend builds its own).

    Raises:
        UserError: `in_process` is not False, `path` is not a non-empty string or None,
            `gpu_cost_per_hour_usd` is not None, `runtime` is given; and what `MegatronBackend`
            raises for `options`.
    """

    def __init__(
        self,
        *,
        in_process: bool = False,
        path: str | None = None,
        gpu_cost_per_hour_usd: float | None = None,
        **options: Any,
    ) -> None:
        if in_process is not False:
            raise UserError(
                f"LocalBackend(in_process={in_process!r}) is not supported: art-mega runs the trainer "
                "and vLLM as child processes of a local agent; leave in_process out"
            )
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise UserError(
                f"LocalBackend(path={path!r}) must be a directory path string, e.g. path='.art', or None"
            )
        if gpu_cost_per_hour_usd is not None:
            raise UserError(
                f"LocalBackend(gpu_cost_per_hour_usd={gpu_cost_per_hour_usd!r}) is not supported: "
                "art-mega logs no costs/gpu rows; leave it out"
            )
        if "runtime" in options:
            raise UserError(
                "LocalBackend(runtime=...) is not accepted: a LocalBackend starts its own local runtime; "
                "pass a started ArtRuntime to MegatronBackend(runtime) instead"
            )
        super().__init__(None, **options)
        self.path = path

    def _artifact_root(self) -> Any:
        """`path` (absolute) when given, else the default root; a started runtime's wins."""
        import os
        from pathlib import Path

        if self._runtime is not None or self.path is None:
            return super()._artifact_root()
        return Path(os.path.abspath(self.path))

    async def _local_runtime(self, model: Any) -> Any:
        import os

        from art_mega.launch.context import default_artifact_root

        root = default_artifact_root() if self.path is None else os.path.abspath(self.path)
        return await self._start_local(model, root)
