"""The ``miles`` command starts without torch or transformers (seconds to import): commands that
only talk HTTP or read event logs (``health --watch`` in a terminal, ``update`` from a script)
answer in a fraction of a second. What it prints is its own: no library's progress bar."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_cli_imports_neither_torch_nor_transformers_until_a_command_needs_them() -> None:
    probe = (
        "import sys, miles.cli; "
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "", f"importing miles.cli imported {result.stdout.strip()}"


def test_checkpoint_init_prints_its_own_lines_and_no_library_progress_bar(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    result = subprocess.run(
        [sys.executable, "-m", "miles.cli", "checkpoint", "init", str(out), "--model-name", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # transformers draws "Writing model shards: 100%|...| 1/1 [00:00<00:00, 9.5it/s]" with
    # carriage returns on stderr for every save_pretrained.
    for stream in (result.stdout, result.stderr):
        assert "Writing model shards" not in stream and "it/s]" not in stream and "\r" not in stream, stream
    assert result.stderr == ""
    assert [line.split(":", 1)[0] for line in result.stdout.splitlines()] == [
        "path",
        "model",
        "preset",
        "params",
        "checksum",
    ]
