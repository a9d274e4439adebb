#!/usr/bin/env bash
# Parity against the newest megatron-core (GTP, Python >= 3.12); not part of CI.
#
# Run it when Megatron's core changes:
#     bash scripts/megatron_parity_latest.sh            # newest megatron-core on the registry
#     MCORE_VERSION=0.19.2 bash scripts/megatron_parity_latest.sh
#
# It creates .venv-mcore-latest once (Python 3.12; torch as pip resolves it there, which on
# Linux is the multi-GB CUDA build: never in CI), then runs scripts/parity_latest/run_parity.py
# on 8 gloo CPU processes: Megatron's real parallel_state with GTP and EGTP, Megatron's own
# clip_grads functions, gradstat given Megatron's arguments, dump_rank's coordinates, all
# held against float64; then real Megatron jobs on 4 (scripts/parity_latest/live_jobs.py: its
# GPTModel with GTP and MoE layers with EGTP, DDP and optimizer, the README's recipes), and
# --save-wgrads-interval dumps written by Megatron's own save_grads, read by the CLI
# (scripts/parity_latest/wgrads_jobs.py). Arguments name layouts or jobs to run alone
# (`wgrads`: all the save_grads jobs). stdout is the table that goes into README.md;
# progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-mcore-latest
if [[ -z ${PYTHON312:-} ]]; then
    # A pyenv shim answers `command -v` but may not run: try each candidate.
    for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
            PYTHON312=$candidate
            break
        fi
    done
fi
if [[ -z ${PYTHON312:-} ]]; then
    echo "megatron_parity_latest.sh: no Python >= 3.12 found; set PYTHON312=/path/to/python3.12" >&2
    exit 2
fi
MCORE_SPEC=megatron-core${MCORE_VERSION:+==$MCORE_VERSION}

if [[ ! -f $VENV/.installed ]]; then
    echo "creating $VENV with $PYTHON312 (torch download: several GB)" >&2
    rm -rf "$VENV"
    "$PYTHON312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    "$VENV/bin/python" -m pip install -q torch numpy packaging >&2
    # Megatron's optional extras (Transformer Engine, Apex) stay out: its clip_grads falls back.
    "$VENV/bin/python" -m pip install -q --no-deps "$MCORE_SPEC" >&2
    "$VENV/bin/python" -m pip install -q --no-deps -e . >&2
    "$VENV/bin/python" -m pip install -q "typer>=0.27,<0.29" "rich>=13" "safetensors>=0.4" "pytest>=8" >&2
    touch "$VENV/.installed"
else
    # The newest release (or MCORE_VERSION) on every run: Megatron's core is what changes.
    "$VENV/bin/python" -m pip install -q --no-deps --upgrade "$MCORE_SPEC" >&2
fi

exec "$VENV/bin/python" scripts/parity_latest/run_parity.py "$@"
