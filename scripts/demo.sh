#!/usr/bin/env bash
# The project's demo: set up, run the core over 4 gloo ranks, then the CLI on sample_data/,
# in one process and under torchrun.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run() { echo; echo "\$ $*"; "$@"; }
run .venv/bin/python examples/core_demo.py
run .venv/bin/gradstat norm sample_data/tp2-pp2-dp2-ep2-distopt --top 5 --max-norm 1.0
run .venv/bin/gradstat norm sample_data/gtp2-pp2-dp2-ep2 --top 5
run .venv/bin/gradstat zeros sample_data/gtp2-pp2-dp2-ep2
# 3 processes share the 8 rank files; the numbers are identical to one process's.
run .venv/bin/torchrun --standalone --nproc-per-node 3 .venv/bin/gradstat norm \
    sample_data/tp2-pp2-dp2-ep2-distopt --top 5 2>/dev/null
# A snapshot with a NaN and an Inf: located by rank and parameter, exit status 1.
status=0
run .venv/bin/gradstat norm sample_data/tp2-pp2-dp2-ep2-distopt-nan --top 3 || status=$?
echo "(exit status $status: non-finite gradients found)"
