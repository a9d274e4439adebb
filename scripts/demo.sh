#!/usr/bin/env bash
# The project's demo: set up, run the core on a toy model sharded over 4 gloo ranks, then read
# the sample snapshots in sample_data/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/core_demo.py
.venv/bin/python examples/snapshot_demo.py
