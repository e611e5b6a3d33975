"""A stand-in for ``python -m sglang.launch_server`` on a machine where SGLang cannot run: takes the
SGLang flags SGLangRollout sets (refusing any other, and any parallelism it cannot give) and
runs the embedded engine, which speaks SGLang's API, in their place. It does not watch its parent
(SGLang does not either): ``miles.rollout.with_parent`` must end it."""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--max-running-requests", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--base-gpu-id", type=int)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--context-length")
    args = parser.parse_args()
    if args.tp_size != 1 or args.dp_size != 1:
        parser.error("the stand-in serves on one CPU: tp_size and dp_size must be 1")
    argv = [sys.executable, "-m", "miles.engine", "--model-path", args.model_path, "--host", args.host]
    argv += ["--port", args.port, "--served-model-name", args.served_model_name, "--num-threads", "1"]
    argv += ["--max-running-requests", args.max_running_requests]
    if args.context_length:
        argv += ["--context-length", args.context_length]
    if args.base_gpu_id is not None:
        # The GPUs SGLang would take: tp*dp from the base. The engine reports them (the Ray runtime
        # checks them against its bundle) and runs on the first when CUDA is there.
        gpus = range(args.base_gpu_id, args.base_gpu_id + args.tp_size * args.dp_size)
        argv += ["--gpu-ids", ",".join(str(g) for g in gpus), "--device", "auto"]
    print("stand-in for sglang.launch_server:", " ".join(sys.argv[1:]), flush=True)
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
