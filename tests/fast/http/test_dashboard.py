"""docs/grafana-dashboard.json queries only series miles exposes (miles.protocol.metrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from miles.protocol import metrics

DASHBOARD = Path(__file__).parents[3] / "docs" / "grafana-dashboard.json"
_SERIES = re.compile(r"\b(miles_[a-z0-9_]+|sglang:[a-z0-9_]+)")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_info")


def exposed() -> set[str]:
    names = {
        v
        for k, v in vars(metrics).items()
        if k.isupper() and isinstance(v, str) and v.startswith(("miles_", "sglang:"))
    }
    return {n.removesuffix("_total") for n in names}


def base(series: str) -> str:
    for suffix in _SUFFIXES:
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def queries(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [q for value in node.values() for q in queries(value)]
    if isinstance(node, list):
        return [q for value in node for q in queries(value)]
    return []


def test_every_query_names_a_series_miles_exposes() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    found = queries(dashboard)
    assert len(found) >= 20
    known = exposed()
    for query in found:
        for series in _SERIES.findall(query):
            assert base(series) in known, f"{series} in {query!r} is not in miles.protocol.metrics"


def test_panels_do_not_overlap() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        cells = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, panel["title"]
        taken |= cells
