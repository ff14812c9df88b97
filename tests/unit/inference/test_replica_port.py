"""A replica never trusts someone else's server on its port: the port must bind before the
server is spawned, and the healthy server must list the replica's served model name (managed
etcd likewise must list the member art-mega started). The server holding the port is a real
HTTP server on loopback (a stand-in answering only vLLM's /health, /v1/models and
/v1/completions: what is under test is art-mega's check, not vLLM)."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from art_mega.agent.ports import free_port
from art_mega.errors import ReplicaStartError
from art_mega.inference.protocol import ReplicaLaunch
from art_mega.inference.replica import LocalReplica, check_port_free, spawn_replica
from art_mega.launch.local_topology import local_plan
from art_mega.preflight.etcd import not_our_member, start_managed_etcd
from art_mega.preflight.protocol import EtcdStartRequest, HostFacts
from art_mega.topology import EndpointSpec
from art_mega.topology.compiled import ReplicaSpec


class StandIn(ThreadingHTTPServer):
    """An OpenAI-style server on 127.0.0.1: `models` is what GET /v1/models answers (a JSON
    body, or `models_status` with a plain-text body when that is not 200)."""

    def __init__(self, models: object, models_status: int = 200) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.models = models
        self.models_status = models_status
        self.completions: list[dict] = []

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def _reply(self, status: int, body: object) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, "")
        elif self.path == "/v1/models":
            status = self.server.models_status
            self._reply(status, self.server.models if status == 200 else "Not Found")
        else:
            self._reply(404, "Not Found")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.completions.append(body)
        self._reply(200, {"choices": [{"text": "x"}]})

    def log_message(self, *args: object) -> None:
        pass


def serving(models: object, models_status: int = 200) -> Iterator[StandIn]:
    server = StandIn(models, models_status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def other_run() -> Iterator[StandIn]:
    """Another program's server that serves the model "yes-no"."""
    yield from serving({"object": "list", "data": [{"id": "yes-no", "object": "model"}]})


def spec(port: int) -> ReplicaSpec:
    return ReplicaSpec(
        name="vllm",
        index=0,
        host_ids=("local",),
        gpu_ids=(("local", ()),),
        endpoint=EndpointSpec(host="127.0.0.1", port=port),
        tp=1,
        pp=1,
        dp=1,
        shared_gpus=False,
    )


def launch(log_dir: Path, python: str = sys.executable) -> ReplicaLaunch:
    return ReplicaLaunch(
        model="/models/tiny",
        served_model_name="tiny",
        log_dir=str(log_dir),
        python=python,
        ready_timeout_s=20.0,
    )


async def exited_replica(port: int, log_dir: Path) -> LocalReplica:
    """A replica whose server process exited at once, as vLLM's does when its port is taken."""
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", "raise SystemExit(1)")
    await process.wait()
    return LocalReplica(
        spec=spec(port),
        launch=launch(log_dir),
        process=process,
        log_path=log_dir / "vllm-0.log",
        log_offset=0,
    )


def test_a_port_another_server_holds_is_refused_before_anything_is_spawned(
    other_run: StandIn, tmp_path: Path
):
    with pytest.raises(ReplicaStartError) as caught:
        check_port_free(spec(other_run.port))
    message = str(caught.value)
    assert message.startswith(f"replica vllm-0: port {other_run.port} on host 127.0.0.1 cannot be bound (")
    assert message.endswith(
        "another process holds it; choose another InferenceSpec.api_port or stop that process"
    )
    assert caught.value.replica == "vllm-0"
    # spawn_replica checks first: no process was started, so no log was opened either
    with pytest.raises(ReplicaStartError, match=f"port {other_run.port} on host 127.0.0.1"):
        asyncio.run(spawn_replica(spec(other_run.port), launch(tmp_path)))
    assert list(tmp_path.iterdir()) == []
    assert other_run.completions == []


def test_a_free_port_and_one_freed_again_pass():
    check_port_free(spec(free_port()))
    with StandIn({"data": []}) as server:
        port = server.port
    check_port_free(spec(port))


def test_an_unresolvable_host_is_refused_in_one_sentence():
    bad = spec(free_port()).model_copy(
        update={"endpoint": EndpointSpec(host="no-such-host.invalid", port=8000)}
    )
    with pytest.raises(
        ReplicaStartError, match=r"its host address 'no-such-host.invalid' does not resolve here"
    ):
        check_port_free(bad)


async def test_a_healthy_server_serving_another_model_is_not_ready(other_run: StandIn, tmp_path: Path):
    replica = await exited_replica(other_run.port, tmp_path)
    with pytest.raises(ReplicaStartError) as caught:
        await replica.wait_ready()
    message = str(caught.value)
    assert f"(pid {replica.pid}, http://127.0.0.1:{other_run.port})" in message
    assert (
        "is answered on its port by a server that serves ['yes-no'], not 'tiny'; "
        f"another process holds port {other_run.port}: stop it or choose another InferenceSpec.api_port"
    ) in message
    assert other_run.completions == []  # no warm-up went to the other run's server


@pytest.mark.parametrize(
    ("models", "status", "answer"),
    [
        ("", 404, "a server that failed GET /v1/models ("),
        (["tiny"], 200, "a server whose GET /v1/models is not an OpenAI model list"),
        ({"data": [{"name": "tiny"}]}, 200, "a server whose GET /v1/models is not an OpenAI model list"),
    ],
)
async def test_a_server_without_an_openai_model_list_is_not_ready(
    models: object, status: int, answer: str, tmp_path: Path
):
    for server in serving(models, status):
        replica = await exited_replica(server.port, tmp_path)
        with pytest.raises(ReplicaStartError) as caught:
            await replica.wait_ready()
        assert f"is answered on its port by {answer}" in str(caught.value)
        assert f"another process holds port {server.port}" in str(caught.value)
        assert server.completions == []


async def test_the_server_serving_the_replicas_model_is_ready_and_warmed_up(tmp_path: Path):
    for server in serving({"data": [{"id": "base"}, {"id": "tiny"}, {"id": "tiny@3"}]}):
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(30)")
        try:
            replica = LocalReplica(
                spec=spec(server.port),
                launch=launch(tmp_path),
                process=process,
                log_path=tmp_path / "vllm-0.log",
                log_offset=0,
            )
            seconds = await replica.wait_ready()
        finally:
            process.kill()
            await process.wait()
        assert 0 < seconds < 20
        assert [(c["model"], c["prompt"], c["max_tokens"]) for c in server.completions] == [
            ("tiny", "hello", 1)
        ]


def host() -> HostFacts:
    return HostFacts(
        host_id="local",
        hostname="box",
        boot_id="b",
        python_version="3.11.9",
        python_executable="/usr/bin/python3",
        art_mega_version="0",
        art_mega_files_sha256="0" * 64,
        packages={},
        env={},
        gpus=(),
    )


def plan_ports(**ports: int) -> tuple[int, int]:
    plan = local_plan(
        host(),
        None,
        artifact_root="/tmp/art",
        cache_root="/tmp/cache",
        vllm_python="/opt/vllm/bin/python",
        **ports,
    )
    (replica,) = plan.topology.replicas
    assert replica.endpoint.host == "127.0.0.1"
    return plan.topology.trainer.master_port, replica.endpoint.port


def test_two_local_plans_without_ports_get_different_free_ones():
    first, second = plan_ports(), plan_ports()
    assert len({*first, *second}) == 4
    for port in (*first, *second):
        check_port_free(spec(port))


def test_ports_given_to_a_local_plan_are_used_as_given():
    assert plan_ports(master_port=29511, api_port=8400) == (29511, 8400)


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian etcd-server)")
async def test_managed_etcd_is_trusted_only_as_the_member_art_mega_started():
    etcd = await start_managed_etcd(EtcdStartRequest(advertise_host="127.0.0.1"))
    try:
        argv = Path(f"/proc/{etcd.process.pid}/cmdline").read_bytes().decode().split("\0")
        peer = argv[argv.index("--listen-peer-urls") + 1]
        async with httpx.AsyncClient(trust_env=False, timeout=5.0) as http:
            assert await not_our_member(http, etcd.endpoint.url, peer) is None
            other = await not_our_member(http, etcd.endpoint.url, "http://127.0.0.1:1")
            for server in serving({"data": []}):
                not_etcd = await not_our_member(http, f"http://127.0.0.1:{server.port}", peer)
    finally:
        await etcd.stop()
    assert other == (
        f"the etcd answering at {etcd.endpoint.url} has members with peer URLs ['{peer}'], not "
        "http://127.0.0.1:1; another process holds the port; start again (art-mega picks new free ports)"
    )
    assert not_etcd is not None
    assert not_etcd.startswith(
        f"the etcd answering at http://127.0.0.1:{server.port} did not list its members ("
    )
