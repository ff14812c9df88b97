"""ART's `art.local.backend.LocalBackend`, for programs that port by changing the import: the
embedded single-host `MegatronBackend` (one agent on loopback, one trainer rank, one vLLM replica)."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from art_mega.backend import MegatronBackend
from art_mega.errors import HyperParameterError, UserError

log = logging.getLogger(__name__)

AUTOMATIC_GPU_PRICES_USD = {"H200": 3.0}
"""ART 0.5.18's automatic per-GPU price in USD per hour, by a part of the GPU's name (upper case)."""


def per_gpu_price(names: Sequence[str]) -> float | None:
    """ART's automatic per-GPU price (USD per hour) for the visible GPUs named `names` (CUDA's
    or NVML's device names): the price every one of them has in `AUTOMATIC_GPU_PRICES_USD`;
    None when there is no GPU, a GPU of an unpriced kind, or GPUs of differently priced kinds
    (ART logs no cost rather than guess)."""
    prices = set()
    for name in names:
        price = next((usd for kind, usd in AUTOMATIC_GPU_PRICES_USD.items() if kind in name.upper()), None)
        if price is None:
            return None
        prices.add(price)
    return prices.pop() if len(prices) == 1 else None


def priced_gpu_count(config: Mapping[str, Any] | None, visible: int) -> int:
    """ART's count of the GPUs a model's step is charged for: the GPUs in `trainer_gpu_ids` and
    `inference_gpu_ids` of its `_internal_config` `config` (each GPU once), else all `visible`
    GPUs (what art-mega's local topology then trains and serves on)."""
    config = config or {}
    listed = set(config.get("trainer_gpu_ids") or ()) | set(config.get("inference_gpu_ids") or ())
    return len(listed) if listed else visible


def _check_price(value: Any) -> float | None:
    """`gpu_cost_per_hour_usd` as a float (None stays None).

    Raises:
        HyperParameterError: not a number, a bool, not finite, or below 0.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise HyperParameterError(
            f"LocalBackend(gpu_cost_per_hour_usd={value!r}) must be a finite number of US dollars per "
            "GPU per hour, at least 0, e.g. 3.0, or None for ART's automatic price (H200: 3.0)",
            "gpu_cost_per_hour_usd",
            value,
        )
    return float(value)


def _visible_gpu_names() -> tuple[str, ...]:
    """The names of the GPUs CUDA programs started here can use (NVML's, no torch import)."""
    from art_mega.launch.local_topology import visible_gpus
    from art_mega.preflight.host_facts import collect_host_facts

    facts = collect_host_facts()
    by_id = {gpu.uuid: gpu.name for gpu in facts.gpus}
    by_id.update({gpu.index: gpu.name for gpu in facts.gpus if gpu.parent_uuid is None})
    return tuple(by_id[device] for device in visible_gpus(facts))


class LocalBackend(MegatronBackend):
    """ART's LocalBackend: trains and serves one model on this machine.

    Args:
        in_process: ART runs its model service in this process when True; art-mega always runs
            the trainer rank and vLLM as child processes of a loopback agent, which changes no
            result: True is accepted with one logged line saying so.
        path: the directory runs live under, as in ART (`<path>/<project>/models/<name>`:
            history, checkpoints, logs); None: `./.art`, as ART's (a run that exists only under
            art-mega's earlier default `./.art-mega/artifacts` is read there, with one logged line).
        gpu_cost_per_hour_usd: ART's per-GPU price in USD per hour for the `costs/gpu` row of
            each train step (`automatic_gpu_cost_per_hour_usd`); None: ART's automatic price
            when every visible GPU is of a priced kind (`AUTOMATIC_GPU_PRICES_USD`), else no row.
        enable_expert_replay: ART replays vLLM's routed experts in its Megatron MoE trainer when
            True (its default); art-mega's trainer routes each token itself, as ART does with
            False: False is what art-mega does, True (the default) is accepted silently, as
            it changes nothing for the dense models most programs train. Not a bool: refused.
        options: `MegatronBackend`'s keyword arguments (lora_rank, seq_len, max_model_len, ...);
            not `runtime` (a LocalBackend builds its own).

    Raises:
        UserError: `in_process` or `enable_expert_replay` is not a bool, `path` is not a non-empty string or None,
            `runtime` is given; and what `MegatronBackend` raises for `options`.
        HyperParameterError: `gpu_cost_per_hour_usd` is not None or a finite number >= 0.
    """

    def __init__(
        self,
        *,
        in_process: bool = False,
        path: str | None = None,
        gpu_cost_per_hour_usd: float | None = None,
        enable_expert_replay: bool = True,
        **options: Any,
    ) -> None:
        for name, value in (("in_process", in_process), ("enable_expert_replay", enable_expert_replay)):
            if not isinstance(value, bool):
                raise UserError(f"LocalBackend({name}={value!r}) must be True or False")
        if in_process:
            log.warning(
                "LocalBackend(in_process=True) is accepted: art-mega runs the trainer and vLLM as child "
                "processes of a local agent (ART's default placement), which changes no result"
            )
        if not enable_expert_replay:
            log.warning(
                "LocalBackend(enable_expert_replay=False) is accepted: art-mega's trainer never replays "
                "vLLM's routed experts; it routes every token itself, as ART does with False"
            )
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise UserError(
                f"LocalBackend(path={path!r}) must be a directory path string, e.g. path='.art', or None"
            )
        price = _check_price(gpu_cost_per_hour_usd)
        if "runtime" in options:
            raise UserError(
                "LocalBackend(runtime=...) is not accepted: a LocalBackend starts its own local runtime; "
                "pass a started ArtRuntime to MegatronBackend(runtime) instead"
            )
        super().__init__(None, **options)
        self.path = path
        self.gpu_cost_per_hour_usd = price
        self._automatic_price: tuple[float | None, int] | None = None

    def automatic_gpu_cost_per_hour_usd(self, model: Any) -> float | None:
        """ART's hourly price of `model`'s GPUs in USD, what its train rows' `costs/gpu` is
        charged at: the per-GPU price (`gpu_cost_per_hour_usd`, else `per_gpu_price` of the
        visible GPUs) times `priced_gpu_count`. None (no `costs/gpu` row) without a price;
        0.0 when a price is given and the model holds no GPU (a CPU host), where ART leaves the
        row out, so a given price always shows in the history."""
        if self._automatic_price is None:  # NVML is asked once: the host's GPUs do not change
            names = _visible_gpu_names()
            self._automatic_price = (per_gpu_price(names), len(names))
        automatic, visible = self._automatic_price
        per_gpu = self.gpu_cost_per_hour_usd if self.gpu_cost_per_hour_usd is not None else automatic
        if per_gpu is None:
            return None
        return per_gpu * priced_gpu_count(getattr(model, "_internal_config", None), visible)

    def _artifact_root(self) -> Any:
        """`path` (absolute) when given, else the default root; a started runtime's wins."""
        import os
        from pathlib import Path

        if self._runtime is not None or self.path is None:
            return super()._artifact_root()
        return Path(os.path.abspath(self.path))

    async def _local_runtime(self, model: Any) -> Any:
        import os

        from art_mega.trainer.checkpoint import root_holding_run

        if self.path is None:
            root = str(root_holding_run("artifact_root", model.project, model.name))
        else:
            root = os.path.abspath(self.path)
        return await self._start_local(model, root)
