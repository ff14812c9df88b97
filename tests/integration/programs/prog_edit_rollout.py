"""Edits a rollout module after the controller hashed it: the worker refuses (exit 2)."""

import importlib
import os
import sys
from pathlib import Path

from art_mega import ArtRuntime, compile_topology

SOURCE = "async def first():\n    return 1\n\n\nasync def second():\n    return 2\n"


async def main(launch):
    folder = Path(os.environ["EDIT_ROLLOUT_DIR"])
    (folder / "edited_module.py").write_text(SOURCE)
    sys.path.insert(0, str(folder))
    module = importlib.import_module("edited_module")
    runtime = await ArtRuntime.start(
        launch, compile_topology(launch.homogeneous_cluster(allow_shared_kernel=True))
    )
    executor = await runtime.rollout_executor(module.first)
    assert await executor.run(0, module.first) == 1
    (folder / "edited_module.py").write_text(SOURCE + "\n# edited\n")
    await executor.run(0, module.second)
    print("EDIT_NOT_REFUSED", flush=True)
