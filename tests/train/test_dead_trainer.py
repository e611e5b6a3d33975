"""A trainer killed outright (SIGKILL) at every point of a push: its window ends within one short
lease, serving stays on verified weights, nothing it made outlives the window (its shared-memory
segments, its torch.distributed groups on the engines), and the next push of either kind goes
through."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoModelForCausalLM

from miles.config import ControllerSettings
from miles.rollout.state import ServerState
from miles.testing import running_controller, wait_until
from miles.train.push import PushPublisher
from miles.weights.checkpoint import read_manifest
from miles.weights.checksum import saved_state_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ADMIN = "a" * 32

# The trainer: publishes a checkpoint's model through the controller's HTTP API with the
# publisher's defaults (its lease among them), and kills itself at the point named.
TRAINER = """
import asyncio, os, signal, sys
from transformers import AutoModelForCausalLM
import miles.train.engine_calls as engine_calls
import miles.train.push as push
import miles.weights.transport.groups as groups

url, checkpoint, path, point = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(checkpoint)

def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)

post_all = engine_calls.post_all
async def post_then_maybe_die(*args, **kwargs):
    answer = await post_all(*args, **kwargs)
    if (point, kwargs["path"]) in {
        ("joined", "/init_weights_update_group"),
        ("bucket", "/update_weights_from_tensor"),
        ("bucket", "/update_weights_from_distributed"),
    }:
        die()
    return answer
engine_calls.post_all = post_then_maybe_die

broadcast = groups.broadcast
def broadcast_then_die(*args, **kwargs):
    if point == "broadcast":
        die()  # the engines wait in their broadcast for bytes that never come
    broadcast(*args, **kwargs)
groups.broadcast = broadcast_then_die

# A lease shorter than the default (10 s) keeps the test short; the publisher renews it alike.
publisher = push.PushPublisher(url, path=path, bucket_bytes=64 * 1024, timeout_s=30, ttl_s=3)
print("window-lease", publisher.ttl_s, flush=True)
result = asyncio.run(publisher.publish(model, None, step=int(sys.argv[5])))
print(result.path, result.checksum)
"""

# After the engines joined the group, and in the middle of a broadcast (the engines wait in it).
KILL_POINTS = {"shm": ["bucket"], "distributed": ["joined", "broadcast"]}


def test_the_default_lease_is_seconds_and_renewed_while_the_publisher_works() -> None:
    """What a dead trainer costs by default: one lease of 10 s (its publisher renews it every
    third of that while it lives)."""
    assert PushPublisher("http://127.0.0.1:1").ttl_s == 10.0
    assert ControllerSettings.model_fields["lease_ttl_s"].default == 10.0


@pytest.mark.parametrize("path", ["shm", "distributed"])
async def test_a_trainer_killed_anywhere_in_a_push_costs_one_lease_and_leaves_nothing(
    checkpoints: dict[str, Path], tmp_path: Path, path: str
) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    v1, v2 = read_manifest(checkpoints["v1"]), read_manifest(checkpoints["v2"])
    v2_weights = saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints["v2"]))
    env = {**os.environ, "MILES_ADMIN_TOKEN": ADMIN}
    async with running_controller(model_checkpoint=checkpoints["v1"], num_servers=2, admin_token=ADMIN) as (ctl, url):
        assert url is not None
        step = 10
        for point in KILL_POINTS[path]:
            step += 1
            trainer = await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                url,
                str(checkpoints["v2"]),
                path,
                point,
                str(step),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
            try:
                out, err = await asyncio.wait_for(trainer.communicate(), timeout=120)
            finally:
                if trainer.returncode is None:
                    trainer.kill()
                    await trainer.wait()
            died = time.monotonic()
            assert trainer.returncode == -signal.SIGKILL, (point, err.decode()[-2000:])
            lease = float(out.decode().split()[1])
            # Its window ends within one lease (short, since the publisher renews it while it
            # lives), seconds after it died, not minutes.
            await wait_until(lambda: not ctl.health().lock.held, what=f"the window of a trainer killed at {point}")
            assert time.monotonic() - died < lease + 3, point
            await wait_until(
                lambda: all(s.state is ServerState.SERVING for s in ctl.health().servers), what="serving again"
            )
            assert all(s.checksum == v1.checksum for s in ctl.health().servers), point
            # What it left in shared memory (the bucket segment, and for a shared-weights push the
            # model's whole copy) went when its window closed: no engine maps it any more, with no
            # other push needed. (The engines let go in the background as they close the window.)
            deadline = time.monotonic() + 5
            while held := [s.server_id for s in ctl.health().servers if await _maps_segment_of(s.pid, trainer.pid)]:
                assert time.monotonic() < deadline, (point, held)
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                answer = await http.post(
                    f"{url}/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 2}}
                )
                assert answer.status_code == 200, answer.text
            # The next push forms its own group on the same engines (the dead trainer's group is
            # gone from them), and a push over shared memory goes through too; each verified.
            step += 1
            publisher = PushPublisher(ctl, path="distributed", bucket_bytes=64 * 1024, timeout_s=30)
            pushed = await publisher.push(v2_weights, step=step)
            await publisher.close()
            assert pushed.checksum == v2.checksum
            step += 1
            publisher = PushPublisher(ctl, path="shm", bucket_bytes=64 * 1024, timeout_s=30)
            back = await publisher.push(
                saved_state_dict(AutoModelForCausalLM.from_pretrained(checkpoints["v1"])), step=step
            )
            await publisher.close()
            assert back.checksum == v1.checksum
            assert all(s.checksum == v1.checksum for s in ctl.health().servers)


async def _maps_segment_of(engine_pid: int | None, maker_pid: int) -> bool:
    """Whether the engine process ``engine_pid`` maps a segment process ``maker_pid`` made."""
    assert engine_pid is not None
    maps = await asyncio.to_thread(Path(f"/proc/{engine_pid}/maps").read_text)
    return f"memfd:miles-{maker_pid}-" in maps
