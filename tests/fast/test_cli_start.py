"""The ``miles`` command starts without torch or transformers (seconds to import): commands that
only talk HTTP or read event logs (``health --watch`` in a terminal, ``update`` from a script)
answer in a fraction of a second."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_imports_neither_torch_nor_transformers_until_a_command_needs_them() -> None:
    probe = (
        "import sys, miles.cli; "
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "", f"importing miles.cli imported {result.stdout.strip()}"
