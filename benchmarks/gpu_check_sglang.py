"""SGLang servers under the controller, end to end, one line per step (the GPU check for SGLangRollout).

    python benchmarks/gpu_check_sglang.py --out DIR [--launcher PYTHON -m sglang.launch_server]

Two SGLang servers are launched through the controller on a small Llama generated from its config,
then: requests are routed to them, an update from disk is confirmed, a training window pushes
weights over torch.distributed with SGLang's own endpoints (one broadcast per tensor, as SGLang
receives them) and is confirmed, and one server is killed and comes back on its verified weights.
Each step prints ``[ok]`` or ``[FAIL]`` and what it saw; the exit code is the number of failed steps.

``--cpu`` runs the same steps without a GPU, with a launcher that takes SGLang's flags (the
test suite's stand-in, ``tests/rollout/sglang_standin.py``): a dry run of this script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from miles.inference_controller import InferenceController
from miles.models.presets import init_checkpoint
from miles.rollout.engine_process import free_port
from miles.utils.progress_bars import disable_library_progress_bars

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SGLANG = "miles.rollout.sglang_rollout.SGLangRollout"
MODEL = "gpu-check"
GROUP = "miles_gpu_check"


class Check:
    """Runs the steps in order, printing one line each; a failed step does not stop the others
    unless a later one needs what it made."""

    def __init__(self) -> None:
        self.failed = 0

    def step(self, name: str, run: Callable[[], str]) -> bool:
        started = time.monotonic()
        try:
            detail = run()
        except Exception as exc:  # noqa: BLE001  # a check reports every failure and goes on
            self.failed += 1
            print(f"[FAIL] {name}: {type(exc).__name__}: {exc} ({time.monotonic() - started:.1f}s)", flush=True)
            return False
        print(f"[ok]   {name}: {detail} ({time.monotonic() - started:.1f}s)", flush=True)
        return True


def generate(url: str, prompt: str) -> dict[str, Any]:
    body = {"text": prompt, "model": MODEL, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    answer = httpx.post(f"{url}/generate", json=body, timeout=120, trust_env=False)
    answer.raise_for_status()
    return answer.json()


def servers(controller: InferenceController) -> list[Any]:
    return [s for s in controller.health().servers if s.model_name == MODEL]


def push_over_distributed(
    controller: InferenceController, checkpoint: Path, *, checksum: str, version: str, bytes_only: bool
) -> str:
    """A training window: the weights of ``checkpoint`` broadcast from this process (rank 0) to
    every server over SGLang's /init_weights_update_group and /update_weights_from_distributed,
    one tensor per call; then the window is ended with the checkpoint's checksum.

    ``bytes_only`` (the dry run against embedded engines): each tensor travels as its bytes, which
    is what the embedded engine receives, and the last call carries the expected checksum."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors |= load_file(file)
    window = controller.start_update_weights(MODEL)
    try:
        pushed = asyncio.run(_push(window, tensors, checksum=checksum, version=version, bytes_only=bytes_only))
    except BaseException:
        controller.abort_update_weights(window)
        raise
    result = controller.end_update_weights(window, checksum=checksum, step=3, weight_version=version)
    if result.status != "committed":
        raise RuntimeError(f"the window ended {result.status}: {result.model_dump_json()[:800]}")
    return f"{pushed}, committed as {version}, checksum confirmed"


async def _push(window: Any, tensors: dict[str, torch.Tensor], *, checksum: str, version: str, bytes_only: bool) -> str:
    cuda = torch.cuda.is_available() and not bytes_only
    backend = "nccl" if cuda else "gloo"
    headers = {"authorization": f"Bearer {window.credential}"} if window.credential else {}
    async with httpx.AsyncClient(timeout=600, trust_env=False, headers=headers) as http:

        async def post_all(path: str, body: Callable[[int], dict[str, Any]]) -> None:
            answers = await asyncio.gather(
                *(http.post(f"{s.url}{path}", json=body(i)) for i, s in enumerate(window.servers))
            )
            for server, answer in zip(window.servers, answers, strict=True):
                if answer.status_code != 200 or answer.json().get("success") is False:
                    raise RuntimeError(f"{server.server_id} {path}: {answer.status_code} {answer.text[:300]}")

        # Each server takes as many ranks as it has tensor-parallel workers.
        infos = [(await http.get(f"{s.url}/server_info")).json() for s in window.servers]
        ranks = [int(info.get("tp_size") or 1) for info in infos]
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        world = 1 + sum(ranks)
        port = free_port()
        timeout = timedelta(seconds=300)
        store = dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(GROUP, store)
        join = {"master_address": "127.0.0.1", "master_port": port, "world_size": world, "group_name": GROUP}
        join["backend"] = backend

        def form() -> Any:
            if cuda:
                return dist.ProcessGroupNCCL(prefixed, 0, world, dist.ProcessGroupNCCL.Options())
            return dist.ProcessGroupGloo(prefixed, 0, world, timeout)

        group, _ = await asyncio.gather(
            asyncio.to_thread(form),
            post_all("/init_weights_update_group", lambda i: {**join, "rank_offset": offsets[i]}),
        )

        def broadcast(tensor: torch.Tensor) -> None:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            group.broadcast([tensor], options).wait()

        try:
            names = list(tensors)
            for index, name in enumerate(names):
                tensor = tensors[name].contiguous()
                last = index == len(names) - 1
                body: dict[str, Any] = {
                    "names": [name],
                    "dtypes": [str(tensor.dtype).removeprefix("torch.")],
                    "shapes": [list(tensor.shape)],
                    "group_name": GROUP,
                    "weight_version": version if last else None,
                    "flush_cache": last,
                }
                if bytes_only:
                    body["expected_checksum"] = checksum if last else None
                sent = tensor.view(torch.uint8).reshape(-1) if bytes_only else tensor.cuda() if cuda else tensor
                await asyncio.gather(
                    post_all("/update_weights_from_distributed", lambda _, b=body: b),
                    asyncio.to_thread(broadcast, sent),
                )
        finally:
            await post_all("/destroy_weights_update_group", lambda _: {"group_name": GROUP})
    return f"{len(names)} tensors over {backend} to {len(window.servers)} servers"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check-sglang"))
    parser.add_argument("--launcher", default=f"{sys.executable} -m sglang.launch_server")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--mem-fraction-static", type=float, default=0.3)
    parser.add_argument("--cpu", action="store_true", help="dry run without a GPU (with a stand-in launcher)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check()
    made: dict[str, Any] = {}

    def checkpoints() -> str:
        for name, seed, step in (("v1", 0, 1), ("v2", 1, 2)):
            path = out / "checkpoints" / name
            made[name] = (
                path,
                init_checkpoint(path, model_name=MODEL, preset=args.preset, seed=seed, step=step, overwrite=True),
            )
        return ", ".join(f"{n} {m.checksum[:12]}" for n, (_, m) in made.items())

    if not check.step("checkpoints", checkpoints):
        return check.failed
    gpus = 0 if args.cpu else torch.cuda.device_count()
    devices = ["cpu", "cpu"] if args.cpu else [f"cuda:{i % max(gpus, 1)}" for i in range(2)]
    spec: dict[str, Any] = {
        "cls": SGLANG,
        "checkpoint": str(made["v1"][0]),
        "num_servers": 2,
        "devices": devices,
        "sglang": {"launcher": shlex.split(args.launcher)},
    }
    if not args.cpu:
        # Two servers may share one GPU: each takes a fraction of its memory.
        spec["sglang"]["mem_fraction_static"] = args.mem_fraction_static
    controller: InferenceController | None = None

    def launch() -> str:
        nonlocal controller
        controller = InferenceController(
            {"policy": spec}, port=0, health_interval_s=0.5, log_dir=out / "logs", startup_timeout_s=900
        )
        listed = servers(controller)
        expected = made["v1"][1].checksum
        assert all(s.state == "serving" and s.checksum == expected for s in listed), listed
        return f"{len(listed)} servers on {devices}, serving v1, checksum {expected[:12]} confirmed on each"

    try:
        if not check.step("launch", launch):
            return check.failed
        assert controller is not None and controller.url is not None
        url = controller.url

        def route() -> str:
            answers = [generate(url, f"route {i}") for i in range(8)]
            versions = {a["meta_info"]["weight_version"] for a in answers}
            return f"{len(answers)} requests answered through the controller, versions {sorted(versions)}"

        check.step("route", route)

        def update_from_disk() -> str:
            result = controller.update_rollout_weights(made["v2"][0], model_name=MODEL)
            assert result.status == "committed", result.model_dump_json()[:800]
            expected = made["v2"][1].checksum
            assert all(s.checksum == expected for s in servers(controller))
            return f"committed v2, checksum {expected[:12]} confirmed on each"

        check.step("update from disk", update_from_disk)
        check.step(
            "distributed update",
            lambda: push_over_distributed(
                controller, made["v1"][0], checksum=made["v1"][1].checksum, version="3", bytes_only=args.cpu
            ),
        )

        def restart() -> str:
            victim = servers(controller)[0]
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 900
            while True:
                now = next(s for s in servers(controller) if s.server_id == victim.server_id)
                if now.restarts > victim.restarts and now.state == "serving":
                    break
                assert time.monotonic() < deadline, f"{victim.server_id} did not come back: {now.state}"
                time.sleep(0.5)
            generate(url, "after the restart")
            return (
                f"{victim.server_id} killed, back serving {now.weight_version} ({now.checksum and now.checksum[:12]})"
            )

        check.step("kill and restart", restart)
    finally:
        if controller is not None:
            controller.close()
    print(f"{'all steps passed' if not check.failed else f'{check.failed} step(s) failed'}; logs in {out}/logs")
    return check.failed


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    sys.exit(main())
