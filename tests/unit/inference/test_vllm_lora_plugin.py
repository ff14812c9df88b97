"""art-mega's vLLM general plugin (art_mega/inference/vllm_plugin): its LoRA ops compute what
vLLM 0.32's CPU ops compute (their gather-and-einsum written out below), except that a token
whose index is -1 (no adapter) gets no LoRA delta, as on vLLM's GPU kernels; its fork plugin forks
only a single-process replica whose environment says fork; its dist-info names entry points that
resolve, and every replica gets it on PYTHONPATH (GPU replicas for the serving middleware
only: the LoRA and fork plugins change nothing off the CPU platform)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from art_mega.inference.protocol import ReplicaLaunch
from art_mega.inference.replica import VLLM_PLUGIN_DIR, vllm_env
from tests.conftest import REPO

MODULE = "art_mega_vllm_lora"
FORK_MODULE = "art_mega_vllm_fork"


@pytest.fixture(scope="module")
def plugin():
    """The plugin module, imported as vLLM's interpreter sees it: a top-level module."""
    spec = importlib.util.spec_from_file_location(MODULE, VLLM_PLUGIN_DIR / f"{MODULE}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gathered(weights, indices, dtype):
    """vLLM's per-token gather, [T, out, in], with a zero matrix where the index is -1 (no adapter;
    vLLM's CPU ops take the last slot there, its GPU kernels skip the token)."""
    selected = weights[indices.clamp(min=0)].to(dtype=dtype)
    if len(selected.shape) == 4:
        selected = selected.squeeze(dim=1)
    return selected * (indices >= 0).to(dtype=dtype)[:, None, None]


# vLLM 0.32's vllm/lora/ops/torch_ops/lora_ops.py, the functions the plugin replaces (same
# signatures), with `gathered` for their `weights[indices]`.
def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    selected = gathered(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    outputs = torch.einsum("bi, boi -> bo", inputs.to(dtype=output_tensor.dtype), selected)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    selected = gathered(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    outputs = torch.einsum("bi, boi -> bo", inputs.to(dtype=output_tensor.dtype), selected)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(
    inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True
):
    selected = gathered(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    outputs = torch.einsum("bi, boi -> bo", inputs.to(dtype=output_tensor.dtype), selected)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


REFERENCE = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}
ONE = [1] * 5
MIXED = [0, 2, -1, 2, 0]  # -1: no adapter


def call_both(plugin, name, inputs, weights, output, *rest):
    """(vLLM's output, the plugin's output) of `name` on copies of `output`."""
    expected, got = output.clone(), output.clone()
    REFERENCE[name](inputs, weights, expected, *rest)
    getattr(plugin, name)(inputs, weights, got, *rest)
    return expected, got


@pytest.mark.parametrize("slots", [ONE, MIXED], ids=["one-adapter", "mixed-with-minus-1"])
@pytest.mark.parametrize("stacked_dims", [3, 4])
def test_shrink_is_vllms(plugin, slots, stacked_dims) -> None:
    torch.manual_seed(0)
    inputs, weights = torch.randn(5, 16), torch.randn(3, 1, 4, 16)
    weights = weights if stacked_dims == 4 else weights.squeeze(1)
    output = torch.full((5, 6), 7.0)  # wider than the rank: columns 4, 5 stay as they were
    expected, got = call_both(plugin, "bgmv_shrink", inputs, weights, output, torch.tensor(slots), 0.5)
    torch.testing.assert_close(got, expected)
    assert (got[:, 4:] == 7.0).all() and not (got[:, :4] == 7.0).any()


@pytest.mark.parametrize("slots", [ONE, MIXED], ids=["one-adapter", "mixed-with-minus-1"])
@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_is_vllms(plugin, slots, add_inputs) -> None:
    torch.manual_seed(1)
    inputs, weights = torch.randn(5, 4), torch.randn(3, 1, 10, 4)
    output = torch.randn(5, 8)  # narrower than the adapter's 10: the common 8 columns
    expected, got = call_both(plugin, "bgmv_expand", inputs, weights, output, torch.tensor(slots), add_inputs)
    torch.testing.assert_close(got, expected)
    assert not torch.equal(got, output)


def test_expand_of_one_row_is_broadcast_over_the_output(plugin) -> None:
    torch.manual_seed(2)
    inputs, weights, output = torch.randn(1, 4), torch.randn(2, 6, 4), torch.zeros(3, 6)
    expected, got = call_both(plugin, "bgmv_expand", inputs, weights, output, torch.tensor([1]), True)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got[2], inputs[0] @ weights[1].t())


@pytest.mark.parametrize("slots", [ONE, MIXED], ids=["one-adapter", "mixed-with-minus-1"])
@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("offset", [0, 3])
def test_expand_slice_is_vllms(plugin, slots, add_inputs, offset) -> None:
    torch.manual_seed(3)
    inputs, weights, output = torch.randn(5, 4), torch.randn(3, 1, 3, 4), torch.randn(5, 9)
    rest = (torch.tensor(slots), offset, 3, add_inputs)
    expected, got = call_both(plugin, "bgmv_expand_slice", inputs, weights, output, *rest)
    torch.testing.assert_close(got, expected)
    outside = [c for c in range(9) if not offset <= c < offset + 3]
    assert torch.equal(got[:, outside], output[:, outside]) and not torch.equal(got, output)


@pytest.mark.parametrize("slots", [[-1] * 3, [1, -1, 1]], ids=["all-base", "mixed"])
def test_a_token_without_an_adapter_gets_no_lora_delta(plugin, slots) -> None:
    """Index -1 is the last slot to vLLM 0.32's CPU ops, so a base-model token batched with LoRA
    tokens on a replica whose slots are all loaded got the last adapter's delta."""
    torch.manual_seed(6)
    inputs, weights, indices = torch.randn(3, 8), torch.randn(2, 4, 8), torch.tensor(slots)
    shrunk = torch.full((3, 4), 9.0)
    plugin.bgmv_shrink(inputs, weights, shrunk, indices, 1.0)
    expanded = torch.ones(3, 8)
    plugin.bgmv_expand(torch.randn(3, 8), torch.randn(2, 8, 8), expanded, indices, True)
    base = indices < 0
    assert (shrunk[base] == 0).all() and (expanded[base] == 1).all()
    if not base.all():
        torch.testing.assert_close(shrunk[~base], inputs[~base] @ weights[1].t())
        assert not (expanded[~base] == 1).all()


def test_products_are_cast_to_the_output_dtype(plugin) -> None:
    torch.manual_seed(4)
    inputs, weights = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(3, 4, 16, dtype=torch.bfloat16)
    output = torch.zeros(5, 4)
    expected, got = call_both(plugin, "bgmv_shrink", inputs, weights, output, torch.tensor(MIXED), 1.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


def test_indices_rewritten_in_place_are_regrouped(plugin) -> None:
    """vLLM rewrites its index buffer in place between steps: the remembered grouping must follow."""
    torch.manual_seed(5)
    inputs, weights, indices = torch.randn(4, 8), torch.randn(2, 3, 8), torch.zeros(4, dtype=torch.long)
    first = plugin.adapter_groups(indices)
    assert plugin.adapter_groups(indices.clone()) is first and first[0][0] == 0 and first[0][1] is None
    indices[2:] = 1
    expected, got = call_both(plugin, "bgmv_shrink", inputs, weights, torch.zeros(4, 3), indices, 1.0)
    torch.testing.assert_close(got, expected)
    assert [(slot, rows.tolist()) for slot, rows in plugin.adapter_groups(indices)] == [
        (0, [0, 1]),
        (1, [2, 3]),
    ]


def test_a_vllm_with_other_functions_is_left_alone(plugin) -> None:
    vllm = {name: SimpleNamespace(**REFERENCE) for name in plugin.PATCHED_MODULES}
    assert plugin.patch_problem(vllm) is None

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True, scale=1.0):
        return None

    changed = dict(
        vllm, **{plugin.PATCHED_MODULES[0]: SimpleNamespace(**dict(REFERENCE, bgmv_expand=bgmv_expand))}
    )
    assert plugin.patch_problem(changed) == (
        "vllm.lora.ops.torch_ops.lora_ops.bgmv_expand takes (inputs, lora_b_weights, output_tensor, "
        "lora_indices_tensor, add_inputs=True, scale=1.0), not (inputs, lora_b_weights, output_tensor, "
        "lora_indices_tensor, add_inputs=True)"
    )
    rebound = dict(vllm, **{plugin.PATCHED_MODULES[2]: SimpleNamespace(**dict(REFERENCE, bgmv_shrink=print))})
    assert plugin.patch_problem(rebound) == (
        "vllm.lora.punica_wrapper.punica_cpu.bgmv_shrink is not vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink"
    )


def test_the_dist_info_names_entry_points_that_resolve(plugin, monkeypatch) -> None:
    (dist,) = importlib.metadata.distributions(path=[str(VLLM_PLUGIN_DIR)])
    assert dist.metadata["Name"] == "art-mega-vllm-lora"
    entries = {e.name: e for e in dist.entry_points.select(group="vllm.general_plugins")}
    assert set(entries) == {"art_mega_lora", "art_mega_fork"}
    monkeypatch.syspath_prepend(str(VLLM_PLUGIN_DIR))
    for name, module in (("art_mega_lora", MODULE), ("art_mega_fork", FORK_MODULE)):
        monkeypatch.delitem(sys.modules, module, raising=False)
        loaded = entries[name].load()
        assert loaded.__name__ == "register" and loaded.__module__ == module
        assert Path(sys.modules[module].__file__).resolve() == (VLLM_PLUGIN_DIR / f"{module}.py").resolve()


def parallel(world: int, data: int, backend: str = "uni") -> SimpleNamespace:
    """The fields of a VllmConfig that `fork_problem` reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            world_size=world, data_parallel_size=data, distributed_executor_backend=backend
        )
    )


@pytest.fixture(scope="module")
def fork():
    spec = importlib.util.spec_from_file_location(FORK_MODULE, VLLM_PLUGIN_DIR / f"{FORK_MODULE}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_a_one_process_replica_whose_environment_says_fork_forks(fork) -> None:
    assert fork.fork_problem(parallel(1, 1), "fork") is None
    assert "is 'spawn', not 'fork'" in fork.fork_problem(parallel(1, 1), "spawn")
    assert "is None, not 'fork'" in fork.fork_problem(parallel(1, 1), None)
    assert "2 worker(s) x 1" in fork.fork_problem(parallel(2, 1), "fork")  # tensor parallel
    assert "1 worker(s) x 2" in fork.fork_problem(parallel(1, 2), "fork")  # data parallel
    # the CPU platform's mp executor starts a worker process: its OpenMP set-up needs a fresh one
    assert "through the 'mp' executor, not in-process" in fork.fork_problem(parallel(1, 1, "mp"), "fork")
    assert "None worker(s)" in fork.fork_problem(SimpleNamespace(), "fork")  # another vLLM's config


def test_a_fork_needs_every_preloaded_library_already_loaded_and_alone(fork, tmp_path) -> None:
    torch_gomp, tcmalloc = tmp_path / "torch" / "libgomp.so.1", tmp_path / "libtcmalloc.so.4"
    system_gomp, vendored = (
        tmp_path / "sys" / "libgomp.so.1.0.0",
        tmp_path / "sp" / "libgomp-6a29c32d.so.1.0.0",
    )
    link = tmp_path / "gomp-link.so"
    for path in (torch_gomp, tcmalloc, system_gomp, vendored):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    link.symlink_to(torch_gomp)
    mapped = {str(torch_gomp), "/usr/lib/libc.so.6", str(vendored)}  # a vendored libgomp is another library
    assert fork.preload_problem("", mapped) is None
    assert fork.preload_problem(str(torch_gomp), mapped) is None
    assert fork.preload_problem(str(link), mapped) is None  # by real path
    assert fork.preload_problem(f"{torch_gomp}:{tcmalloc}", mapped) == (
        f"LD_PRELOAD names {tcmalloc}, which is not loaded in this process"
    )
    # a malloc replaces malloc only when preloaded at the start, not when loaded later
    with_malloc = mapped | {str(tcmalloc)}
    assert fork.preload_problem(f"{torch_gomp} {tcmalloc}", with_malloc) == (
        f"LD_PRELOAD names {tcmalloc}, a malloc this process did not start with"
    )
    assert fork.preload_problem(f"{torch_gomp} {tcmalloc}", with_malloc, started_with=str(tcmalloc)) is None
    # two copies of one OpenMP runtime (the system's is libgomp.so.1 -> libgomp.so.1.0.0)
    assert fork.preload_problem(str(torch_gomp), mapped | {str(system_gomp)}) == (
        f"this process maps {system_gomp} beside LD_PRELOAD's {torch_gomp}"
    )
    assert str(Path(sys.executable).resolve()) in fork.mapped_files()  # this interpreter is mapped


FORKING_SERVER = """
import os, socket, sys, time
sys.path.insert(0, sys.argv[1])
import art_mega_vllm_fork as fork

listener = socket.socket()  # the server's port: bound before the fork, listened on after (vLLM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", 0))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 0))
os.register_at_fork(before=fork._before_fork, after_in_child=fork.forked_child)
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:  # the engine core: says it is set up, then works until it is killed
    os.write(ready_w, b"x")
    while True:
        time.sleep(0.1)
os.read(ready_r, 1)
listener.listen()
print(listener.getsockname()[1], udp.fileno(), listener.fileno(), pid, flush=True)
sys.stdin.readline()  # the test checks the child's descriptors meanwhile
listener.close()
print("closed", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), 9)  # the server dies without cleaning up
"""


def _line(stream, timeout_s: float = 30.0) -> str:
    """The next line of a child's pipe, or AssertionError after `timeout_s` (a wedged child)."""
    import select

    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, f"no line from the child within {timeout_s} s"
    return stream.readline()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_a_forked_child_lets_go_of_the_servers_port_and_dies_with_it(tmp_path) -> None:
    """The child a server forks keeps no copy of its listening socket (the port is free once the
    server closes its own) and ends when the server is killed (its parent-death signal)."""
    import os
    import socket
    import subprocess
    import time

    script = tmp_path / "server.py"
    script.write_text(FORKING_SERVER)
    server = subprocess.Popen(
        [sys.executable, str(script), str(VLLM_PLUGIN_DIR)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        port, udp_fd, listener_fd, child = map(int, _line(server.stdout).split())
        fds = Path(f"/proc/{child}/fd")
        assert os.readlink(fds / str(listener_fd)) == "/dev/null"  # released in place
        assert os.readlink(fds / str(udp_fd)).startswith("socket:")  # not TCP: kept
        server.stdin.write("\n")
        server.stdin.flush()
        assert _line(server.stdout).strip() == "closed"
        with socket.socket() as again:  # nobody listens on the port any more
            again.bind(("127.0.0.1", port))
            again.listen()
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), f"the forked child {child} outlived its killed parent"
        err = server.stderr.read()
        assert f"forked process {child} released TCP socket descriptor(s) [{listener_fd}] and ends with the server" in err
    finally:
        server.kill()
        if child is not None and not _gone(child):
            os.kill(child, 9)


def test_release_listeners_without_a_descriptor_folder_releases_nothing(fork, tmp_path) -> None:
    assert fork.release_listeners(str(tmp_path / "no-such-dir")) == []


def test_a_built_wheel_carries_the_plugins_files() -> None:
    """Every file of the plugin directory matches the package-data the wheel is built with."""
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["art_mega.inference.vllm_plugin"]
    files = {p for p in VLLM_PLUGIN_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    carried = {p for pattern in patterns for p in VLLM_PLUGIN_DIR.glob(pattern) if p.is_file()}
    assert files and files == carried


def test_replicas_get_the_plugin_first_on_pythonpath(tmp_path) -> None:
    launch = ReplicaLaunch(
        model="/m", served_model_name="tiny", log_dir=str(tmp_path), python="/opt/vllm/bin/python"
    )
    plugin_dir = str(VLLM_PLUGIN_DIR)
    assert vllm_env(launch, {"PYTHONPATH": "/agent"}, on_cpu=True)["PYTHONPATH"] == plugin_dir
    same = launch.model_copy(update={"python": sys.executable})
    assert vllm_env(same, {"PYTHONPATH": "/agent"}, on_cpu=True)["PYTHONPATH"] == f"{plugin_dir}:/agent"
    # a GPU replica too: its server loads the middleware from there
    assert vllm_env(launch, {"PYTHONPATH": "/agent"})["PYTHONPATH"] == plugin_dir
    assert vllm_env(same, {"PYTHONPATH": "/agent"})["PYTHONPATH"] == f"{plugin_dir}:/agent"
    users = launch.model_copy(update={"env": {"PYTHONPATH": "/mine"}})
    assert vllm_env(users, {}, on_cpu=True)["PYTHONPATH"] == f"{plugin_dir}:/mine"  # the plugin stays
