"""Read ahead, into the page cache, the files a process read the last time it started.

A process whose files have left the page cache waits for every page of every module and shared
library it imports, one fault or one small read at a time. This machine's memory reclaim empties
most of the page cache within minutes of idling (2.85 GiB of cache fell to 0.43 GiB in about
four idle minutes), so a run started a few minutes after the last one starts cold: art-mega's
quickstart reached its first rollout in 26-30 s against 15-18 s with its files cached (ad-hoc
runs of benchmarks/peers_trl.py's program, 2026-12-02). Asking the kernel for the files up front
(`posix_fadvise(POSIX_FADV_WILLNEED)`, which starts reading and returns) turns those waits into
a few large reads: the disk reads 1.4 GB/s sequentially here, and the listings of a controller,
a trainer rank and a vLLM server name 0.2-0.45 GB each. Side by side after dropping the page
cache (ad hoc, three alternating runs each), the quickstart program's start-up went from 22.3,
24.7 and 31.2 s to 19.4, 20.3 and 23.5 s with this and the start-up changes made with it (the
warm interpreter's frozen heap, the chat template looked up during the engine core's load).

A listing is a text file, one absolute path a line (the whole file), or for a shared library (a
file the process maps executable) the path, a tab, a byte offset, a tab and a length (one range
of it): the pages of a library the
process touched, found in its page tables (`/proc/self/pagemap`), runs closer than 128 KiB taken
as one. vLLM's server maps 1.56 GB of shared libraries and touches about an eighth of them
(`/proc/self/smaps`: 68 of triton's 500 MB, 50 of libtorch_cpu's 434 MB); reading all of them
would queue a gigabyte of reads in front of the pages the import waits for. The lines come in
the order the process first needed them:
the shared libraries it mapped that belong to no imported package (the interpreter's own, the C
library), then, package by package in the order of their first import, the shared libraries
under the package's folder (a package's `*.libs` folder too) and each of its modules' bytecode
and source files in the order their imports finished (`sys.modules`' order, where a package
follows the submodules its `__init__` imports).

`read_ahead` has a process of its own read a listing (a missing or unreadable listing reads
nothing); `record` writes one (atomically, replacing the last) once the process has imported what
its start needs. `listing_path` is where a host keeps them: `<cache_root>/read-ahead/`, one file
per kind of process and interpreter.

Only the standard library is imported: the replica's warm interpreter, which runs in vLLM's
interpreter where art_mega is not installed, loads this file by its path.
"""

from __future__ import annotations

import array
import os
import sys
import threading
from pathlib import Path
from typing import Any

SUBDIR = "read-ahead"
READ_AHEAD_ENV = "ART_MEGA_READ_AHEAD"
"""The listing a trainer rank reads ahead at its start and writes once ready (set by
`trainer.remote.TrainerService.start`)."""


def listing_path(cache_root: str | os.PathLike[str], kind: str, interpreter: str) -> Path:
    """The listing of the process kind `kind` ("trainer-rank", "controller", ...) run by
    `interpreter` (its path, with what tells its program apart) under a host's `cache_root`."""
    import hashlib  # here: the read-ahead process, which runs this file, needs no libcrypto

    key = hashlib.sha256(f"{interpreter}\0{kind}".encode()).hexdigest()[:16]
    return Path(cache_root) / SUBDIR / f"{kind}-{key}.files"


def parse_line(line: str) -> tuple[str, int, int]:
    """A listing line as (path, offset, length in bytes; 0: to the end of the file)."""
    path, tab, rest = line.partition("\t")
    if tab:
        offset, _, length = rest.partition("\t")
        if offset.isdigit() and length.isdigit():
            return path, int(offset), int(length)
    return line, 0, 0


def _advise(lines: list[str]) -> None:
    fd, current = -1, None
    try:
        for line in lines:
            path, offset, length = parse_line(line)
            if path != current:
                if fd >= 0:
                    os.close(fd)
                current = path
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    fd = -1
            if fd < 0:
                continue
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):
                pass
    finally:
        if fd >= 0:
            os.close(fd)


def read_ahead(listing: str | os.PathLike[str] | None) -> bool:
    """Have a process of its own ask the kernel to read every file (or range) `listing` names;
    False when there is no listing (None, missing or unreadable) or no process could be forked.

    Not a thread: between two of its thousands of calls a thread waits for the GIL, which the
    importing thread holds for up to the switch interval (5 ms) each time, so the list would be
    read at about 200 lines a second, while the import it should run ahead of would be made to
    hand the GIL over as often. The process is forked twice, the middle one reaped at once, so
    nothing is left for this process to wait for; it runs this file as a script (`python -S -I
    readahead.py LISTING`, its command line saying what it is), holding none of this process's
    descriptors (stdin, stdout and stderr are /dev/null), and ends when its list does."""
    if not listing or not os.path.isfile(listing):
        return False
    try:
        child = os.fork()
    except OSError:
        return False
    if child == 0:  # pragma: no cover - runs in the forked processes
        try:
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                limit = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else -1
                os.closerange(3, limit if limit > 3 else 65536)
                os.execv(
                    sys.executable, [sys.executable, "-S", "-I", os.path.abspath(__file__), str(listing)]
                )
        finally:
            os._exit(0)
    try:
        os.waitpid(child, 0)
    except ChildProcessError:  # SIGCHLD ignored: the kernel reaped it
        pass
    return True


MODEL_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".txt", ".tiktoken")
"""The files of a model folder that a trainer rank or a vLLM server reads (weights, configs,
tokenizer), read ahead by `read_ahead_model`."""


def _available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_ahead_model(
    folder: str | os.PathLike[str] | None, available_bytes: int | None = None
) -> threading.Thread | None:
    """Start a daemon thread reading ahead the files directly in the model folder `folder`
    whose names end in MODEL_SUFFIXES; None (nothing read) when `folder` is None or not a
    folder, or when those files take more than half of the memory available (`available_bytes`,
    None: MemAvailable now), where they would push each other, and everything else, out of the
    page cache."""
    if not folder or not os.path.isdir(folder):
        return None
    try:
        paths = sorted(e.path for e in os.scandir(folder) if e.is_file() and e.name.endswith(MODEL_SUFFIXES))
        size = sum(os.path.getsize(p) for p in paths)
    except OSError:
        return None
    available = _available_bytes() if available_bytes is None else available_bytes
    if available is not None and size > available // 2:
        return None
    thread = threading.Thread(target=_advise, args=(paths,), name="art-mega-read-ahead-model", daemon=True)
    thread.start()
    return thread


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MERGE_GAP = 32
"""Pages between two touched runs of a shared library below which the listing reads them as one
range (128 KiB with 4 KiB pages, the kernel's default read-ahead window)."""


def _touched(pagemap: Any, start: int, end: int, offset: int) -> list[tuple[int, int]]:
    """(file offset, length) of the pages of the mapping [start, end) at file `offset` that this
    process has in its page tables (`/proc/self/pagemap` bit 63 or 62: present or swapped),
    runs closer than MERGE_GAP pages merged."""
    pages = (end - start) // PAGE
    pagemap.seek(start // PAGE * 8)
    entries = array.array("Q")
    entries.frombytes(pagemap.read(pages * 8))
    runs: list[list[int]] = []
    mask = 3 << 62
    for index, entry in enumerate(entries):
        if entry & mask:
            if runs and index - runs[-1][1] <= MERGE_GAP:
                runs[-1][1] = index + 1
            else:
                runs.append([index, index + 1])
    return [(offset + a * PAGE, (b - a) * PAGE) for a, b in runs]


def mapped_files(
    maps: str = "/proc/self/maps", pagemap: str = "/proc/self/pagemap"
) -> list[tuple[str, list[tuple[int, int]] | None]]:
    """The shared libraries this process maps (files with an executable mapping: not a model's
    weights or a dataset it maps for reading, which could be far larger than the memory), in the
    order of their first mapping (address order), each with the (offset, length) ranges of all
    its mappings that the process touched, or None where that cannot be read (then the whole
    file is listed)."""
    found: dict[str, list[tuple[int, int]] | None] = {}
    try:
        with open(maps, errors="surrogateescape") as lines:
            mappings = [line.split(maxsplit=5) for line in lines]
    except OSError:
        return []
    executable = {f[5].rstrip("\n") for f in mappings if len(f) == 6 and f[5].startswith("/") and "x" in f[1]}
    try:
        table = open(pagemap, "rb", buffering=0)
    except OSError:
        table = None
    try:
        for fields in mappings:
            if len(fields) != 6 or fields[5].rstrip("\n") not in executable:
                continue
            path = fields[5].rstrip("\n")
            ranges = found.setdefault(path, [])
            if ranges is None:
                continue
            try:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                touched = _touched(table, start, end, int(fields[2], 16)) if table is not None else None
            except (OSError, ValueError):
                touched = None
            if touched is None:
                found[path] = None
            else:
                ranges.extend(touched)
    finally:
        if table is not None:
            table.close()
    return [(path, None if ranges is None else _merged(ranges)) for path, ranges in found.items()]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` (offset, length) of one file, from all its mappings, sorted and joined where
    they overlap or lie closer than MERGE_GAP pages."""
    joined: list[list[int]] = []
    for offset, length in sorted(ranges):
        if joined and offset <= joined[-1][1] + MERGE_GAP * PAGE:
            joined[-1][1] = max(joined[-1][1], offset + length)
        else:
            joined.append([offset, offset + length])
    return [(a, b - a) for a, b in joined]


def needed_order(modules: list[tuple[str, list[str]]], mapped: list[str]) -> list[str]:
    """The listing's order (see the module docstring) of `modules` ((name, its files) in import
    order) and the `mapped` files; each path once."""
    roots: dict[str, tuple[str, str]] = {}  # top-level package -> its folder, `<folder>.libs`
    groups: dict[str, list[str]] = {}  # top-level package -> its modules' files, in import order
    for name, files in modules:
        top = name.partition(".")[0]
        groups.setdefault(top, []).extend(files)
        package = [f for f in files if os.path.basename(f).startswith("__init__.")]
        if name == top and package:
            folder = os.path.dirname(package[-1])  # the source's folder, not __pycache__
            roots[top] = (folder + os.sep, folder + ".libs" + os.sep)
    loose: list[str] = []
    libraries: dict[str, list[str]] = {}
    for path in mapped:
        owner = next((top for top, prefixes in roots.items() if path.startswith(prefixes)), None)
        (loose if owner is None else libraries.setdefault(owner, [])).append(path)
    ordered: dict[str, None] = dict.fromkeys(loose)
    for top, files in groups.items():
        ordered.update(dict.fromkeys(libraries.get(top, [])))
        ordered.update(dict.fromkeys(files))
    return list(ordered)


def record(listing: str | os.PathLike[str] | None) -> None:
    """Write the files this process has read in its imports, and the shared libraries it maps,
    to `listing` in need order (atomically); nothing when `listing` is None. Never raises (an
    agent records before it stops its children, a rank after it reported ready): a listing it
    cannot make leaves the last one, or none, and the next start reads that."""
    if not listing:
        return
    partial = None
    try:
        lines = _listing_lines()
        target = Path(listing)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("".join(f"{line}\n" for line in lines), errors="surrogateescape")
        os.replace(partial, target)
        partial = None
    except Exception:  # noqa: BLE001 - an optimisation only, see the docstring
        pass
    finally:
        if partial is not None:
            try:
                partial.unlink()
            except OSError:
                pass


def _listing_lines() -> list[str]:
    modules = []
    for name, module in list(sys.modules.items()):
        files = []
        # the bytecode first: an import reads it, and only checks the source's time
        for path in (
            getattr(getattr(module, "__spec__", None), "cached", None),
            getattr(module, "__file__", None),
        ):
            if isinstance(path, str) and os.path.isabs(path):
                # an extension module is mapped: /proc/self/maps names it by its real path
                is_library = path.endswith(".so") or ".so." in os.path.basename(path)
                files.append(os.path.realpath(path) if is_library else path)
        modules.append((name, files))
    mapped = dict(mapped_files())
    lines = []
    for path in needed_order(modules, list(mapped)):
        if "\t" in path or "\n" in path or not os.path.isfile(path):
            continue
        ranges = mapped.get(path)
        if ranges == []:
            continue  # mapped, never touched: the loader's one read of its headers needs no help
        if ranges is None:  # a module's file, or a mapping whose pages could not be read: all of it
            lines.append(path)
        else:
            lines.extend(f"{path}\t{offset}\t{length}" for offset, length in ranges)
    return lines


if __name__ == "__main__":  # `read_ahead`'s process
    try:
        _advise(Path(sys.argv[1]).read_text().splitlines())
    except (OSError, UnicodeDecodeError, IndexError):
        pass
