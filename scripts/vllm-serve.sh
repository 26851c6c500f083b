#!/usr/bin/env bash
# Serve a small instruct model with vLLM on this host's GPU, as the upstream
# of crabd's OpenAI-compatible proxy.  Without a GPU, use the stand-in instead:
# `crab-llm-standin --port 8000` (see docs/llm.md).
#
# Usage: scripts/vllm-serve.sh [MODEL] [extra `vllm serve` flags...]
#
# Environment (all optional):
#   CRAB_VLLM_MODEL          model to serve (default Qwen/Qwen2.5-0.5B-Instruct; the MODEL argument wins)
#   CRAB_VLLM_SERVED_NAME    name clients put in "model" (default: the model id)
#   CRAB_VLLM_HOST           address to bind (default 127.0.0.1: only this host's crabd needs it)
#   CRAB_VLLM_PORT           port (default 8000)
#   CRAB_VLLM_MAX_MODEL_LEN  context length to reserve KV cache for (default 8192)
#   CRAB_VLLM_GPU_MEM        fraction of GPU memory vLLM may take (default 0.85)
#   CRAB_VLLM                the vllm executable (default: the repo's .venv, else PATH)
set -euo pipefail

usage() { sed -n '2,15s/^# \{0,1\}//p' "$0"; }
die() { echo "vllm-serve: $*" >&2; exit 1; }

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    usage
    exit 0
fi

model="${CRAB_VLLM_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
if [[ $# -gt 0 && "$1" != -* ]]; then
    model="$1"
    shift
fi
served="${CRAB_VLLM_SERVED_NAME:-$model}"
host="${CRAB_VLLM_HOST:-127.0.0.1}"
port="${CRAB_VLLM_PORT:-8000}"
max_len="${CRAB_VLLM_MAX_MODEL_LEN:-8192}"
gpu_mem="${CRAB_VLLM_GPU_MEM:-0.85}"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vllm="${CRAB_VLLM:-}"
if [[ -z "$vllm" ]]; then
    if [[ -x "$repo/.venv/bin/vllm" ]]; then
        vllm="$repo/.venv/bin/vllm"
    else
        vllm="$(command -v vllm || true)"
    fi
fi
[[ -n "$vllm" && -x "$vllm" ]] || die "vllm is not installed; install it with: .venv/bin/pip install -e '.[vllm]'"

command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: vLLM needs an NVIDIA GPU and its driver"
gpus="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true)"
[[ -n "$gpus" ]] || die "nvidia-smi sees no GPU"

cat <<EOF
vllm-serve: model $model (served as "$served") on http://$host:$port/v1
vllm-serve: GPU(s): $(echo "$gpus" | paste -sd ';' -)
vllm-serve: max-model-len $max_len, gpu-memory-utilization $gpu_mem

To put it behind crabd's OpenAI proxy, set in /etc/crab/crabd.toml:
    [proxy]
    upstream = "http://$host:$port"
then restart crabd.  Agents use base_url http://127.0.0.1:<proxy port>/sandboxes/<sandbox id>/v1
and model "$served".  Check it directly with:  curl -s http://$host:$port/v1/models
EOF

exec "$vllm" serve "$model" \
    --host "$host" \
    --port "$port" \
    --served-model-name "$served" \
    --max-model-len "$max_len" \
    --gpu-memory-utilization "$gpu_mem" \
    "$@"
