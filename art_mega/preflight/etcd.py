"""Managed etcd, the metadata store (NIXL's, among others): start, prove from every host, stop.

Agent side: `ManagedEtcd` finds the binary (given path, $ART_MEGA_ETCD_BIN, or PATH), checks its
version (and sha256 when pinned), starts one member on free ports with a temp data dir, and polls
health. Controller side: `start_metadata_store` starts it on the controller host and checks that
every host can reach it and put/get a key through it (client: etcd3gw, see FACTS.md); an
explicitly given store gets the same check (`check_from_every_host`), version and API included.
The probe keys are deleted after the check.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from art_mega.agent.client import AgentClient
from art_mega.agent.ports import free_port
from art_mega.agent.supervisor import spawn_child, stop_process
from art_mega.errors import AgentError, PreflightError
from art_mega.preflight.protocol import (
    ETCD_CHECK,
    ETCD_START,
    ETCD_STOP,
    EtcdCheckRequest,
    EtcdCheckResponse,
    EtcdStartRequest,
    EtcdStartResponse,
)
from art_mega.topology import EndpointSpec

MIN_VERSION = (3, 4)
ETCD_ENV = "ART_MEGA_ETCD_BIN"


def find_binary(given: str | None) -> str:
    """The etcd binary to run: `given`, else $ART_MEGA_ETCD_BIN, else `etcd` on PATH.

    Raises:
        FileNotFoundError: naming where it looked.
    """
    candidate = given or os.environ.get(ETCD_ENV) or shutil.which("etcd")
    if not candidate or not Path(candidate).is_file() or not os.access(candidate, os.X_OK):
        raise FileNotFoundError(
            f"no etcd binary (looked at {given or os.environ.get(ETCD_ENV) or 'PATH'}); install etcd-server or set {ETCD_ENV}"
        )
    return candidate


@dataclass
class ManagedEtcd:
    """One etcd member started by this agent."""

    process: asyncio.subprocess.Process
    endpoint: EndpointSpec
    data_dir: str
    version: str

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM its process group, SIGKILL after `grace_s` seconds, delete the data dir."""
        await stop_process(self.process, grace_s)
        shutil.rmtree(self.data_dir, ignore_errors=True)


async def _version(binary: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        binary, "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 10)
    match = re.search(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)", out.decode(errors="replace"))
    if not match:
        raise ValueError(f"{binary} --version did not print an etcd version")
    return ".".join(match.groups())


async def start_managed_etcd(request: EtcdStartRequest, launch_id: str = "") -> ManagedEtcd:
    """Start etcd per `request` and wait until /health says true.

    Its data dir is a new `art-mega-etcd-<launch_id>-*` folder in the temp dir (deleted on stop),
    so what one launch leaves behind can be told from another's.

    Raises:
        FileNotFoundError, ValueError: no binary, a version below 3.4, or a sha256 mismatch.
        RuntimeError: it exited early (with the tail of its log), was not healthy in time, or
            the healthy server on its client port is another etcd (`not_our_member`).
    """
    binary = find_binary(request.binary)
    if request.sha256:
        actual = hashlib.sha256(Path(binary).read_bytes()).hexdigest()
        if actual != request.sha256.lower():
            raise ValueError(f"{binary} has sha256 {actual}, not the pinned {request.sha256}")
    version = await _version(binary)
    if tuple(int(p) for p in version.split(".")[:2]) < MIN_VERSION:
        raise ValueError(f"{binary} is etcd {version}; need >= {MIN_VERSION[0]}.{MIN_VERSION[1]}")
    host = request.advertise_host
    client_port, peer_port = free_port(host), free_port(host)
    client = EndpointSpec(host=host, port=client_port)
    peer = EndpointSpec(host=host, port=peer_port)
    data_dir = tempfile.mkdtemp(prefix=f"art-mega-etcd-{launch_id}-" if launch_id else "art-mega-etcd-")
    log_path = Path(data_dir) / "etcd.log"
    argv = [
        binary,
        "--name", "art-mega",
        "--data-dir", str(Path(data_dir) / "member"),
        "--listen-client-urls", client.url,
        "--advertise-client-urls", client.url,
        "--listen-peer-urls", peer.url,
        "--initial-advertise-peer-urls", peer.url,
        "--initial-cluster", f"art-mega={peer.url}",
        "--initial-cluster-state", "new",
        # one member: nobody to wait for, so elect at once (healthy after 0.25 s, not 0.48 s)
        "--heartbeat-interval", "10",
        "--election-timeout", "100",
    ]  # fmt: skip
    log = open(log_path, "wb")
    try:
        process = await spawn_child(argv, stdout=log, stderr=log)
    finally:
        log.close()
    etcd = ManagedEtcd(process, client, data_dir, version)
    deadline = time.monotonic() + request.timeout_s
    async with httpx.AsyncClient(trust_env=False, timeout=1.0) as http:
        while True:
            if process.returncode is not None:
                tail = log_path.read_text(errors="replace")[-800:]
                await etcd.stop()
                raise RuntimeError(f"etcd exited with code {process.returncode}: {tail}")
            try:
                reply = await http.get(client.url + "/health")
                healthy = reply.status_code == 200 and reply.json().get("health") in (True, "true")
            except (httpx.HTTPError, ValueError):
                healthy = False
            if healthy:
                stranger = await not_our_member(http, client.url, peer.url)
                if stranger is None:
                    return etcd
                await etcd.stop()
                raise RuntimeError(stranger)
            if time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-800:]
                await etcd.stop()
                raise RuntimeError(f"etcd was not healthy after {request.timeout_s:g} s: {tail}")
            await asyncio.sleep(0.05)


async def not_our_member(http: httpx.AsyncClient, client_url: str, peer_url: str) -> str | None:
    """None when the etcd answering at `client_url` is the one member art-mega started with
    `peer_url`; else one sentence saying what answered.

    /health = true says only that some etcd answers on the port: one that another program
    started there first (ours then fails to bind) would otherwise become this launch's store.
    """
    fix = "another process holds the port; start again (art-mega picks new free ports)"
    try:
        reply = await http.post(client_url + "/v3/cluster/member/list", json={})
        members = reply.json()["members"]
        urls = [url for member in members for url in member.get("peerURLs", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"the etcd answering at {client_url} did not list its members ({type(exc).__name__}: {exc}); {fix}"
    if urls != [peer_url]:
        return f"the etcd answering at {client_url} has members with peer URLs {urls}, not {peer_url}; {fix}"
    return None


def etcd_api_problem(status: int, reason: str, body: str) -> tuple[str | None, str]:
    """Why an answer to `GET /version` is not an etcd >= 3.4 (None: it is) and the version seen.

    etcd answers `{"etcdserver": "3.4.23", "etcdcluster": "3.4.0"}`; from 3.4 on its JSON gateway
    is at `/v3/` (3.3 had `/v3beta/`, which art-mega's client and NIXL do not use).
    """
    if status != 200:
        return f"it is not etcd: GET /version answered HTTP {status} {reason}".rstrip(), ""
    try:
        server = json.loads(body)["etcdserver"]
        version = tuple(int(p) for p in str(server).split(".")[:2])
    except (ValueError, KeyError, TypeError):
        return f"it is not etcd: GET /version answered {body[:80]!r}, not etcd's version JSON", ""
    if len(version) < 2 or version < MIN_VERSION:
        return (
            f"it is etcd {server}, and art-mega needs etcd >= {MIN_VERSION[0]}.{MIN_VERSION[1]} "
            "(the v3 JSON gateway at /v3/)",
            str(server),
        )
    return None, str(server)


def check_endpoint(request: EtcdCheckRequest) -> EtcdCheckResponse:
    """From this host: the version/API check, GET /health, then put, get and delete `key`.

    The same check serves the managed etcd and an explicitly given one: `GET /version` must
    name etcd >= 3.4 and its v3 JSON gateway must serve the put (see `etcd_api_problem`). The
    probe key is deleted again whenever the put went through (blocking; errors are the answer).
    """
    import etcd3gw
    from etcd3gw.exceptions import Etcd3Exception

    started = time.monotonic()
    endpoint = EndpointSpec.parse(request.endpoint.replace("http://", "tcp://"))
    put = False
    client = None
    try:
        with httpx.Client(trust_env=False, timeout=request.timeout_s) as http:
            version = http.get(endpoint.url + "/version")
            problem, _ = etcd_api_problem(version.status_code, version.reason_phrase, version.text)
            if problem:
                return EtcdCheckResponse(ok=False, error=problem)
            health = http.get(endpoint.url + "/health")
            if health.status_code != 200 or health.json().get("health") not in (True, "true"):
                return EtcdCheckResponse(
                    ok=False, error=f"unhealthy: HTTP {health.status_code} {health.text[:200]}"
                )
        client = etcd3gw.client(
            host=endpoint.host, port=endpoint.port, timeout=request.timeout_s, api_path="/v3/"
        )
        try:
            client.put(request.key, request.value)
        except Etcd3Exception as exc:
            detail = (exc.detail_text or "").strip()[:120]
            return EtcdCheckResponse(
                ok=False,
                error=f"its v3 JSON gateway refused a put at /v3/kv/put ({type(exc).__name__}: "
                f"{' '.join(str(a) for a in exc.args) or detail})",
            )
        put = True
        got = client.get(request.key)
        if not got or (got[0].decode() if isinstance(got[0], bytes) else got[0]) != request.value:
            return EtcdCheckResponse(ok=False, error=f"put/get of {request.key} returned {got!r}")
        client.delete(request.key)
        put = False
    except httpx.ConnectError as exc:
        return EtcdCheckResponse(
            ok=False,
            error=f"cannot connect (ConnectError: {exc}); check that etcd serves clients at that port (2379 by default) "
            "and that this host can reach it",
        )
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        # A port that accepts and closes at once: a FIN reads as a disconnect, an RST (the
        # request was still unread when it closed) as a reset; either way no HTTP came back.
        how = "reset" if isinstance(exc, httpx.ReadError) else "closed"
        return EtcdCheckResponse(
            ok=False,
            error=f"it answered no HTTP (the connection was {how} without a response); give etcd's "
            "client port (2379 by default), not its peer port",
        )
    except Exception as exc:  # report any client failure as this host's answer
        return EtcdCheckResponse(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        if put and client is not None:
            with contextlib.suppress(Exception):  # the answer already says what failed
                client.delete(request.key)
    return EtcdCheckResponse(ok=True, seconds=time.monotonic() - started)


async def check_from_every_host(clients: Mapping[str, AgentClient], endpoint: str, launch_id: str) -> None:
    """Every host must reach `endpoint` and put/get its own key through it.

    Raises:
        PreflightError: naming each host that cannot (and its error).
    """
    requests = {
        host: EtcdCheckRequest(
            endpoint=endpoint, key=f"/art-mega/{launch_id}/probe/{host}", value=f"{launch_id}:{host}"
        )
        for host in clients
    }
    replies = await asyncio.gather(
        *(clients[h].call(ETCD_CHECK, r, timeout_s=r.timeout_s * 3 + 10) for h, r in requests.items()),
        return_exceptions=True,
    )
    by_error: dict[str, list[str]] = {}
    for host, reply in zip(requests, replies):
        if isinstance(reply, BaseException):
            by_error.setdefault(str(reply), []).append(host)
        elif not reply.ok:
            by_error.setdefault(reply.error, []).append(host)
    if len(by_error) == 1:
        # one cause (an endpoint that is not etcd, the wrong version): one sentence
        ((error, hosts),) = by_error.items()
        where = f"host {hosts[0]}" if len(hosts) == 1 else f"hosts {', '.join(hosts)}"
        raise PreflightError(
            f"the metadata store {endpoint} is not usable from {where}: {error}",
            tuple(hosts),
        )
    if by_error:
        raise PreflightError(
            f"the metadata store {endpoint} is not usable from "
            + "; ".join(f"host {', '.join(hosts)} ({error})" for error, hosts in by_error.items()),
            tuple(h for hosts in by_error.values() for h in hosts),
        )


async def start_metadata_store(
    clients: Mapping[str, AgentClient],
    controller_host: str,
    advertise_host: str,
    launch_id: str,
    binary: str | None = None,
    sha256: str | None = None,
    timeout_s: float = 30.0,
) -> EtcdStartResponse:
    """Start etcd through the controller host's agent, then prove it from every host.

    On a failed check the store is stopped again before the error is raised.
    """
    agent = clients[controller_host]
    request = EtcdStartRequest(
        advertise_host=advertise_host, binary=binary, sha256=sha256, timeout_s=timeout_s
    )
    reply = await agent.call(ETCD_START, request, timeout_s=request.timeout_s + 30)
    if not reply.ok:
        raise PreflightError(
            f"host {controller_host}: the managed etcd did not start: {reply.error}",
            (controller_host,),
        )
    try:
        await check_from_every_host(clients, reply.endpoint, launch_id)
    except BaseException:
        try:
            await agent.call(ETCD_STOP)
        except AgentError:
            pass
        raise
    return reply
