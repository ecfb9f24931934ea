#!/usr/bin/env bash
# GPU check (bench/gpu_check.py): raw fp16 ceilings at batch 1-256 for both models,
# Rampart's knee and 5x overload, printed as JSON. Finishes within 8 minutes.
#
#   bash bench/gpu_check.sh                 # full check (GPU host with the project's venv)
#   bash bench/gpu_check.sh --raw           # raw-engine mode: torch + timm + weights only
#   bash bench/gpu_check.sh --quick         # CPU smoke run, seconds (the test suite runs it)
#   bash bench/gpu_check.sh --out FILE      # also write the JSON to FILE after every step
#
# Interpreter: $RAMPART_PYTHON if set, else the project's .venv/bin/python if present,
# else python3 (e.g. a GPU machine's own torch). The hard limit is 470 s, under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${RAMPART_PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
exec timeout --kill-after=10 470 "$python" -m bench.gpu_check "$@"
