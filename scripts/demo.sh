#!/usr/bin/env bash
# The project's demo: set up, then run gradstat's core on a toy model sharded over 4 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/core_demo.py
