#!/usr/bin/env bash
# The GPU checks in one run: CUDA tests, then the core benchmark on the device.
# Needs a python3 with torch (CUDA build), typer, rich, safetensors and pytest; installs nothing.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-${TMPDIR:-/tmp}/gradstat-gpu}"
mkdir -p "$out"
status=0
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_plans.py 2>&1 | tee "$out/test_cuda.log" || status=1
python3 benchmarks/bench_core.py --device cuda --gib "${GIB:-4}" --bandwidth-gbs 4800 2>&1 \
    | tee "$out/bench_core_cuda.md" || status=1
exit "$status"
