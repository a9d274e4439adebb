#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch and gradstat installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch==2.13.0 is the CPU wheel on this machine's disk; asking for it first means pip never
# resolves `torch` to a multi-GB CUDA build from the index. -qq: errors only; pip's warnings
# about the machine's own configuration (index folders it lists but lacks, one line per
# package) would otherwise fill the first screen of the demo.
.venv/bin/python -m pip install -qq --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -qq --disable-pip-version-check -e '.[dev,parity,plot]'
