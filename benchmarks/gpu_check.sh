#!/usr/bin/env bash
# The GPU checks in one go, on a machine with a CUDA device (run from the repository root):
# the CUDA tests (an engine on a GPU, staged updates there, pushes over shared memory, CUDA IPC and
# NCCL),
# the engine and update tests on that machine, and the transfer and staging benchmarks.
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]
#
# `make` installs torch==2.13.0 from PyPI, which is a CUDA build on Linux x86_64.
set -euo pipefail
out="${1:-gpu-check}"
mkdir -p "$out"
make .venv/.installed >/dev/null
py=.venv/bin/python
nvidia-smi | tee "$out/nvidia-smi.txt"
"$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$out/torch.txt"
"$py" -m pytest -q -rs tests/gpu tests/engine/test_engine_staging.py tests/train/test_push.py 2>&1 | tee "$out/tests.txt"
"$py" benchmarks/staging.py --presets small 500m --repeats 5 2>&1 | tee "$out/staging.txt"
"$py" benchmarks/transfer.py --preset 500m --engines 1 2 --json 2>&1 | tee "$out/transfer.txt"
echo "results in $out/"
