"""Hugging Face Hub names as `base_model`, resolved from an HF cache this test writes from the tiny
model, with the layout huggingface_hub writes (`models--Org--Name/{blobs, refs/main,
snapshots/<commit>/<file> -> ../../blobs/<hash>}`; its own `scan_cache_dir` reads it back).

huggingface_hub reads HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported, so each
environment is resolved in a fresh interpreter that has exactly those variables. No test reaches
the network: offline, or an HF_ENDPOINT on a loopback port nothing listens on.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from art_mega.agent.ports import free_port
from art_mega.basemodels.resolve import near_names, resolve_base_model
from art_mega.errors import BaseModelError, UserError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"

RESOLVE = """
import json, sys
from art_mega.basemodels.resolve import near_names, resolve_base_model
from art_mega.errors import BaseModelError
out = []
for name, revision in json.loads(sys.argv[1]):
    try:
        resolved = resolve_base_model(name, sys.argv[2], revision=revision)
        out.append({"dir": str(resolved.model_dir), "hub_id": resolved.hub_id})
    except BaseModelError as exc:
        out.append({"error": str(exc), "base_model": exc.base_model, "revision": exc.revision})
print(json.dumps(out))
"""


def write_hf_cache(
    hub: Path, repo_id: str, source: Path, commit: str = COMMIT, skip: tuple[str, ...] = ()
) -> Path:
    """Write `source`'s files as repo `repo_id` at `commit` (refs/main) into the HF hub cache `hub`,
    as huggingface_hub does: blobs named by their hash (sha256 for LFS files such as safetensors,
    the git blob sha1 otherwise), relative symlinks in the snapshot. Returns the snapshot."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name in skip:
            continue
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def resolve_in(env: dict[str, str], cases: list[tuple[str, str | None]], cache_root: Path) -> list[dict]:
    """`resolve_base_model` of each (name, revision) in a fresh interpreter whose HF variables are
    exactly `env`'s; each result is {"dir", "hub_id"} or {"error", "base_model", "revision"}."""
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "HUGGINGFACE_"))
    }
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, json.dumps(cases), str(cache_root)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def hf_home(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    """An HF_HOME whose hub cache holds the tiny model as "Qwen/Qwen3-0.6B" (complete, at COMMIT)."""
    home = tmp_path / "hf"
    write_hf_cache(home / "hub", "Qwen/Qwen3-0.6B", tiny_llama_dir)
    return home


def test_the_written_cache_is_what_huggingface_hub_reads(hf_home: Path, tiny_llama_dir: Path) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hf_home / "hub")
    assert info.warnings == []
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == ("Qwen/Qwen3-0.6B", "model")
    (revision,) = repo.revisions
    assert (revision.commit_hash, set(revision.refs)) == (COMMIT, {"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in tiny_llama_dir.iterdir() if p.is_file()}


def test_a_hub_name_resolves_offline_to_its_cached_snapshot(
    hf_home: Path, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    from art_mega.trainer.model_builder import check_model_fits

    snapshot = hf_home / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / COMMIT
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    results = resolve_in(env, [("Qwen/Qwen3-0.6B", None), ("Qwen/Qwen3-0.6B", COMMIT)], tmp_path / "cache")
    assert results == [{"dir": str(snapshot), "hub_id": "Qwen/Qwen3-0.6B"}] * 2
    # the snapshot is links into blobs/, and what they lead to is the tiny model, byte for byte
    weights = snapshot / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent.name == "blobs"
    assert weights.read_bytes() == (tiny_llama_dir / "model.safetensors").read_bytes()
    check_model_fits(snapshot, 2)  # config.json read through its link
    assert not (tmp_path / "cache").exists()  # nothing was built or copied into art-mega's cache


def test_hf_hub_cache_and_transformers_offline_are_honoured(tmp_path: Path, tiny_llama_dir: Path) -> None:
    hub = tmp_path / "elsewhere"
    snapshot = write_hf_cache(hub, "Org/tiny", tiny_llama_dir)
    env = {"HF_HOME": str(tmp_path / "unused"), "HF_HUB_CACHE": str(hub), "TRANSFORMERS_OFFLINE": "1"}
    assert resolve_in(env, [("Org/tiny", None)], tmp_path / "cache") == [
        {"dir": str(snapshot), "hub_id": "Org/tiny"}
    ]


def test_offline_names_and_revisions_that_are_not_cached_are_refused(hf_home: Path, tmp_path: Path) -> None:
    hub = hf_home / "hub"
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    missing, revision = resolve_in(
        env, [("Qwen/Qwen3-8B", None), ("Qwen/Qwen3-0.6B", "v2")], tmp_path / "cache"
    )
    assert missing == {
        "error": f"base_model 'Qwen/Qwen3-8B' has no snapshot in the Hugging Face cache {hub} and downloads "
        "are off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); download it once with a network and the same "
        "HF_HOME (hf download Qwen/Qwen3-8B), or unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE",
        "base_model": "Qwen/Qwen3-8B",
        "revision": None,
    }
    assert revision["error"].startswith(
        f"base_model 'Qwen/Qwen3-0.6B' (revision 'v2') has no snapshot in the Hugging Face cache {hub} "
    )
    assert (revision["base_model"], revision["revision"]) == ("Qwen/Qwen3-0.6B", "v2")


def test_a_ref_to_a_missing_snapshot_is_refused(hf_home: Path, tmp_path: Path) -> None:
    repo = hf_home / "hub" / "models--Qwen--Qwen3-0.6B"
    (repo / "refs" / "main").write_text(OTHER_COMMIT)  # main moved; its snapshot never arrived
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    (result,) = resolve_in(env, [("Qwen/Qwen3-0.6B", None)], tmp_path / "cache")
    assert result["error"].startswith(
        "base_model 'Qwen/Qwen3-0.6B' has no snapshot in the Hugging Face cache"
    )


def test_a_snapshot_without_config_weights_or_tokenizer_is_refused(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    hub = tmp_path / "hf" / "hub"
    write_hf_cache(hub, "Org/no-weights", tiny_llama_dir, skip=("model.safetensors",))
    write_hf_cache(hub, "Org/bare", tiny_llama_dir, skip=("config.json", "tokenizer.json"))
    lost = write_hf_cache(hub, "Org/lost-blob", tiny_llama_dir)
    (lost / "model.safetensors").resolve().unlink()  # the link stays, its blob is gone
    sharded = write_hf_cache(hub, "Org/sharded", tiny_llama_dir, skip=("model.safetensors",))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        )
    )
    os.link(tiny_llama_dir / "model.safetensors", sharded / "model-00001-of-00002.safetensors")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    names = ["Org/no-weights", "Org/bare", "Org/lost-blob", "Org/sharded"]
    results = resolve_in(env, [(n, None) for n in names], tmp_path / "cache")
    snap = {n: hub / f"models--{n.replace('/', '--')}" / "snapshots" / COMMIT for n in names}
    fix = "which art-mega trains and serves from; download it again (hf download {}), or use a model published with safetensors weights"
    weights = "safetensors weights (model.safetensors or model.safetensors.index.json and its shards)"
    assert [r["error"] for r in results] == [
        f"the Hugging Face cache snapshot {snap['Org/no-weights']} of base_model 'Org/no-weights' lacks "
        f"{weights}, {fix.format('Org/no-weights')}",
        f"the Hugging Face cache snapshot {snap['Org/bare']} of base_model 'Org/bare' lacks config.json and "
        f"a tokenizer (tokenizer.json, tokenizer.model, vocab.json or a *.tiktoken file), {fix.format('Org/bare')}",
        f"the Hugging Face cache snapshot {snap['Org/lost-blob']} of base_model 'Org/lost-blob' lacks "
        f"{weights}, {fix.format('Org/lost-blob')}",
        f"the Hugging Face cache snapshot {snap['Org/sharded']} of base_model 'Org/sharded' lacks the shards "
        f"model-00002-of-00002.safetensors that model.safetensors.index.json names, {fix.format('Org/sharded')}",
    ]


def test_an_unreachable_hub_falls_back_to_the_cache_or_is_refused(hf_home: Path, tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    env = {"HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint}
    cached, missing = resolve_in(
        env, [("Qwen/Qwen3-0.6B", None), ("Qwen/Qwen3-8B", None)], tmp_path / "cache"
    )
    assert cached["dir"] == str(hf_home / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / COMMIT)
    assert missing["error"].startswith(
        f"base_model 'Qwen/Qwen3-8B' could not be fetched from the Hugging Face Hub {endpoint} ("
    )
    assert missing["error"].endswith(
        f"and the cache {hf_home / 'hub'} lacks it; check this machine's network access to "
        f"{endpoint} (or HF_ENDPOINT) and try again"
    )


def test_names_that_are_no_repo_id_are_refused_before_any_lookup(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(BaseModelError) as caught:
        resolve_base_model("Qwen/Qwen3-0.6B@main", cache)
    assert str(caught.value) == (
        "base_model 'Qwen/Qwen3-0.6B@main' puts a revision after '@', which Hugging Face (and ART) read as "
        "part of the repo id; name the repo alone, e.g. base_model='Qwen/Qwen3-0.6B'"
    )
    assert isinstance(caught.value, UserError) and caught.value.base_model == "Qwen/Qwen3-0.6B@main"
    for name in ("a/b/c", "/no/such/model", "Qwen/Qwen 3"):
        with pytest.raises(BaseModelError) as caught:
            resolve_base_model(name, cache)
        assert str(caught.value).startswith(
            f"base_model {name!r} is neither an HF model directory (config.json), a PEFT adapter directory "
            f"(adapter_config.json), a model in {cache / 'models'}, one of ['HuggingFaceTB/SmolLM2-135M-Instruct', "
            "'SmolLM2-135M-Instruct', 'tiny-llama', 'tiny-qwen2', 'tiny-qwen3'], nor a Hugging Face repo id "
            "such as 'Qwen/Qwen3-0.6B' (Repo id must "
        )


def test_local_directories_keep_resolving_and_refuse_a_revision(tmp_path: Path, tiny_llama_dir: Path) -> None:
    assert resolve_base_model(str(tiny_llama_dir), tmp_path).model_dir == tiny_llama_dir.resolve()
    assert resolve_base_model(str(tiny_llama_dir), tmp_path).hub_id is None
    with pytest.raises(
        BaseModelError, match=r"so revision 'v2' cannot apply to it \(revisions name Hugging Face"
    ):
        resolve_base_model(str(tiny_llama_dir), tmp_path, revision="v2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BaseModelError) as caught:
        resolve_base_model(str(tmp_path / "empty"), tmp_path)
    assert str(caught.value) == (
        f"base_model {str(tmp_path / 'empty')!r} is a directory without config.json or adapter_config.json; "
        "pass an HF model directory (config.json and safetensors weights) or a PEFT adapter directory"
    )


def test_an_adapter_on_a_hub_base_resolves_the_base_from_the_cache(hf_home: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-0.6B"}))
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    (result,) = resolve_in(env, [(str(adapter), None)], tmp_path / "cache")
    assert result == {
        "dir": str(hf_home / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / COMMIT),
        "hub_id": "Qwen/Qwen3-0.6B",
    }


def test_a_host_that_cannot_read_a_hub_snapshot_is_told_about_the_hf_cache() -> None:
    from art_mega.preflight.reach import unreadable_model_error

    snapshot = Path("/h/hub/models--Qwen--Qwen3-0.6B/snapshots") / COMMIT
    folders = {snapshot: "base model directory"}
    error = unreadable_model_error(
        "h1", (str(snapshot / "config.json"),), folders, {snapshot: "Qwen/Qwen3-0.6B"}
    )
    assert str(error) == (
        f"host h1 cannot read the base model directory {snapshot} (1 of its files are missing there, e.g. "
        "config.json), which its trainer ranks or replicas load; it is the Hugging Face cache snapshot of "
        "'Qwen/Qwen3-0.6B': put the controller's HF cache (HF_HOME or HF_HUB_CACHE) on a filesystem every "
        "host mounts at the same path, or download Qwen/Qwen3-0.6B on host h1 into a cache at that same "
        "path (hf download Qwen/Qwen3-0.6B)"
    )


class FakeHub:
    """The Hub's model API on a loopback port, as far as `snapshot_download` uses it: repo info
    (`/api/models/<repo>/revision/<rev>`), file metadata and bytes (`/<repo>/resolve/<commit>/<file>`),
    and its error answers (X-Error-Code RepoNotFound / GatedRepo / RevisionNotFound). Serves the
    tiny model as "Qwen/Qwen3-0.6B" at COMMIT plus files a trainer and vLLM never read."""

    EXTRA = {
        "README.md": b"# tiny\n",
        "pytorch_model.bin": b"torch pickle",
        "consolidated.safetensors": b"mistral-format duplicate",
        "onnx/model.onnx": b"onnx",
        "original/model.safetensors": b"another copy",
    }

    def __init__(self, tiny: Path) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.files = {p.name: p.read_bytes() for p in tiny.iterdir() if p.is_file()} | self.EXTRA
        self.fetched: list[str] = []
        self.gate = threading.Event()  # file bodies wait for it (set: they do not wait)
        self.gate.set()
        self.waiting = threading.Event()  # set once a file body waits at the closed gate
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                status, headers, data = hub.answer(self.path.split("?", 1)[0], body)
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, body: bool) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for a request path."""
        if path.startswith("/api/models/"):
            repo, _, revision = path.removeprefix("/api/models/").partition("/revision/")
            if repo == "Org/gated":
                return 403, {"X-Error-Code": "GatedRepo"}, b'{"error": "gated"}'
            if repo == "Org/flaky":  # listed, but every file is refused
                return (
                    200,
                    {},
                    json.dumps(
                        {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": "config.json"}]}
                    ).encode(),
                )
            if repo != "Qwen/Qwen3-0.6B":
                return 401, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}'
            if revision not in ("main", COMMIT):
                return 404, {"X-Error-Code": "RevisionNotFound"}, b'{"error": "Invalid rev id"}'
            info = {
                "id": repo,
                "sha": COMMIT,
                "siblings": [{"rfilename": name} for name in sorted(self.files)],
            }
            return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()
        prefix = f"/Qwen/Qwen3-0.6B/resolve/{COMMIT}/"
        name = path.removeprefix(prefix)
        if path.startswith("/Org/flaky/"):
            return 403, {}, b"forbidden"
        if not path.startswith(prefix) or name not in self.files:
            return 404, {"X-Error-Code": "EntryNotFound"}, b""
        data = self.files[name]
        if body:
            self.fetched.append(name)
            if not self.gate.is_set():
                self.waiting.set()
                self.gate.wait()
        return 200, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}, data

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(tiny_llama_dir: Path):
    hub = FakeHub(tiny_llama_dir)
    yield hub
    hub.close()


def test_a_download_fetches_only_what_the_trainer_and_vllm_read(
    fake_hub: FakeHub, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": fake_hub.endpoint}
    (result,) = resolve_in(env, [("Qwen/Qwen3-0.6B", None)], tmp_path / "cache")
    snapshot = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / COMMIT
    assert result == {"dir": str(snapshot), "hub_id": "Qwen/Qwen3-0.6B"}
    tiny = sorted(p.name for p in tiny_llama_dir.iterdir() if p.is_file())
    assert sorted(fake_hub.fetched) == tiny  # no README, .bin, consolidated, onnx/ or original/
    assert sorted(p.name for p in snapshot.iterdir()) == tiny
    assert (snapshot / "model.safetensors").read_bytes() == (
        tiny_llama_dir / "model.safetensors"
    ).read_bytes()
    # offline afterwards, the same name resolves from what was downloaded
    offline = resolve_in({**env, "HF_HUB_OFFLINE": "1"}, [("Qwen/Qwen3-0.6B", None)], tmp_path / "cache")
    assert offline == [result]


def test_unknown_gated_repos_and_revisions_on_the_hub_are_refused(fake_hub: FakeHub, tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": fake_hub.endpoint}
    cases = [("Org/private", None), ("Org/gated", None), ("Qwen/Qwen3-0.6B", "v9"), ("Org/flaky", None)]
    private, gated, revision, flaky = (r["error"] for r in resolve_in(env, cases, tmp_path / "cache"))
    assert private == (
        f"base_model 'Org/private' is no model repository on the Hugging Face Hub {fake_hub.endpoint} that this "
        "machine may read; check the name, or set HF_TOKEN to a token that may read the private repo"
    )
    assert gated == (
        "base_model 'Org/gated' is a gated repository on the Hugging Face Hub; accept its terms at "
        f"{fake_hub.endpoint}/Org/gated and set HF_TOKEN to a token of that account"
    )
    assert revision == (
        "base_model 'Qwen/Qwen3-0.6B' (revision 'v9'): the repository has no revision 'v9' on the Hugging Face "
        "Hub; name an existing branch, tag or commit"
    )
    assert flaky.startswith(
        f"base_model 'Org/flaky' could not be fetched from the Hugging Face Hub {fake_hub.endpoint} ("
    )
    assert flaky.endswith(
        f"and the cache {tmp_path / 'hf' / 'hub'} lacks it; check this machine's network access to {fake_hub.endpoint} (or HF_ENDPOINT) and try again"
    )
    assert fake_hub.fetched == []


CANCEL = """
import asyncio, sys
from art_mega.basemodels.resolve import resolve_base_model_off_loop

async def main():
    task = asyncio.create_task(resolve_base_model_off_loop("Qwen/Qwen3-0.6B", sys.argv[1]))
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the loop runs meanwhile
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        print("cancelled", flush=True)

asyncio.run(main())
"""


def test_a_download_in_progress_leaves_the_loop_running_and_a_cancel_ends_it_at_once(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    fake_hub.gate.clear()  # every file download hangs until the gate opens
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env = {**clean, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": fake_hub.endpoint}
    child = subprocess.Popen(
        [sys.executable, "-c", CANCEL, str(tmp_path / "cache")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake_hub.waiting.wait(60), "the download never started"
        child.stdin.write("cancel\n")
        child.stdin.flush()
        assert child.stdout.readline() == "cancelled\n"  # while the download still hangs
        assert not fake_hub.gate.is_set()
        fake_hub.gate.set()  # the files in flight finish; the process exits after them
        assert child.wait(60) == 0, child.stderr.read()
    finally:
        child.kill()
        child.communicate()


@pytest.mark.parametrize(
    "typo,meant", [("tiny-lama", "tiny-llama"), ("SmolLM2-135M-instruct", "SmolLM2-135M-Instruct")]
)
def test_a_base_model_typo_names_the_model_meant(tmp_path, monkeypatch, typo, meant):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(BaseModelError) as caught:
        resolve_base_model(typo, tmp_path / "cache")
    assert str(caught.value).startswith(f"base_model {typo!r} (did you mean {meant!r}?) ")


def test_a_cached_hub_repo_is_suggested_and_an_unrelated_name_gets_no_hint(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "models--Qwen--Qwen3-0.6B").mkdir(parents=True)
    assert near_names("qwen/qwen3-0.6b", tmp_path / "cache") == ["Qwen/Qwen3-0.6B"]
    assert near_names("Qwen/Qwen3-0.6", tmp_path / "cache")[0] == "Qwen/Qwen3-0.6B"
    with pytest.raises(BaseModelError) as caught:
        resolve_base_model("meta-llama/Llama-3.1-8B", tmp_path / "cache")
    assert "did you mean" not in str(caught.value)
