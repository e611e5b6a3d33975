"""The demo's live terminal view (rich) and its closing summary table."""

from __future__ import annotations

import statistics
from collections import deque
from types import TracebackType

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from miles.controller.core import AsyncInferenceController
from miles.demo.report import DemoSummary
from miles.demo.traffic import TrafficStats
from miles.train.reports import StepReport


class LiveDisplay:
    """Step, reward, serving version, last update latency, requests served and failed."""

    def __init__(self, console: Console, *, total_steps: int, controller: AsyncInferenceController, live: bool) -> None:
        self._console = console
        self._controller = controller
        self._traffic = TrafficStats()
        self._status_page: str | None = None
        self._rewards: deque[float] = deque(maxlen=20)
        self._last: StepReport | None = None
        self._progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        self._task = self._progress.add_task("steps", total=total_steps)
        self._live = Live(self._render(), console=console, refresh_per_second=4, transient=False) if live else None
        self._printed = 0

    def attach_traffic(self, stats: TrafficStats) -> None:
        self._traffic = stats

    def link(self, status_page: str) -> None:
        """Show the controller's status page (its URL) while the demo runs."""
        self._status_page = status_page

    def __enter__(self) -> LiveDisplay:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(exc_type, exc, tb)

    def step(self, report: StepReport) -> None:
        self._last = report
        self._rewards.append(report.mean_reward)
        self._progress.update(self._task, completed=report.step)
        if self._live is not None:
            self._live.update(self._render())
        elif report.step - self._printed >= 25 or report.step == 1:
            # Without a live terminal (CI logs), a line every 25 steps.
            self._printed = report.step
            self._console.print(self._line(report), soft_wrap=True)

    def _line(self, report: StepReport) -> str:
        health = self._controller.health()
        versions = ",".join(f"{v}x{n}" for m in health.models.values() for v, n in m.versions.items())
        last = self._controller.last_update
        latency = f"{last.duration_s * 1e3:.0f} ms" if last else "-"
        return (
            f"step {report.step:>4} {report.phase.value:<4} reward {statistics.fmean(self._rewards):.3f} | "
            f"serving v{versions} | update {latency} | users {self._traffic.served} ok {self._traffic.failed} failed"
        )

    def _render(self) -> Group:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="dim")
        table.add_column()
        report = self._last
        health = self._controller.health()
        versions = ", ".join(f"v{v} on {n}" for m in health.models.values() for v, n in m.versions.items()) or "-"
        last = self._controller.last_update
        update = f"{last.status.value} v{last.weight_version} in {last.duration_s * 1e3:.0f} ms" if last else "-"
        served, failed = self._traffic.served, self._traffic.failed
        table.add_row("step", f"{report.step} ({report.phase.value})" if report else "-")
        table.add_row("reward (last 20 steps)", f"{statistics.fmean(self._rewards):.3f}" if self._rewards else "-")
        table.add_row("exact answers (this step)", f"{report.exact_rate:.2f}" if report else "-")
        table.add_row("serving", f"{versions}  [{health.status}]")
        table.add_row("last update", update)
        style = "red" if failed else "green"
        table.add_row("user requests", f"{served} served, [{style}]{failed} failed[/]")
        if self._status_page:
            table.add_row("status page", f"[link={self._status_page}]{self._status_page}[/link]")
        return Group(self._progress, table)

    def final(self, summary: DemoSummary) -> None:
        table = Table(title="miles demo summary")
        table.add_column("figure")
        table.add_column("value", justify="right")
        rows = [
            ("rollout servers", f"{summary.servers} {summary.server_cls}"),
            ("trainer", summary.trainer),
            ("trainer steps", f"{summary.steps}"),
            ("updates committed / not", f"{summary.updates_committed} / {summary.updates_failed}"),
            ("update latency p50 / p95", _ms(summary.update_latency_p50_s, summary.update_latency_p95_s)),
            (
                f"publish over {summary.transfer_path} p50 / p95",
                _ms(summary.publish_latency_p50_s, summary.publish_latency_p95_s),
            ),
            ("user requests served / failed", f"{summary.requests_served} / {summary.requests_failed}"),
            ("request latency p50 / p95", _ms(summary.request_latency_p50_s, summary.request_latency_p95_s)),
            ("checksum mismatches", f"{summary.checksum_mismatches}"),
            ("reward first -> last", f"{summary.reward_first:.3f} -> {summary.reward_last:.3f}"),
            ("exact answers first -> last", f"{summary.exact_first:.3f} -> {summary.exact_last:.3f}"),
            (
                f"{summary.loop} GRPO: trainer / fleet idle",
                f"{summary.trainer_idle_fraction:.0%} / {summary.fleet_idle_fraction:.0%}",
            ),
            ("samples: most versions behind / dropped", f"{summary.max_staleness} / {summary.samples_dropped}"),
            ("event audit", "passed" if summary.events_check_passed else "FAILED"),
            ("wall time", f"{summary.wall_s:.0f} s"),
        ]
        for name, value in rows:
            table.add_row(name, value)
        self._console.print(table)
        self._console.print(f"report: {summary.run_dir}/report.md")


def _ms(p50_s: float, p95_s: float) -> str:
    return f"{p50_s * 1e3:.1f} / {p95_s * 1e3:.1f} ms"
