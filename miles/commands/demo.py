"""``miles demo``: the most complete end-to-end flow miles runs on this machine."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from miles.models.presets import init_checkpoint
from miles.protocol.sglang import PauseMode
from miles.ray.rollout.server_spec import RolloutServerSpec
from miles.ray.rollout.server_state import VerifiedWeights
from miles.rollout.sft_rollout import SFTRollout


def demo(
    servers: Annotated[int, typer.Option(help="Engine processes to start.")] = 2,
    workdir: Annotated[Path | None, typer.Option(help="Where checkpoints and logs go.")] = None,
) -> None:
    """Start a fleet of embedded engines, serve, and swap verified weights into it."""
    console = Console()
    root = workdir or Path(tempfile.mkdtemp(prefix="miles-demo-"))
    asyncio.run(_run(console, root, servers))


async def _run(console: Console, root: Path, servers: int) -> None:
    v1 = init_checkpoint(root / "step-1", model_name="tiny", seed=0, step=1, overwrite=True)
    v2 = init_checkpoint(root / "step-2", model_name="tiny", seed=1, step=2, overwrite=True)
    console.print(f"checkpoints in {root}: step 1 {v1.checksum}, step 2 {v2.checksum}")
    fleet = SFTRollout(RolloutServerSpec(name="tiny", checkpoint=root / "step-1", num_servers=servers, log_dir=root / "logs"))
    await fleet.start()
    try:
        prompt = {"text": "12+7=", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        for server_id in fleet.server_ids:
            out = await fleet.client(server_id).generate(prompt)
            console.print(f"{server_id} v{out['meta_info']['weight_version']}: {out['output_ids']}")
        for server_id in fleet.server_ids:
            fleet.begin_update(server_id, reason="demo update")
            await fleet.pause(server_id, PauseMode.DRAIN)
            result = await fleet.load(server_id, root / "step-2", weight_version=v2.weight_version)
            confirmed = await fleet.confirm(server_id)
            ok = result.success and confirmed.checksum == v2.checksum
            console.print(f"{server_id}: loaded step 2, checksum {confirmed.checksum} {'OK' if ok else 'MISMATCH'}")
            if not ok:
                raise typer.Exit(1)
            fleet.admit(
                server_id,
                VerifiedWeights(checkpoint=root / "step-2", weight_version="2", checksum=v2.checksum, step=2),
                reason="checksum confirmed",
            )
            await fleet.resume(server_id)
        for server_id in fleet.server_ids:
            out = await fleet.client(server_id).generate(prompt)
            console.print(f"{server_id} v{out['meta_info']['weight_version']}: {out['output_ids']}")
    finally:
        await fleet.stop()
