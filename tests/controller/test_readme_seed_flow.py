"""The README's seed flow, run as written with a plain ``save_pretrained`` checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from miles.models.presets import init_checkpoint
from miles.rollout.engine_process import free_port

README_FLOW = """
import json, sys
from miles.models import build_model, build_tokenizer
from miles.ray.rollout.inference_controller import InferenceController
from miles.utils.audit_utils.event_logger.models import InferenceEngineWeightChecksumEvent
from miles.weights.checksum import model_checksum

start, new, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, tokenizer = build_model("tiny", seed=9), build_tokenizer()  # stands for the trained model

{readme}

print(json.dumps({{"status": result.status.value, "versions": result.versions, "message": result.message}}))
"""


def test_the_readme_seed_flow_with_a_plain_directory_runs(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("<!-- seed-flow -->")[1].split("```python")[1].split("```")[0]
    code = block.replace('"/ckpt/step-41"', "start").replace('"/ckpt/step-42"', "new").replace("port=8000", "port=port")
    init_checkpoint(tmp_path / "step-41", model_name="gpt-xyz", seed=0, step=41)
    script = tmp_path / "flow.py"
    script.write_text(README_FLOW.format(readme=code))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "step-41"), str(tmp_path / "step-42"), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "committed", report["message"]
    assert report["versions"] == {"gpt-xyz-0": "42"}
