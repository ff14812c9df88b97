#!/usr/bin/env bash
# One command on a fresh machine: set everything up, then run the main job (GRPO on
# SmolLM2-135M-Instruct on this machine's CPU, with the report plots at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
export ART_MEGA_EXTRAS="${ART_MEGA_EXTRAS:-test,trainer-cpu}"
export ART_MEGA_WITH_VLLM=1
export ART_MEGA_REAL_MODEL=1
bash scripts/install.sh
.venv/bin/python - <<'PY'
from art_mega.launch.context import default_cache_root
from art_mega.basemodels.smollm2 import prepare_smollm2

print("quickstart: model ready at", prepare_smollm2(default_cache_root()))
PY
exec .venv/bin/art-mega local --program examples/multinode/train.py:main
