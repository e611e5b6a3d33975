"""What a verified update costs on a real vLLM server, against vLLM's own reload and a restart.

Side by side in one run, on one vLLM server (``make vllm``) serving the ``small`` preset:
- ``update_rollout_weights`` through the controller (VLLMRollout: pause, verify the bytes in the
  worker, vLLM's in-place reload, hash what the worker holds, set the version, reset the prefix
  cache, confirm, admit), interleaved round by round with
- vLLM's own in-place reload of the same checkpoints (``/collective_rpc reload_weights`` with
  ``weights_path``, then ``/reset_prefix_cache``): the data movement, verified by nothing;
- a restart: a fresh vLLM server on the same checkpoint, timed from launch until it answers a
  one-token completion (what a user who restarts servers to change weights waits for).

Then engine throughput, miles' embedded engine against vLLM on the same checkpoint under the same
load: ``--clients`` (8) closed-loop clients, each sending ``--requests`` greedy ``/v1/completions``
of ``--new-tokens`` (64) tokens (``ignore_eos``) straight to the server, both servers given every
core (they take turns: the one not measured idles), the two measured round by round, interleaved.
Prints generated tokens/s (median of ``--throughput-rounds``) and their ratio, and how many
greedy answers the two engines agree on token for token.

    .venv/bin/python benchmarks/vllm.py [--preset small] [--rounds 10] [--restarts 2] [--clients 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from miles.controller.results import UpdateStatus
from miles.models.presets import init_checkpoint
from miles.rollout.engine_process import free_port
from miles.rollout.runtime import LaunchSlot, Placement
from miles.rollout.spec import VLLMServerArgs
from miles.rollout.vllm_rollout import VLLMLaunchCommand, vllm_python
from miles.testing import running_controller
from miles.utils.progress_bars import disable_library_progress_bars

MODEL = "bench"


async def verified_and_bare(checkpoints: list[Path], *, rounds: int, state_dir: Path) -> dict[str, list[float]]:
    spec = {"cls": "VLLMRollout", "checkpoint": checkpoints[0], "num_servers": 1}
    times: dict[str, list[float]] = {"verified": [], "bare": []}
    version = 100
    async with running_controller({MODEL: spec}, http=False, state_dir=state_dir, startup_timeout_s=600) as (ctl, _):
        url = ctl.fleet.rollout(MODEL).snapshot()[0].url
        async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
            for _ in range(rounds):
                # Verified: away from the first checkpoint and back, so the controller's record and
                # what the worker holds agree again before the bare reloads do the same.
                for checkpoint in (checkpoints[1], checkpoints[0]):
                    version += 1
                    started = time.perf_counter()
                    result = await ctl.update_rollout_weights(checkpoint, weight_version=str(version))
                    times["verified"].append(time.perf_counter() - started)
                    assert result.status is UpdateStatus.COMMITTED, result.message
                for checkpoint in (checkpoints[1], checkpoints[0]):
                    started = time.perf_counter()
                    body = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
                    (await http.post(f"{url}/collective_rpc", json=body)).raise_for_status()
                    (await http.post(f"{url}/reset_prefix_cache")).raise_for_status()
                    times["bare"].append(time.perf_counter() - started)
    return times


def restart(checkpoint: Path, work_dir: Path) -> float:
    """Seconds from launching a vLLM server until it answers a one-token completion."""
    args = VLLMServerArgs()
    command = VLLMLaunchCommand(python=vllm_python(args), served_model_name=MODEL, max_running_requests=8, args=args)
    slot = LaunchSlot(host="127.0.0.1", port=free_port(), placement=Placement("local", "127.0.0.1"), work_dir=work_dir)
    env = {**os.environ, **command.environment(slot)}
    started = time.perf_counter()
    process = subprocess.Popen(
        command.argv(slot, checkpoint), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        with httpx.Client(trust_env=False, timeout=10) as http:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited with {process.returncode}")
                try:
                    answer = http.post(
                        f"http://127.0.0.1:{slot.port}/v1/completions",
                        json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                    )
                    if answer.status_code == 200:
                        return time.perf_counter() - started
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(timeout=60)


PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog" for i in range(64)]


async def throughput(
    checkpoint: Path, *, rounds: int, clients: int, requests: int, new_tokens: int, state_dir: Path
) -> dict[str, object]:
    """Generated tokens/s of each engine, round by round, and their greedy answers compared."""
    cores = os.cpu_count() or 1
    specs = {
        "vllm": {"cls": "VLLMRollout", "checkpoint": checkpoint, "model_name": "on-vllm", "max_running_requests": 16},
        "embedded": {
            "cls": "SFTRollout",
            "checkpoint": checkpoint,
            "model_name": "on-embedded",
            "max_running_requests": 16,
            "num_threads": cores,
        },
    }
    rates: dict[str, list[float]] = {"vllm": [], "embedded": []}
    texts: dict[str, dict[str, str]] = {"vllm": {}, "embedded": {}}
    async with running_controller(specs, http=False, state_dir=state_dir, startup_timeout_s=600) as (ctl, _):
        urls = {name: ctl.fleet.rollout(f"on-{name}").snapshot()[0].url for name in specs}
        async with httpx.AsyncClient(timeout=600, trust_env=False) as http:

            async def client(name: str, index: int) -> int:
                tokens = 0
                for turn in range(requests):
                    prompt = PROMPTS[(index * requests + turn) % len(PROMPTS)]
                    body = {
                        "model": f"on-{name}",
                        "prompt": prompt,
                        "max_tokens": new_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    answer = await http.post(f"{urls[name]}/v1/completions", json=body)
                    answer.raise_for_status()
                    payload = answer.json()
                    tokens += payload["usage"]["completion_tokens"]
                    texts[name][prompt] = payload["choices"][0]["text"]
                return tokens

            async def measure(name: str) -> float:
                started = time.perf_counter()
                tokens = sum(await asyncio.gather(*(client(name, i) for i in range(clients))))
                return tokens / (time.perf_counter() - started)

            for name in specs:  # warm-up
                await measure(name)
            for _ in range(rounds):
                for name in specs:
                    rates[name].append(await measure(name))
    same = sum(texts["vllm"][p] == texts["embedded"].get(p) for p in texts["vllm"])
    return {"tokens_per_s": rates, "greedy_agree": same, "greedy_compared": len(texts["vllm"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="requests per client per round")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--throughput-rounds", type=int, default=3)
    args = parser.parse_args()
    disable_library_progress_bars()
    with tempfile.TemporaryDirectory(prefix="miles-bench-vllm-") as tmp:
        root = Path(tmp)
        checkpoints = []
        for seed in (0, 1):
            init_checkpoint(root / f"s{seed}", model_name=MODEL, preset=args.preset, seed=seed, step=seed)
            checkpoints.append(root / f"s{seed}")
        times = asyncio.run(verified_and_bare(checkpoints, rounds=args.rounds, state_dir=root / "state"))
        restarts = [restart(checkpoints[0], root / "restart") for _ in range(args.restarts)]
        served = asyncio.run(
            throughput(
                checkpoints[0],
                rounds=args.throughput_rounds,
                clients=args.clients,
                requests=args.requests,
                new_tokens=args.new_tokens,
                state_dir=root / "throughput",
            )
        )
        num_bytes = sum(f.stat().st_size for f in checkpoints[0].glob("*.safetensors"))
    verified, bare = statistics.median(times["verified"]), statistics.median(times["bare"])
    summary = {
        "preset": args.preset,
        "bytes": num_bytes,
        "verified_update_s": {"median": verified, "max": max(times["verified"]), "n": len(times["verified"])},
        "bare_reload_s": {"median": bare, "max": max(times["bare"]), "n": len(times["bare"])},
        "restart_to_first_token_s": {"median": statistics.median(restarts), "all": restarts},
        "verified_over_bare": verified / bare,
        "restart_over_verified": statistics.median(restarts) / verified,
        "throughput": served,
    }
    print(json.dumps(summary, indent=2))
    print(
        f"verified update {verified * 1000:.0f} ms, vLLM's bare reload {bare * 1000:.0f} ms "
        f"({verified / bare:.2f}x), restart {statistics.median(restarts):.1f} s "
        f"({statistics.median(restarts) / verified:.0f}x the verified update)"
    )
    rates = served["tokens_per_s"]
    assert isinstance(rates, dict)
    vllm_rate, embedded_rate = statistics.median(rates["vllm"]), statistics.median(rates["embedded"])
    print(
        f"{args.clients} clients, greedy, {args.new_tokens} new tokens: embedded engine {embedded_rate:.0f} tokens/s, "
        f"vLLM {vllm_rate:.0f} tokens/s (embedded / vLLM {embedded_rate / vllm_rate:.2f}x); greedy answers equal "
        f"on {served['greedy_agree']} of {served['greedy_compared']} prompts"
    )


if __name__ == "__main__":
    main()
