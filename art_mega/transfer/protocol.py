"""Routes and bodies of the transfer service: adapter transfers (`/v1/adapters/offer|fetch|release|prune`)
and artifact files (`/v1/artifacts/write|remove`).

An offer is the sender's manifest: where its NIXL agent registered the adapter's bytes and the
size and sha256 of every file in them. Pure pydantic; the NIXL work is in `transfer.nixl`.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from art_mega.agent.routes import Route

COPY_MARKER = ".nixl-"
"""A received copy of adapter folder `A` is written as `A.nixl-<transfer id>`; prune deletes only
folders whose name holds this marker."""

_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
ARTIFACT_WRITE_MAX_BODY_BYTES = 1 << 30
"""Body cap of /v1/artifacts/write (1 GiB of JSON: a file of up to 768 MiB in base64)."""


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_label(value: str, what: str) -> str:
    if not _LABEL.match(value):
        raise ValueError(f"{what} {value!r} must be 1-128 letters, digits, '.', '_' or '-'")
    return value


class MetadataStore(_Body):
    """The etcd that holds NIXL agent metadata: its URL and the key prefix of this launch."""

    endpoint: str = Field(min_length=1)
    namespace: str = Field(min_length=2, pattern=r"^/[A-Za-z0-9/._-]+$")


class AdapterFile(_Body):
    """One file of an adapter directory: `name` relative to it (POSIX, no '..'), its `size` in
    bytes, its byte `offset` in the sender's registered buffer, and the sha256 of its content."""

    name: str = Field(min_length=1)
    size: int = Field(ge=0)
    offset: int = Field(ge=0)
    sha256: str

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        parts = value.split("/")
        if value.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\x00" in value:
            raise ValueError(f"file name {value!r} must be a relative path without '.', '..' or empty parts")
        return value

    @field_validator("sha256")
    @classmethod
    def _check_sha(cls, value: str) -> str:
        if not _SHA256.match(value):
            raise ValueError(f"sha256 {value!r} is not 64 lowercase hex digits")
        return value


class AdapterOffer(_Body):
    """An adapter held in the sender's DRAM, registered with its NIXL agent.

    `address` and `size` (bytes) describe the one registered buffer; `files` lie in it back to
    back. `label` names the partial NIXL metadata the sender published for this buffer.
    """

    transfer_id: str
    host: str
    agent_name: str
    label: str
    address: int = Field(ge=0)
    size: int = Field(ge=0)
    source: str
    files: tuple[AdapterFile, ...] = Field(min_length=1)

    @field_validator("transfer_id", "label")
    @classmethod
    def _check_ids(cls, value: str) -> str:
        return _check_label(value, "transfer id")


class OfferRequest(_Body):
    """Register the adapter at `path` (absolute, inside `root`) for transfer `transfer_id`:
    the files named in `files` (relative to `path`; a checkpoint's step folder also holds the
    trainer's state, which stays), or every file under `path` when `files` is None."""

    host: str
    root: str
    path: str
    transfer_id: str
    store: MetadataStore
    timeout_s: float = Field(default=30.0, gt=0)
    files: tuple[str, ...] | None = None

    @field_validator("transfer_id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        return _check_label(value, "transfer_id")


class OfferResponse(_Body):
    ok: bool
    offer: AdapterOffer | None = None
    error: str = ""


class FetchRequest(_Body):
    """Read `offer` with NIXL and write it to `<root>/<dest>` (a path that must not exist yet)."""

    host: str
    root: str
    dest: str
    offer: AdapterOffer
    store: MetadataStore
    timeout_s: float = Field(default=60.0, gt=0)


class FetchResponse(_Body):
    """`path`: the verified local copy; `seconds`: metadata + read + write + check; `bytes` read."""

    ok: bool
    path: str = ""
    seconds: float = 0.0
    bytes: int = 0
    error: str = ""


class ReleaseRequest(_Body):
    transfer_id: str


class ReleaseResponse(_Body):
    released: bool


class PruneRequest(_Body):
    """Delete received adapter copies on this host: `paths` (absolute, inside `root`), each a
    folder named `<adapter>.nixl-<transfer id>` as `AdapterTransport` wrote it."""

    host: str
    root: str
    paths: tuple[str, ...]


class PruneResponse(_Body):
    """`removed`: the paths that no longer exist (deleted now or gone before); `error` names each
    path that was refused or could not be deleted, with the host and cause ("" when none)."""

    removed: tuple[str, ...] = ()
    error: str = ""


class ArtifactWriteRequest(BaseModel):
    """Write `data_b64` (base64 of the file's bytes) to `<root>/<path>`, replacing any file there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: str
    path: str
    data_b64: str


class ArtifactRemoveRequest(BaseModel):
    """Remove `<root>/<path>` (a file or a folder with its contents; nothing when it is absent)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: str
    path: str


class ArtifactResponse(BaseModel):
    """`ok`, or `error` naming the path and the reason; `bytes` written or `removed`."""

    ok: bool
    bytes: int = 0
    removed: bool = False
    error: str = ""


ADAPTERS_OFFER = Route("POST", "/adapters/offer", OfferRequest, OfferResponse)
ADAPTERS_FETCH = Route("POST", "/adapters/fetch", FetchRequest, FetchResponse)
ADAPTERS_RELEASE = Route("POST", "/adapters/release", ReleaseRequest, ReleaseResponse)
ADAPTERS_PRUNE = Route("POST", "/adapters/prune", PruneRequest, PruneResponse)
ARTIFACTS_WRITE = Route(
    "POST", "/artifacts/write", ArtifactWriteRequest, ArtifactResponse, ARTIFACT_WRITE_MAX_BODY_BYTES
)
ARTIFACTS_REMOVE = Route("POST", "/artifacts/remove", ArtifactRemoveRequest, ArtifactResponse)
