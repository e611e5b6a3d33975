"""``miles health``'s view fits an 80-column terminal and never cuts a server id."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console, RenderableType

from miles.commands.controller import health_view


def render_text(view: RenderableType, *, width: int = 80) -> str:
    """The view as plain text at ``width`` columns (what a terminal of that width shows)."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None, force_terminal=False)
    console.print(view)
    return console.export_text()


def report(server_ids: list[str], *, held: bool = False) -> dict[str, Any]:
    servers = [
        {
            "server_id": sid, "model_name": "a-model-name", "state": "quarantined" if i == 1 else "serving",
            "weight_version": "step-000123456", "checksum": "0123456789abcdef0123456789abcdef",
            "in_flight": 12, "last_probe_ok": i != 2, "restarts": 3,
        }
        for i, sid in enumerate(server_ids)
    ]  # fmt: skip
    return {
        "status": "degraded",
        "ok": True,
        "uptime_s": 12345.0,
        "models": {
            "a-model-name": {
                "weight_version": None,
                "versions": {"step-000123456": 2},
                "serving": 2,
                "total": len(server_ids),
                "accepting_requests": not held,
            }
        },  # fmt: skip
        "servers": servers,
        "lock": {
            "held": held,
            "holder": "AsyncInferenceController._update_from_disk",
            "token": 7,
            "waiters": 1,
            "held_for_s": 1.5,
        },  # fmt: skip
        "last_update": {
            "status": "committed",
            "weight_version": "step-000123456",
            "duration_s": 0.4,
            "serving_blocked_s": 0.3,
        },  # fmt: skip
    }


@pytest.mark.parametrize(
    "ids",
    [
        ["tiny-0", "tiny-1", "tiny-2"],
        ["a-model-name-0", "a-model-name-1", "a-model-name-2"],
        ["rollout-server-on-node-7-0", "rollout-server-on-node-7-1", "rollout-server-on-node-7-2"],
    ],
)
@pytest.mark.parametrize("held", [False, True])
def test_fits_80_columns_with_whole_ids(ids: list[str], held: bool) -> None:
    text = render_text(health_view(report(ids, held=held), url="http://127.0.0.1:8000"))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    for sid in ids:
        (row,) = [line for line in lines if sid in line.split()]
        assert "step-" in row, text  # the version, shortened if it must be
    assert "quarantined" in text and "failing" in text
    assert ("held by" in text) is held
    assert "serving blocked 0.300s" in text
