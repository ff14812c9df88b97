"""The warm replica interpreter (`art_mega.inference.warm` and its script in vllm_plugin/): a
process that imported a module becomes `python -m module ...` with the start's argv, environment,
working directory and log, and is refused (then stopped) when the start would differ from what
it was started with. A small module of the test's own stands in for vLLM's server, which the
inference tests' registered policy runs this way (tests/inference/test_backend_serving.py)."""

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from art_mega.inference.warm import WarmInterpreters
from art_mega.readahead import parse_line
from tests.conftest import pid_alive

pytestmark = pytest.mark.asyncio

SERVER = """
import json, os, sys
IMPORTED_WITH = os.environ.get("PROBE_VALUE")
os.environ["SET_AT_IMPORT"] = "by-import"  # as vLLM sets torch's variables when imported
if __name__ == "__main__":
    print("probe server runs", flush=True)
    with open(sys.argv[1], "w") as out:
        json.dump({"argv": sys.argv, "cwd": os.getcwd(), "value": os.environ.get("PROBE_VALUE"),
                   "late": os.environ.get("VLLM_CPU_KVCACHE_SPACE"), "imported_with": IMPORTED_WITH,
                   "stdin": sys.stdin.read(), "path0": sys.path[0],
                   "set_at_import": os.environ.get("SET_AT_IMPORT")}, out)
    sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


@pytest.fixture
def module_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "probe_server.py").write_text(SERVER)
    return folder


def _env(module_dir: Path, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PROBE_VALUE", "PROBE_EXIT")}
    return {**base, "PYTHONPATH": str(module_dir), "PROBE_VALUE": "a", **extra}


async def _wait_exit(process: asyncio.subprocess.Process) -> int:
    return await asyncio.wait_for(process.wait(), timeout=60)


async def test_the_warm_process_runs_the_module_with_the_starts_argv_env_cwd_and_log(module_dir, tmp_path):
    pool = WarmInterpreters(module="probe_server", preload=("json", "no_such_module_for_preload"))
    env = _env(module_dir, VLLM_CPU_KVCACHE_SPACE="1")
    warm = await pool.warm(sys.executable, env)
    assert await pool.warm(sys.executable, env) is warm  # the same start: the same process
    work, out, log = tmp_path / "work", tmp_path / "out.json", tmp_path / "replica.log"
    work.mkdir()
    log.write_text("=== header\n")
    process, why = await pool.hand_over(
        "vllm-0", [sys.executable, "-m", "probe_server", str(out)], {**env, "PROBE_EXIT": "7"}, str(work), log
    )
    # PROBE_EXIT is not in the warm environment: refused, and the warm process is stopped
    assert process is None and "PROBE_EXIT" in why
    assert warm.process.returncode is not None and pool.current is None
    assert not warm.output.exists()

    env = {**env, "PROBE_EXIT": "7"}
    warm = await pool.warm(sys.executable, env)
    process, why = await pool.hand_over(
        "vllm-0",
        [sys.executable, "-m", "probe_server", str(out)],
        {**env, "VLLM_CPU_KVCACHE_SPACE": "3"},  # read after import: may differ
        str(work),
        log,
    )
    assert why == "" and process is warm.process and pool.current is None
    assert await _wait_exit(process) == 7
    seen = json.loads(out.read_text())
    assert seen["argv"][1:] == [str(out)] and seen["argv"][0].endswith("probe_server.py")
    assert seen["cwd"] == str(work) and seen["path0"] == str(work)
    assert (seen["value"], seen["late"], seen["imported_with"]) == ("a", "3", "a")
    assert seen["stdin"] == ""  # stdin is /dev/null, as for a spawned replica
    assert seen["set_at_import"] == "by-import"  # what the import set stays, as in a fresh process
    text = log.read_text()
    # the refusal, with the refused process's output, then the start it ran
    refused, used = text.split(
        f"=== art-mega: replica vllm-0: its process is the warm interpreter (pid {warm.process.pid})\n"
    )
    assert (
        refused.startswith("=== header\n")
        and "not in warm interpreter" in refused
        and "PROBE_EXIT" in refused
    )
    text = used
    assert "could not preload no_such_module_for_preload" in text
    assert "probe_server imported, waiting" in text and text.rstrip().endswith("probe server runs")
    assert not warm.output.exists()


async def test_the_files_an_import_read_are_listed_and_read_ahead_the_next_time(module_dir, tmp_path):
    pool = WarmInterpreters(module="probe_server", preload=())
    env, cache = _env(module_dir), tmp_path / "cache"
    warm = await pool.warm(sys.executable, env, cache)
    listing = pool.files_read(sys.executable, cache)
    for _ in range(600):
        if "imported, waiting" in warm.output.read_text():
            break
        await asyncio.sleep(0.05)
    names = [parse_line(line)[0] for line in listing.read_text().splitlines()]  # art_mega.readahead's
    assert str(module_dir / "probe_server.py") in names
    assert any(n.endswith(".so") or ".so." in n for n in names)  # the libraries it mapped
    assert all(Path(n).is_file() for n in names)
    await pool.drop()
    listing.write_text(f"/no/such/file\n{tmp_path}\n")  # a stale list costs only its read-ahead
    warm = await pool.warm(sys.executable, env, cache)
    out = tmp_path / "out.json"
    process, why = await pool.hand_over(
        "vllm-0", [sys.executable, "-m", "probe_server", str(out)], env, str(tmp_path), tmp_path / "l"
    )
    assert why == "" and await _wait_exit(process) == 0 and json.loads(out.read_text())["value"] == "a"
    assert str(module_dir / "probe_server.py") in listing.read_text().splitlines()  # written anew
    assert listing.parent.name == "read-ahead"


async def test_another_interpreter_or_module_is_refused(module_dir, tmp_path):
    pool = WarmInterpreters(module="probe_server", preload=())
    env = _env(module_dir)
    warm = await pool.warm(sys.executable, env)
    process, why = await pool.hand_over(
        "vllm-0", ["/usr/bin/python3", "-m", "probe_server"], env, str(tmp_path), tmp_path / "l"
    )
    assert process is None and "/usr/bin/python3 -m probe_server" in why
    assert not pid_alive(warm.process.pid)
    warm = await pool.warm(sys.executable, env)
    process, why = await pool.hand_over(
        "vllm-0", [sys.executable, "-m", "other"], env, str(tmp_path), tmp_path / "l"
    )
    assert process is None and "other" in why and not pid_alive(warm.process.pid)
    process, why = await pool.hand_over(
        "vllm-0", [sys.executable, "-m", "probe_server"], env, str(tmp_path), tmp_path / "l"
    )
    assert (process, why) == (None, "")  # no warm interpreter: nothing to say


async def test_a_module_that_fails_to_import_fails_the_start_with_its_traceback_in_the_log(
    module_dir, tmp_path
):
    (module_dir / "broken_server.py").write_text("raise ImportError('broken on purpose')\n")
    pool = WarmInterpreters(module="broken_server", preload=())
    env = _env(module_dir)
    warm = await pool.warm(sys.executable, env)
    log = tmp_path / "replica.log"
    process, why = await pool.hand_over(
        "vllm-0", [sys.executable, "-m", "broken_server"], env, str(tmp_path), log
    )
    assert why == "" and process is warm.process
    assert await _wait_exit(process) == 1
    assert "ImportError: broken on purpose" in log.read_text()


async def test_another_environment_replaces_the_warm_process_and_drop_stops_it(module_dir, tmp_path):
    pool = WarmInterpreters(module="probe_server", preload=())
    first = await pool.warm(sys.executable, _env(module_dir))
    second = await pool.warm(sys.executable, _env(module_dir, PROBE_VALUE="b"))
    assert second is not first and not pid_alive(first.process.pid) and not first.output.exists()
    await pool.drop()
    await pool.drop()  # idempotent
    assert pool.current is None and not pid_alive(second.process.pid) and not second.output.exists()


async def test_a_warm_process_that_exited_is_not_used_and_its_output_reaches_the_log(module_dir, tmp_path):
    (module_dir / "dying_server.py").write_text(
        "import os\nprint('dying on import', flush=True)\nos._exit(3)\n"
    )
    pool = WarmInterpreters(module="dying_server", preload=())
    env = _env(module_dir)
    warm = await pool.warm(sys.executable, env)
    assert await _wait_exit(warm.process) == 3
    log = tmp_path / "replica.log"
    process, why = await pool.hand_over(
        "vllm-0", [sys.executable, "-m", "dying_server"], env, str(tmp_path), log
    )
    assert process is None and why == "the warm interpreter exited with code 3"
    text = log.read_text()
    assert "dying on import" in text and "not in warm interpreter" in text and "exited with code 3" in text
    assert not warm.output.exists()


async def test_an_interpreter_that_cannot_run_raises_oserror_and_leaves_no_scratch_file(
    tmp_path, monkeypatch
):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pool = WarmInterpreters(module="probe_server", preload=())
    with pytest.raises(OSError):
        await pool.warm(str(tmp_path / "no-python"), dict(os.environ))
    assert pool.current is None
    assert not list(tmp_path.glob("art-mega-warm-*"))
