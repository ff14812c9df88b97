#!/usr/bin/env bash
# One command on a fresh machine: set everything up, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/art-mega local --program examples/multinode/program.py:main
