"""The agent side of the artifact-file routes: paths stay inside artifact_root, writes replace
whole files, removal takes files and folders; over the agent's app, only signed requests."""

from __future__ import annotations

import base64

import httpx
import pytest

from art_mega.agent.app import AgentState, create_app
from art_mega.agent.auth import sign
from art_mega.agent.routes import API_PREFIX
from art_mega.transfer.files import artifact_path, register, remove_path, write_file
from art_mega.transfer.protocol import (
    ARTIFACTS_REMOVE,
    ARTIFACTS_WRITE,
    ArtifactRemoveRequest,
    ArtifactResponse,
    ArtifactWriteRequest,
)

SECRET = b"0123456789abcdef0123456789abcdef"


def write(root, path: str, data: bytes):
    return write_file(
        ArtifactWriteRequest(root=str(root), path=path, data_b64=base64.b64encode(data).decode())
    )


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("../outside", "leaves"),
        ("a/../../outside", "leaves"),
        (".", "leaves"),
        ("/etc/passwd", "must be relative"),
        ("", "must be relative"),
    ],
)
def test_a_path_outside_the_root_is_refused_and_nothing_is_written(tmp_path, path, reason):
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ValueError, match=reason):
        artifact_path(str(root), path)
    reply = write(root, path, b"x")
    assert not reply.ok and reply.error.startswith(f"writing {path}: ValueError: artifact path {path!r}")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["root"]
    assert not remove_path(ArtifactRemoveRequest(root=str(root), path=path)).ok


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    reply = write(root, "link/escaped", b"x")
    assert not reply.ok and "leaves artifact_root" in reply.error
    assert not (tmp_path / "escaped").exists()


def test_a_write_makes_folders_replaces_the_file_and_leaves_no_temp_file(tmp_path):
    data = bytes(range(256)) * 1000
    reply = write(tmp_path, "proj/batches/0001/dp1.safetensors", data)
    assert reply.ok and reply.bytes == len(data)
    target = tmp_path / "proj" / "batches" / "0001" / "dp1.safetensors"
    assert target.read_bytes() == data
    assert write(tmp_path, "proj/batches/0001/dp1.safetensors", b"second").ok
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["dp1.safetensors"]


def test_remove_takes_a_folder_or_a_file_and_says_whether_it_was_there(tmp_path):
    assert write(tmp_path, "ck/0001/rank00001.pt", b"state").ok
    assert write(tmp_path, "ck/note", b"n").ok
    folder = remove_path(ArtifactRemoveRequest(root=str(tmp_path), path="ck/0001"))
    assert folder.ok and folder.removed
    assert remove_path(ArtifactRemoveRequest(root=str(tmp_path), path="ck/note")).removed
    again = remove_path(ArtifactRemoveRequest(root=str(tmp_path), path="ck/0001"))
    assert again.ok and not again.removed
    assert [p.name for p in tmp_path.rglob("*")] == ["ck"]


async def test_the_agent_routes_write_and_remove_for_signed_requests_only(tmp_path):
    state = AgentState("launch-x", SECRET, "tcp://127.0.0.1:1")
    transport = httpx.ASGITransport(app=create_app(state, [register]))

    async def post(http, path: str, body, secret: bytes = SECRET) -> httpx.Response:
        content = body.model_dump_json().encode()
        headers = {
            "content-type": "application/json",
            **sign(secret, "POST", API_PREFIX + path, content, state.identity),
        }
        return await http.post(API_PREFIX + path, content=content, headers=headers)

    data = base64.b64encode(b"batch").decode()
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as http:
        write = ArtifactWriteRequest(root=str(tmp_path), path="b/dp1.safetensors", data_b64=data)
        refused = await post(http, ARTIFACTS_WRITE.path, write, secret=b"x" * 32)
        assert refused.status_code == 401 and not (tmp_path / "b").exists()
        written = ArtifactResponse.model_validate_json(
            (await post(http, ARTIFACTS_WRITE.path, write)).content
        )
        assert (
            written.ok
            and written.bytes == 5
            and (tmp_path / "b" / "dp1.safetensors").read_bytes() == b"batch"
        )
        escape = ArtifactWriteRequest(root=str(tmp_path / "b"), path="../../x", data_b64=data)
        reply = ArtifactResponse.model_validate_json((await post(http, ARTIFACTS_WRITE.path, escape)).content)
        assert not reply.ok and "leaves artifact_root" in reply.error and not (tmp_path.parent / "x").exists()
        removed = await post(http, ARTIFACTS_REMOVE.path, ArtifactRemoveRequest(root=str(tmp_path), path="b"))
        assert ArtifactResponse.model_validate_json(removed.content).removed and not (tmp_path / "b").exists()
    await state.close()
