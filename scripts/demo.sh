#!/usr/bin/env bash
# The project's demo: set up, run the core over 4 gloo ranks, then the CLI on sample_data/,
# in one process and under torchrun, and compare and audit finding planted layout bugs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
run() { echo; echo "\$ $*"; "$@"; }
run .venv/bin/python examples/core_demo.py
run .venv/bin/gradstat norm sample_data/tp2-pp2-dp2-ep2-distopt --top 5 --max-norm 1.0
run .venv/bin/gradstat norm sample_data/gtp2-pp2-dp2-ep2 --top 5
run .venv/bin/gradstat zeros sample_data/gtp2-pp2-dp2-ep2
# 3 processes share the 8 rank files; the numbers are identical to one process's. `-m gradstat`
# works from any directory; OMP_NUM_THREADS, set, keeps torchrun's banner about it away.
OMP_NUM_THREADS=1 run .venv/bin/torchrun --standalone --nproc-per-node 3 -m gradstat norm \
    sample_data/tp2-pp2-dp2-ep2-distopt --top 5
# A snapshot with a NaN and an Inf: located by rank and parameter, exit status 1.
status=0
run .venv/bin/gradstat norm sample_data/tp2-pp2-dp2-ep2-distopt-nan --top 3 || status=$?
echo "(exit status $status: non-finite gradients found)"
# Two layouts of the same gradients agree, element by element (TP shards placed, GTP padding
# stripped, distributed-optimizer fragments placed by offset).
run .venv/bin/gradstat compare sample_data/tp2-pp2-dp2-ep2-distopt sample_data/gtp2-pp2-dp2-ep2
# Three planted layout bugs: compare sees the norms move, audit names each bug and the expert
# no token reaches (exit status 1).
status=0
run .venv/bin/gradstat compare sample_data/gtp2-pp2-dp2-ep2 sample_data/tp2-gtp2-pp2-ep2-bugs \
    || status=$?
echo "(exit status $status: the snapshots differ)"
status=0
run .venv/bin/gradstat audit sample_data/tp2-gtp2-pp2-ep2-bugs || status=$?
echo "(exit status $status: findings)"
