"""`python -m tests.trainer.launch MODULE ARGS...`: run MODULE as `__main__` (argv MODULE ARGS...)
in a process that starts as a trainer rank does, `block_unused_imports()` first.

The test workers (`RankProcesses`, `MetaMapper`) import megatron-core after torch and
transformers; its `try: import wandb` then took 24 s on this loaded 2-core machine (8 s when
imported first: pydantic's attribute docstrings walk every loaded module per class), and one
meta-device map's CPU time fell from 32 s to 11 s without it. A production rank never imports it
(`art_mega.trainer.rank.main.NOT_IMPORTED`).
"""

from __future__ import annotations

import runpy
import sys

from art_mega.trainer.rank.main import block_unused_imports

if __name__ == "__main__":
    block_unused_imports()  # before anything imports megatron-core
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
