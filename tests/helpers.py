"""Builders shared by tests (importable as `helpers`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from art_mega.topology import ClusterSpec, EndpointSpec, HostSpec, compile_topology


def loopback_cluster(n: int, cpu_slots: int = 1, tmp: str = "/tmp/art-mega-test", **kw) -> ClusterSpec:
    """A cluster of `n` hosts on 127.0.0.(i+1), port 0 (each agent picks a free port)."""
    hosts = tuple(
        HostSpec(
            host_id=f"host{i}",
            node_rank=i,
            worker_address=EndpointSpec(host=f"127.0.0.{i + 1}", port=0),
            cpu_slots=cpu_slots,
        )
        for i in range(n)
    )
    return ClusterSpec(
        hosts=hosts,
        controller_host_id="host0",
        artifact_root=f"{tmp}/artifacts",
        cache_root=f"{tmp}/cache",
        allow_shared_kernel=True,
        **kw,
    )


def loopback_topology(n: int, cpu_slots: int = 1, **kw):
    return compile_topology(loopback_cluster(n, cpu_slots, **kw))


def require_vllm() -> None:
    """Skip the calling test when no vLLM interpreter is installed (the backend's own lookup)."""
    import pytest

    from art_mega.backend import default_vllm_python
    from art_mega.errors import UserError

    try:
        default_vllm_python()
    except UserError as exc:
        pytest.skip(str(exc))


def program_workdir(tmp_path: Path, monkeypatch: Any, *, without_wandb: bool = False) -> Path:
    """Run an ART-style program in `tmp_path` (its `.art-mega/` lands there) with the shared
    art-mega model cache; `without_wandb` unsets WANDB_API_KEY so nothing reports to W&B."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ART_MEGA_CACHE", str(Path.home() / ".cache" / "art-mega"))
    if without_wandb:
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve the ASGI `app` (uvicorn, on a thread of its own, so sync and async tests alike can
    call it) on a free loopback port while the block runs; yields its http://127.0.0.1:PORT."""
    import threading
    import time

    import uvicorn

    from art_mega.agent.ports import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
