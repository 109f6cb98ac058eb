#!/usr/bin/env bash
# vLLM's CPU build serving an HF folder through its own OpenAI server, in the foreground (stop it
# with SIGTERM or Ctrl-C). Needs benchmarks/peers/setup_vllm_cpu.sh and an HF folder from
# benchmarks/peers/export_hf_folder.py.
#
#   bash benchmarks/peers/serve_vllm.sh [PORT] [MODEL_DIR] [extra `vllm serve` flags...]
#
# Its OpenMP threads are bound to cores 0-1 with none reserved (by default it keeps one core back
# and binds the rest, leaving one core on a 2-core machine). --enforce-eager skips torch.compile
# (start-up ~40 s instead of ~3 min); VLLM_SERVE_EAGER=0 keeps compilation.
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${1:-8001}
MODEL=${2:-benchmarks/results/models/smollm2-135m-instruct}
shift $(( $# > 2 ? 2 : $# ))
VENV=${VLLM_VENV:-.venv-vllm}
EAGER=()
if [[ "${VLLM_SERVE_EAGER:-1}" == 1 ]]; then EAGER=(--enforce-eager); fi
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}   # GiB, as tandem's 2 GiB default
# `python -m ...api_server`, not the `vllm` command: the CLI asks for the version of a package
# named "vllm", and this one is "vllm-cpu".
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --served-model-name smollm2 --dtype float32 --max-model-len 4096 \
    "${EAGER[@]}" "$@"
