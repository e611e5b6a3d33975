"""What ``miles health`` draws: the fleet's health report as one view that fits 80 columns.

A pure function of the ``/health`` JSON, so ``--watch`` redraws it in place and tests draw it
without a controller. Server ids are never cut: the checksum and the version give way first.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

# Every other state (starting, pending_weights, updating, restarting) is on its way: yellow.
_STATE_STYLE = {"serving": "green", "quarantined": "red", "stopped": "red"}
_FLEET_STYLE = {"ok": "green", "updating": "yellow", "degraded": "yellow"}


def health_view(body: dict[str, Any], *, url: str | None = None) -> RenderableType:
    """The report ``GET /health`` answered, as a header, a table per model and the lock."""
    status = body["status"]
    header = Text.assemble(("fleet: ", ""), (status, _FLEET_STYLE.get(status, "red")), f"  up {body['uptime_s']:.0f}s")
    if url:
        header.append(f"  {url}")
    parts: list[RenderableType] = [header]
    for name, model in body["models"].items():
        parts.append(_model_table(name, model, [s for s in body["servers"] if s["model_name"] == name]))
    lock = body["lock"]
    if lock["held"]:
        held = f" for {lock['held_for_s']:.1f}s" if lock.get("held_for_s") is not None else ""
        parts.append(Text(f"lock: held by {lock['holder']} (token {lock['token']}){held}, {lock['waiters']} waiting"))
    else:
        parts.append(Text(f"lock: free, {lock['waiters']} waiting"))
    last = body.get("last_update")
    if last:
        blocked = last.get("serving_blocked_s")
        extra = f", serving blocked {blocked:.3f}s" if blocked else ""
        parts.append(
            Text(f"last update: {last['status']} {last['weight_version']} in {last['duration_s']:.3f}s{extra}")
        )
    return Group(*parts)


def _model_table(name: str, model: dict[str, Any], servers: list[dict[str, Any]]) -> Table:
    version = model["weight_version"] or ", ".join(f"{v} x{n}" for v, n in model["versions"].items()) or "-"
    title = f"{name}: version {version}, {model['serving']}/{model['total']} serving"
    if not model["accepting_requests"]:
        title += ", requests held"
    # One space between columns and none at the edges: a fleet of long ids still fits 80 columns.
    table = Table(title=title, title_justify="left", box=None, padding=(0, 1, 0, 0), header_style="bold")
    # Ids and states are what a person looks for: they keep their whole width, the others give way.
    # Attached: someone else runs it; a restart waits for it and verifies it again.
    ids = [s["server_id"] + (" (attached)" if s.get("attached") else "") for s in servers]
    table.add_column("server", no_wrap=True, min_width=max((len(i) for i in ids), default=6))
    table.add_column("state", no_wrap=True, min_width=max((len(s["state"]) for s in servers), default=5))
    table.add_column("version", overflow="ellipsis", no_wrap=True, min_width=7, max_width=14)
    table.add_column("checksum", no_wrap=True, overflow="ellipsis", max_width=8)
    table.add_column("reqs", justify="right", no_wrap=True)  # routed requests in flight
    table.add_column("probe", no_wrap=True)
    table.add_column("rst", justify="right", no_wrap=True)  # restarts
    for s, shown_id in zip(servers, ids, strict=True):
        probe = "-" if s["last_probe_ok"] is None else ("ok" if s["last_probe_ok"] else "failing")
        table.add_row(
            shown_id,
            Text(s["state"], style=_STATE_STYLE.get(s["state"], "yellow")),
            str(s["weight_version"] or "-"),
            (s["checksum"] or "-")[:8],
            str(s["in_flight"]),
            probe,
            str(s["restarts"]),
        )
    return table
