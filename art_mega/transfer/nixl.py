"""Moving an adapter directory between hosts with NIXL (UCX), for host-local artifact roots.

The sender reads every file of the adapter into one DRAM buffer, registers it with its NIXL
agent and publishes partial agent metadata under a per-transfer label in the launch's etcd
(NIXL's own etcd metadata backend: `NIXL_ETCD_ENDPOINTS` / `NIXL_ETCD_NAMESPACE`). The receiver
fetches that metadata, allocates and registers a buffer, does one UCX READ, writes the files to
a new staging folder under its own artifact root, fsyncs them, checks each file's sha256 (read
back from disk) against the sender's manifest and only then renames the folder into place.
`remove_copies` deletes received copies once no replica loads them any more.

UCX between hosts: the agents' environment decides the transport. Between Linux network
namespaces on one machine (the CI stand-in for hosts) the defaults work (UCX picks tcp over the
veth for RMA, plus cma for active messages since every namespace shares one kernel);
`UCX_TLS=tcp` forces every byte over the veth and works as well. `UCX_NET_DEVICES` selects the
NIC where a host has several. One NIXL agent per host, made on first use in the host's NIXL
process (`transfer.worker`), without NIXL's progress thread (it spins at ~15% of a core
even when idle); the sender's side is progressed by polling only while it holds an offer.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_mega.transfer.protocol import (
    COPY_MARKER,
    AdapterFile,
    AdapterOffer,
    FetchRequest,
    FetchResponse,
    MetadataStore,
    OfferRequest,
    OfferResponse,
    PruneRequest,
    PruneResponse,
)

POLL_S = 0.002
STAGING_SUFFIX = ".partial"


class TransferError(Exception):
    """A transfer step failed; the message names the transfer and the file if any.

    Attributes:
        host: the host the message names already ("" when it names none, and the agent's reply
            puts its own host in front).
    """

    def __init__(self, message: str, host: str = "") -> None:
        super().__init__(message)
        self.host = host


def inside(root: str, path: str, what: str) -> Path:
    """`path` (absolute, or relative to `root`) resolved; raises `TransferError` if it leaves `root`."""
    base = Path(root).resolve()
    resolved = (base / path).resolve()
    if resolved != base and base not in resolved.parents:
        raise TransferError(f"{what} {path!r} is not inside the artifact root {root}")
    return resolved


def read_adapter(
    path: Path, only: tuple[str, ...] | None = None
) -> tuple[bytearray, tuple[AdapterFile, ...]]:
    """Every regular file under `path` (sorted by relative name), or the files of `only` (names
    relative to `path`) that exist, back to back in one buffer.

    Returns the buffer (uint8 bytes, length = sum of file sizes) and each file's name, size,
    offset and sha256. Raises `TransferError` when `path` is not a directory or holds no data,
    or a name of `only` leaves `path`.
    """
    if not path.is_dir():
        raise TransferError(f"adapter {path} is not a directory")
    if only is None:
        names = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    else:
        names = sorted(n for n in only if inside(str(path), n, "adapter file").is_file())
    if not names:
        raise TransferError(f"adapter {path} holds no file")
    contents = [(path / name).read_bytes() for name in names]
    buffer = bytearray(sum(len(c) for c in contents))
    if not buffer:
        raise TransferError(f"adapter {path} holds only empty files")
    files, offset = [], 0
    for name, content in zip(names, contents):
        buffer[offset : offset + len(content)] = content
        files.append(
            AdapterFile(
                name=name, size=len(content), offset=offset, sha256=hashlib.sha256(content).hexdigest()
            )
        )
        offset += len(content)
    return buffer, tuple(files)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_verified(buffer: memoryview, offer: AdapterOffer, final: Path, host: str) -> None:
    """Write `offer.files` from `buffer` into a staging folder beside `final`, fsync, check each
    file's sha256 read back from disk, then rename the folder to `final`.

    Raises:
        TransferError: `final` exists already (every copy needs a new path), or a file's sha256
            differs from the manifest (names host, transfer, file and both digests); the staging
            folder is removed first.
    """
    if final.exists():
        raise TransferError(
            f"host {host}: {final} exists already; every received adapter needs a new path", host
        )
    staging = final.with_name(final.name + STAGING_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for entry in offer.files:
            target = staging / entry.name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(buffer[entry.offset : entry.offset + entry.size])
                handle.flush()
                os.fsync(handle.fileno())
        for entry in offer.files:
            actual = hashlib.sha256((staging / entry.name).read_bytes()).hexdigest()
            if actual != entry.sha256:
                raise TransferError(
                    f"host {host}: file {entry.name} of transfer {offer.transfer_id} from host {offer.host} "
                    f"has sha256 {actual}, not {entry.sha256} as the sender's manifest says",
                    host,
                )
        for folder in sorted({(staging / e.name).parent for e in offer.files}, key=lambda p: -len(p.parts)):
            _fsync_dir(folder)
        os.replace(staging, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_copies(request: PruneRequest) -> PruneResponse:
    """Delete the received adapter copies `request.paths` on this host, then each copy's parent
    folder (the step's checkpoint folder) when that is left empty. Blocking file I/O.

    A path that does not exist counts as removed (pruning is retried until it succeeds). A path
    outside `request.root`, or one whose name lacks `COPY_MARKER` (not a received copy, e.g.
    the exported adapter itself), is refused and left alone; the reply's `error` names every
    refusal or failure (host, path, cause), and `removed` lists what no longer exists.
    """
    removed: list[str] = []
    errors: list[str] = []
    for path in request.paths:
        try:
            copy = inside(request.root, path, "adapter copy")
            if COPY_MARKER not in copy.name or copy.name.endswith(STAGING_SUFFIX):
                raise TransferError(f"{path} is not a received adapter copy (<adapter>{COPY_MARKER}<id>)")
            if copy.exists():
                shutil.rmtree(copy)
            removed.append(path)
            if copy.parent != Path(request.root).resolve():
                try:
                    copy.parent.rmdir()  # only when empty: the step's folder held just this copy
                except OSError:
                    pass
        except (TransferError, OSError) as exc:
            errors.append(f"host {request.host}: pruning {path}: {exc}")
    return PruneResponse(removed=tuple(removed), error="; ".join(errors))


@dataclass
class _Held:
    """An offered adapter: its bytes stay alive and registered until released."""

    offer: AdapterOffer
    buffer: bytearray
    registration: Any


def _address(buffer: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


class NixlEndpoint:
    """This process's NIXL agent (UCX backend, thread-safe, no progress thread), made lazily.

    `store` fixes the etcd endpoint and key namespace for the agent's life: NIXL reads them
    from the environment when the agent is made. Raises `TransferError` when a later call names
    another store, or when NIXL cannot be imported or has no UCX backend.
    """

    def __init__(self, backend: str = "UCX") -> None:
        self.backend = backend
        self.name = f"art-mega-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent: Any = None
        self._store: MetadataStore | None = None
        self._lock = threading.Lock()

    def agent(self, store: MetadataStore) -> Any:
        with self._lock:
            if self._agent is not None:
                if store != self._store:
                    raise TransferError(
                        f"this agent's NIXL metadata store is {self._store}, not {store}: one store per launch"
                    )
                return self._agent
            try:
                from nixl_cu13 import nixl_agent, nixl_agent_config, nixl_thread_sync_t
            except ImportError as exc:
                raise TransferError(
                    f"NIXL is not installed here ({exc}); pip install nixl-cu13==1.5.1"
                ) from None
            saved = {k: os.environ.get(k) for k in ("NIXL_ETCD_ENDPOINTS", "NIXL_ETCD_NAMESPACE")}
            os.environ["NIXL_ETCD_ENDPOINTS"] = store.endpoint
            os.environ["NIXL_ETCD_NAMESPACE"] = store.namespace
            try:
                config = nixl_agent_config(
                    enable_prog_thread=False,  # NIXL's spins at ~15% of a core even when idle
                    backends=[self.backend],
                    sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
                )
                agent = nixl_agent(self.name, config)
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            if self.backend not in agent.backends:
                raise TransferError(
                    f"NIXL has no {self.backend} backend here (plugins: {agent.get_plugin_list()})"
                )
            self._agent, self._store = agent, store
            return agent

    def close(self) -> None:
        """Drop the agent. Its metadata stays in etcd under the launch's key prefix (a few KiB):
        the managed etcd is stopped before the agents, so removing it there would only fail."""
        with self._lock:
            self._agent = None


class AdapterTransfers:
    """Agent side of adapter transfers: offers this host holds and fetches it performs.

    Every method blocks (NIXL calls, file I/O): the agent runs them in a thread. A receiver's
    READ progresses on its own polling; the sender's side must progress too (UCX over tcp
    emulates RMA with active messages), so while any offer is held a thread polls the NIXL
    agent every `POLL_S` seconds, and stops when the last offer is released.
    """

    def __init__(self, endpoint: NixlEndpoint | None = None) -> None:
        self.endpoint = endpoint or NixlEndpoint()
        self._held: dict[str, _Held] = {}
        self._stuck: list[tuple[Any, bytearray, Any]] = []
        self._lock = threading.Lock()
        self._progress: threading.Thread | None = None

    def offer(self, request: OfferRequest) -> OfferResponse:
        """Read and register the adapter, publish its metadata; the reply carries the manifest."""
        try:
            return OfferResponse(ok=True, offer=self._offer(request))
        except (TransferError, OSError, RuntimeError, ValueError) as exc:
            return OfferResponse(ok=False, error=f"host {request.host}: offering {request.path}: {exc}")

    def _offer(self, request: OfferRequest) -> AdapterOffer:
        with self._lock:
            if request.transfer_id in self._held:
                raise TransferError(f"transfer {request.transfer_id} is offered already")
        source = inside(request.root, request.path, "adapter path")
        buffer, files = read_adapter(source, request.files)
        agent = self.endpoint.agent(request.store)
        address = _address(buffer)
        registration = agent.register_memory([(address, len(buffer), 0, "")], "DRAM")
        try:
            agent.send_partial_agent_metadata(registration, inc_conn_info=True, label=request.transfer_id)
        except BaseException:
            agent.deregister_memory(registration)
            raise
        offer = AdapterOffer(
            transfer_id=request.transfer_id,
            host=request.host,
            agent_name=self.endpoint.name,
            label=request.transfer_id,
            address=address,
            size=len(buffer),
            source=str(source),
            files=files,
        )
        with self._lock:
            self._held[request.transfer_id] = _Held(offer, buffer, registration)
            if self._progress is None or not self._progress.is_alive():
                self._progress = threading.Thread(
                    target=self._progress_offers, args=(agent,), name="art-mega-nixl-progress", daemon=True
                )
                self._progress.start()
        return offer

    def _progress_offers(self, agent: Any) -> None:
        while True:
            with self._lock:
                if not self._held:
                    self._progress = None
                    return
            agent.get_new_notifs()
            time.sleep(POLL_S)

    def held(self, transfer_id: str) -> bytearray:
        """The registered bytes of an offer (what a receiver's READ gets). KeyError if unknown."""
        return self._held[transfer_id].buffer

    def release(self, transfer_id: str) -> bool:
        """Deregister and drop an offer; False when there was none."""
        with self._lock:
            held = self._held.pop(transfer_id, None)
        if held is None:
            return False
        agent = self.endpoint._agent
        if agent is not None:
            agent.deregister_memory(held.registration)
        return True

    def fetch(self, request: FetchRequest) -> FetchResponse:
        """Read the offer with NIXL, write and verify it at `<root>/<dest>`; the reply names the path."""
        started = time.monotonic()
        try:
            final = inside(request.root, request.dest, "destination")
            if final == Path(request.root).resolve():
                raise TransferError("the destination must be below the artifact root, not the root itself")
            final.parent.mkdir(parents=True, exist_ok=True)
            buffer = self._read(request)
            write_verified(memoryview(buffer), request.offer, final, request.host)
        except (TransferError, OSError, RuntimeError, ValueError) as exc:
            named = isinstance(exc, TransferError) and exc.host == request.host
            message = str(exc) if named else f"host {request.host}: {exc}"
            return FetchResponse(ok=False, error=message, seconds=time.monotonic() - started)
        return FetchResponse(
            ok=True, path=str(final), bytes=request.offer.size, seconds=time.monotonic() - started
        )

    def _read(self, request: FetchRequest) -> bytearray:
        """One UCX READ of the whole offer into a new registered buffer, bounded by timeout_s."""
        offer = request.offer
        agent = self.endpoint.agent(request.store)
        deadline = time.monotonic() + request.timeout_s
        remote = agent.get_xfer_descs([(offer.address, offer.size, 0)], "DRAM")
        agent.fetch_remote_metadata(offer.agent_name, label=offer.label)
        while not agent.check_remote_metadata(offer.agent_name, remote):
            if time.monotonic() > deadline:
                raise TransferError(
                    f"no NIXL metadata for transfer {offer.transfer_id} of host {offer.host} (agent "
                    f"{offer.agent_name}) in {request.store.endpoint} after {request.timeout_s:g} s"
                )
            time.sleep(POLL_S)
        buffer = bytearray(offer.size)
        address = _address(buffer)
        registration = agent.register_memory([(address, offer.size, 0, "")], "DRAM")
        handle = None
        try:
            local = agent.get_xfer_descs([(address, offer.size, 0)], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, offer.agent_name)
            state = agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"the NIXL READ of transfer {offer.transfer_id} ({offer.size} bytes) from host "
                        f"{offer.host} did not finish in {request.timeout_s:g} s"
                    )
                time.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(
                    f"the NIXL READ of transfer {offer.transfer_id} from host {offer.host} failed (state {state})"
                )
        finally:
            self._finish(agent, handle, buffer, registration)
        return buffer

    def _finish(self, agent: Any, handle: Any, buffer: bytearray, registration: Any) -> None:
        """Release the transfer, then the buffer's registration. A READ that cannot be cancelled
        may still write into `buffer`: then both stay alive (and registered) until `close`."""
        if handle is not None:
            try:
                agent.release_xfer_handle(handle)
            except Exception:
                self._stuck.append((handle, buffer, registration))
                return
        agent.deregister_memory(registration)

    def close(self) -> None:
        """Release every offer and close the NIXL agent."""
        for transfer_id in list(self._held):
            self.release(transfer_id)
        self._stuck.clear()
        self.endpoint.close()
