"""art_mega.readahead: the listing's order, where it lives, and that reading ahead fills the page
cache (checked with util-linux's `fincore`, the kernel's own residency count)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from art_mega import readahead


def resident_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(out.split()[0])


def evicted(path: Path, size: int) -> Path:
    """`path` written with `size` bytes and dropped from the page cache."""
    path.write_bytes(os.urandom(size))
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


def wait_resident(path: Path, size: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (resident := resident_bytes(path)) < size and time.monotonic() < deadline:
        time.sleep(0.05)
    return resident


needs_fincore = pytest.mark.skipif(
    shutil.which("fincore") is None, reason="util-linux fincore is not installed"
)


def test_listing_paths_differ_by_kind_and_interpreter(tmp_path):
    a = readahead.listing_path(tmp_path, "trainer-rank", "/usr/bin/python3")
    assert a.parent == tmp_path / "read-ahead" and a.name.startswith("trainer-rank-") and a.suffix == ".files"
    assert a == readahead.listing_path(tmp_path, "trainer-rank", "/usr/bin/python3")
    assert a != readahead.listing_path(tmp_path, "controller", "/usr/bin/python3")
    assert a != readahead.listing_path(tmp_path, "trainer-rank", "/opt/venv/bin/python")


def test_libraries_come_before_their_package_and_loose_ones_first():
    modules = [
        ("json", ["/py/json/__pycache__/__init__.pyc", "/py/json/__init__.py"]),
        ("torch", ["/site/torch/__pycache__/__init__.pyc", "/site/torch/__init__.py"]),
        ("numpy", ["/site/numpy/__init__.py"]),
        ("torch.nn", ["/site/torch/nn/__init__.py"]),
        ("json.decoder", ["/py/json/decoder.py", "/py/json/decoder.py"]),
    ]
    mapped = [
        "/usr/bin/python3.11",
        "/site/numpy.libs/libopenblas.so",
        "/site/torch/lib/libtorch_cpu.so",
        "/site/torch/lib/libc10.so",
        "/usr/lib/libstdc++.so.6",
        "/site/torchvision/lib.so",  # not under torch/: a prefix of the name is not the folder
    ]
    assert readahead.needed_order(modules, mapped) == [
        "/usr/bin/python3.11",
        "/usr/lib/libstdc++.so.6",
        "/site/torchvision/lib.so",
        "/py/json/__pycache__/__init__.pyc",
        "/py/json/__init__.py",
        "/py/json/decoder.py",
        "/site/torch/lib/libtorch_cpu.so",
        "/site/torch/lib/libc10.so",
        "/site/torch/__pycache__/__init__.pyc",
        "/site/torch/__init__.py",
        "/site/torch/nn/__init__.py",
        "/site/numpy.libs/libopenblas.so",
        "/site/numpy/__init__.py",
    ]


def test_a_recorded_listing_names_what_the_process_imported_package_by_package(tmp_path):
    listing = tmp_path / "sub" / "probe.files"
    script = f"import json, sys; sys.path.insert(0, {str(Path(readahead.__file__).parent)!r}); import readahead; readahead.record({str(listing)!r})"
    subprocess.run([sys.executable, "-c", script], check=True)
    parsed = [readahead.parse_line(line) for line in listing.read_text().splitlines()]
    lines = list(dict.fromkeys(path for path, _, _ in parsed))
    assert all(os.path.isabs(p) and os.path.isfile(p) for p in lines)
    assert len(parsed) == len(set(parsed))
    # the interpreter is mapped: only the ranges of it that the process touched, within the file
    ranges = [(o, n) for p, o, n in parsed if os.path.realpath(p) == os.path.realpath(sys.executable)]
    size = os.path.getsize(sys.executable)
    assert ranges and all(n > 0 and o % 4096 == 0 and o + n <= size + 4096 for o, n in ranges)
    assert ranges == sorted(ranges) and all(a + n < b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    in_json = [i for i, p in enumerate(lines) if os.sep + "json" + os.sep in p]
    assert len(in_json) >= 4 and in_json == list(range(in_json[0], in_json[0] + len(in_json)))  # one group
    assert not list(listing.parent.glob("*.partial"))


def test_nothing_is_read_for_a_missing_listing_and_an_unwritable_one_raises_nothing(tmp_path):
    assert readahead.read_ahead(None) is False
    assert readahead.read_ahead(tmp_path / "absent.files") is False
    blocker = tmp_path / "file"
    blocker.write_text("")
    readahead.record(blocker / "cannot" / "be.files")  # a folder under a file: no listing, no error
    assert not (blocker / "cannot").exists()
    # a module whose attributes raise (a lazy-import proxy) costs the listing, never the caller
    script = f"""
import sys
sys.path.insert(0, {str(Path(readahead.__file__).parent)!r})
import readahead
class Proxy:
    def __getattr__(self, name):
        raise RuntimeError("a lazy module that cannot load")
sys.modules["lazy_proxy"] = Proxy()
readahead.record({str(tmp_path / "proxy.files")!r})
print("returned")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "returned\n", done.stderr
    assert list(tmp_path.glob("*.partial")) == []


@needs_fincore
def test_reading_a_listing_ahead_fills_the_page_cache(tmp_path):
    size = 8 << 20
    data = evicted(tmp_path / "lib.so", size)
    assert resident_bytes(data) < size // 2
    listing = tmp_path / "x.files"
    listing.write_text(f"{data}\t0\t{size // 2}\n{tmp_path / 'gone.so'}\n{data}\t{size // 2}\t0\n")
    assert readahead.read_ahead(listing) is True
    assert wait_resident(data, size) == size


@needs_fincore
def test_a_model_folder_is_read_ahead_weights_and_configs_only(tmp_path):
    weights = evicted(tmp_path / "model.safetensors", 4 << 20)
    config = tmp_path / "config.json"
    config.write_text("{}")
    other = evicted(tmp_path / "notes.bin", 4 << 20)
    (tmp_path / "original").mkdir()
    nested = evicted(tmp_path / "original" / "consolidated.safetensors", 4 << 20)
    thread = readahead.read_ahead_model(tmp_path)
    assert thread is not None
    thread.join(10)
    assert wait_resident(weights, 4 << 20) == 4 << 20
    assert resident_bytes(other) < 2 << 20 and resident_bytes(nested) < 2 << 20


def test_a_model_larger_than_half_the_available_memory_is_not_read_ahead(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    assert readahead.read_ahead_model(tmp_path, available_bytes=4096) is None
    assert readahead.read_ahead_model(tmp_path / "absent") is None
    assert readahead.read_ahead_model(None) is None
    thread = readahead.read_ahead_model(tmp_path, available_bytes=8192)
    assert thread is not None
    thread.join(10)


def test_a_mapped_library_is_listed_by_the_pages_the_process_touched(tmp_path):
    library = evicted(tmp_path / "libfake.so", 512 * 4096)
    weights = evicted(tmp_path / "model.safetensors", 64 * 4096)
    listing = tmp_path / "lib.files"
    script = f"""
import mmap, sys
sys.path.insert(0, {str(Path(readahead.__file__).parent)!r})
import readahead
with open({str(library)!r}, "rb") as f, open({str(weights)!r}, "rb") as w:
    view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_EXEC)  # as the loader maps code
    data = mmap.mmap(w.fileno(), 0, prot=mmap.PROT_READ)  # as safetensors maps weights
    for page in (0, 300, 305):
        view[page * 4096]
    data[:]
    readahead.record({str(listing)!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    named = [readahead.parse_line(line) for line in listing.read_text().splitlines()]
    assert str(weights) not in [p for p, _, _ in named]  # mapped for reading only: not a library
    ranges = [(o, n) for p, o, n in named if p == str(library)]
    covers = lambda page: [r for r in ranges if r[0] <= page * 4096 < r[0] + r[1]]  # noqa: E731
    assert covers(0) and covers(300) and covers(300) == covers(305)  # 5 pages apart: one range
    assert not any(covers(p) for p in range(100, 250))  # untouched pages are not listed
    assert all(n > 0 for _, n in ranges)


def _processes_reading(listing: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(listing).encode() in argv and any(a.endswith(b"readahead.py") for a in argv):
            found.append(int(entry.name))
    return found


def test_the_reading_process_holds_none_of_the_callers_descriptors_and_says_what_it_is(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading blocks until a writer comes: the reader waits there
    listing = tmp_path / "fifo.files"
    listing.write_text(f"{fifo}\n")
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)  # as a rank's --fd socket is
    try:
        assert readahead.read_ahead(listing) is True
        deadline = time.monotonic() + 10
        while not (readers := _processes_reading(listing)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(readers) == 1  # `python -S -I .../readahead.py LISTING`, waiting on the fifo
        os.close(write_end)
        write_end = -1
        os.set_blocking(read_end, False)
        assert os.read(read_end, 1) == b""  # end of file now: the reader does not hold the pipe
    finally:
        if write_end >= 0:
            os.close(write_end)
        os.close(read_end)
        writer = os.open(fifo, os.O_RDWR)  # a writer (Linux: never blocks): the reader's open returns
    try:
        deadline = time.monotonic() + 10
        while _processes_reading(listing) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_reading(listing) == []  # it ends with its list
    finally:
        os.close(writer)
