#!/usr/bin/env bash
# Every GPU and many-core check of issue 30 in one run of about 10 minutes on a 16-core H100 or
# H200 machine: the CUDA tests, the core on the device (item 4: L2 every step against HBM
# bandwidth), the command line on the GPU (item 4: a 4 GiB snapshot in the page cache against
# the CPU, the same with pageable copies and a bare .cuda() + sum pass, in GB/s and of the
# link), and torchrun with 8 processes on 8192 rank files against one process (item 3).
# Needs a python3 with torch (CUDA build), typer, rich, safetensors and pytest; installs nothing.
# Logs go to $OUT (else $TMPDIR/gradstat-gpu); snapshots to $TMPDIR/gradstat-gpu-data.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-${TMPDIR:-/tmp}/gradstat-gpu}"
data="${TMPDIR:-/tmp}/gradstat-gpu-data"
mkdir -p "$out" "$data"
status=0
nvidia-smi -L
python3 -c 'import os, torch; print("torch", torch.__version__, torch.cuda.get_device_name(0), os.cpu_count(), "CPUs")'
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_plans.py 2>&1 | tee "$out/test_cuda.log" || status=1
# The card's HBM bandwidth by its name (GB/s, the vendors' figures), or BANDWIDTH_GBS:
# H200 4800, H100 SXM ("H100 80GB HBM3") 3350, H100 NVL 3900, H100 PCIe 2000.
bandwidth="${BANDWIDTH_GBS:-$(python3 -c '
import torch
name = torch.cuda.get_device_name(0)
known = (("H200", 4800), ("H100 NVL", 3900), ("HBM3", 3350), ("SXM", 3350), ("H100", 2000))
print(next((str(gbs) for key, gbs in known if key in name), ""))')}"
python3 benchmarks/bench_core.py --device cuda --gib "${GIB:-4}" \
    ${bandwidth:+--bandwidth-gbs "$bandwidth"} 2>&1 | tee "$out/bench_core_cuda.md" || status=1
python3 benchmarks/bench_snapshot.py --device cuda --gib "${GIB:-4}" --repeats 3 \
    --dir "$data/snapshot" 2>&1 | tee "$out/bench_snapshot_cuda.md" || status=1
python3 benchmarks/bench_many_files.py --files 8192 --nproc 8 --repeats 3 --dir "$data" 2>&1 \
    | tee "$out/bench_many_files_nproc8.md" || status=1
exit "$status"
