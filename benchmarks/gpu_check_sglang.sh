#!/usr/bin/env bash
# SGLangRollout on a CUDA machine with SGLang installed, in one go (run from the repository root):
# two SGLang servers launched through the controller on a small Llama, requests routed to them, an
# update from disk and a distributed (NCCL) update confirmed by checksum, one server killed and back.
# One line per step; the exit code is the number of failed steps (docs/SGLANG.md, "The GPU check").
#
#     SGLANG_PYTHON=/path/to/python-with-sglang bash benchmarks/gpu_check_sglang.sh [OUT_DIR]
#
# SGLANG_PYTHON: an interpreter where sglang==0.5.23 is installed (it brings its own CUDA torch, so
# it usually lives in an environment of its own); default python3.
set -euo pipefail
out="${1:-gpu-check-sglang}"
sglang_python="${SGLANG_PYTHON:-python3}"
mkdir -p "$out"
make .venv/.installed >/dev/null
py=.venv/bin/python
nvidia-smi | tee "$out/nvidia-smi.txt"
"$sglang_python" -c 'import sglang; print("sglang", sglang.__version__)' | tee "$out/sglang.txt"
"$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$out/torch.txt"
"$py" benchmarks/gpu_check_sglang.py --out "$out" --launcher "$sglang_python -m sglang.launch_server" 2>&1 | tee "$out/steps.txt"
exit "${PIPESTATUS[0]}"
