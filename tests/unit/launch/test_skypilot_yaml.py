"""The SkyPilot task files load with SkyPilot itself (where the `skypilot` extra is installed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

CHECK = r"""
import json, sys
import sky, yaml
out = {}
for path in sys.argv[1:]:
    raw = yaml.safe_load(open(path))
    assert raw["secrets"] == {"ART_MEGA_SECRET": None}, raw["secrets"]  # required, given at launch
    sky.Task.from_yaml(path)
    task = sky.Task.from_yaml_config(raw, secrets_overrides=[("ART_MEGA_SECRET", "x" * 64)])
    res = list(task.resources)[0]
    out[path] = {
        "num_nodes": task.num_nodes,
        "run": task.run,
        "setup": task.setup,
        "secrets": sorted(task.secrets),
        "envs": dict(task.envs),
        "accelerators": res.accelerators,
    }
print(json.dumps(out))
"""


def test_skypilot_yamls_load_with_sky():
    pytest.importorskip("sky", reason="the skypilot extra is not installed")
    paths = [
        str(REPO / "examples/multinode/skypilot.yaml"),
        str(REPO / "examples/multinode/skypilot_training.yaml"),
    ]
    env = dict(os.environ, SKYPILOT_DISABLE_USAGE_COLLECTION="1", HOME=os.environ.get("HOME", "/root"))
    # a subprocess keeps sky's import side effects (config, logging) out of the test process
    result = subprocess.run(
        [sys.executable, "-c", CHECK, *paths], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    tasks = json.loads(result.stdout.strip().splitlines()[-1])
    smoke, train = tasks[paths[0]], tasks[paths[1]]
    assert smoke["num_nodes"] == 2 and train["num_nodes"] == 2
    for task in (smoke, train):
        assert "set -euo pipefail" in task["run"] and "set -euo pipefail" in task["setup"]
        assert "art-mega skypilot" in task["run"]
        assert task["secrets"] == ["ART_MEGA_SECRET"]
    assert "examples/multinode/program.py:main" in smoke["run"]
    assert train["envs"]["NCCL_NET"] == "IB"
    assert train["accelerators"] == {"H200": 1}
