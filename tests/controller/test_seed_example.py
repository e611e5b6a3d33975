"""The seed's example from DESIGN.md, run as written in a plain script with real checkpoint paths."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SEED = """
from miles.ray.rollout.inference_controller import InferenceController
from miles.utils.audit_utils.event_logger.models import InferenceEngineWeightChecksumEvent

controller = InferenceController(
    rollout_server_cls="miles.rollout.sft_rollout.SFTRollout",
    model_checkpoint="{start}",
    port={port},
)
event = InferenceEngineWeightChecksumEvent(model_name="gpt-xyz", checksum="abc123def456", step=42)
controller.event_logger.log(InferenceEngineWeightChecksumEvent, event, print_log=False)
controller.update_rollout_weights(new_checkpoint="/new/checkpoint")
"""


def _port() -> int:
    """8000 as the seed says when it is free here, else any free port."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", 8000))
        except OSError:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
        return 8000


@pytest.fixture(scope="module")
def gpt_xyz(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from miles.models.presets import init_checkpoint

    root = tmp_path_factory.mktemp("gpt-xyz")
    init_checkpoint(root / "step-41", model_name="gpt-xyz", seed=0, step=41)
    init_checkpoint(root / "step-42", model_name="gpt-xyz", seed=1, step=42)
    return {"start": root / "step-41", "new": root / "step-42"}


def _run(script: str, tmp_path: Path) -> dict:
    path = tmp_path / "seed.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


REPORT = textwrap.dedent("""
    import json, httpx
    health = httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).json()
    out = httpx.post(
        f"http://127.0.0.1:{port}/generate",
        json={{"text": "1+1=", "sampling_params": {{"max_new_tokens": 4, "temperature": 0}}}},
        trust_env=False,
    ).json()
    print(json.dumps({{
        "status": result.status.value,
        "message": result.message,
        "versions": result.versions,
        "health": health["status"],
        "served_version": out["meta_info"]["weight_version"],
    }}))
    controller.close()
""")


def test_seed_example_runs_as_written_and_the_gate_refuses_a_wrong_checksum(
    gpt_xyz: dict[str, Path], tmp_path: Path
) -> None:
    port = _port()
    script = SEED.format(start=gpt_xyz["start"], port=port).replace("/new/checkpoint", str(gpt_xyz["new"]))
    # The seed's last line, with its result kept so the script can report it.
    script = script.replace("controller.update_rollout_weights(", "result = controller.update_rollout_weights(")
    report = _run(script + REPORT.format(port=port), tmp_path)
    # Training published "abc123def456" for gpt-xyz step 42; the checkpoint holds other weights.
    assert report["status"] == "rejected"
    assert "checksum mismatch" in report["message"] and "abc123def456" in report["message"]
    assert report["versions"] == {"gpt-xyz-0": "41"}
    assert report["health"] == "ok"
    assert report["served_version"] == "41"


def test_seed_example_commits_when_the_published_checksum_is_the_checkpoints(
    gpt_xyz: dict[str, Path], tmp_path: Path
) -> None:
    from miles.weights.checkpoint import read_manifest

    port = _port()
    real = read_manifest(gpt_xyz["new"]).checksum
    script = (
        SEED.format(start=gpt_xyz["start"], port=port)
        .replace("/new/checkpoint", str(gpt_xyz["new"]))
        .replace("abc123def456", real)
        .replace("controller.update_rollout_weights(", "result = controller.update_rollout_weights(")
    )
    report = _run(script + REPORT.format(port=port), tmp_path)
    assert report["status"] == "committed", report["message"]
    assert report["versions"] == {"gpt-xyz-0": "42"}
    assert report["served_version"] == "42"
