"""What a demo run leaves behind: ``summary.json``, ``report.md`` and PNG plots in its run directory."""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; the demo runs on machines without a display

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from pydantic import BaseModel, ConfigDict

from miles.controller.results import UpdateResult, UpdateStatus
from miles.demo.traffic import TrafficStats
from miles.train.reports import Phase, TrainingSummary
from miles.utils.audit_utils.event_analyzer import analyze_events
from miles.utils.audit_utils.event_logger.logger import read_events
from miles.utils.audit_utils.event_logger.models import ChecksumMismatchEvent
from miles.utils.weight_version import version_number


@dataclass(frozen=True)
class UpdateRecord:
    at: float  # seconds since the run started, when the update finished
    result: UpdateResult


class DemoSummary(BaseModel):
    """``summary.json``: the invariants a run must show, and the figures behind them."""

    model_config = ConfigDict(frozen=True)

    steps: int
    updates_committed: int
    updates_failed: int
    update_latency_p50_s: float
    update_latency_p95_s: float
    publish_latency_p50_s: float
    publish_latency_p95_s: float = 0.0
    # How the weights went: "disk", "shm" or "distributed"; from sharded ranks, also whether each
    # rank wrote its own shards ("shm, direct shards") or each bucket was gathered to rank 0.
    transfer_path: str
    # Who trained: "in this process", or "N FSDP2 ranks (gloo)".
    trainer: str = "in this process"
    requests_served: int
    requests_failed: int
    request_latency_p50_s: float
    request_latency_p95_s: float
    checksum_mismatches: int
    reward_first: float
    reward_last: float
    exact_first: float
    exact_last: float
    final_weight_version: str | None
    events_check_passed: bool
    event_findings: list[str]
    servers: int
    # Which engine served: the rollout servers' type.
    server_cls: str = "SFTRollout"
    strategy: str
    pause_mode: str
    # GRPO's loop ("sync" or "async"), what it cost in idle time, and how stale its samples were.
    loop: str = "sync"
    max_staleness: int = 0
    staleness_counts: list[int] = []
    trainer_idle_fraction: float = 0.0
    fleet_idle_fraction: float = 0.0
    samples_dropped: int = 0
    wall_s: float
    run_dir: str

    @property
    def passed(self) -> bool:
        """No user request failed, no checksum mismatched, and the event audit found nothing."""
        return self.requests_failed == 0 and self.checksum_mismatches == 0 and self.events_check_passed


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_report(
    run_dir: Path,
    *,
    training: TrainingSummary,
    updates: list[UpdateRecord],
    traffic: TrafficStats,
    events_dir: Path,
    servers: int,
    strategy: str,
    pause_mode: str,
    wall_s: float,
    server_cls: str,
    loop: str,
    trainer: str,
) -> DemoSummary:
    """Summarize the run (auditing its event log) and write summary.json, training.json, report.md
    and the plots into ``run_dir``; returns the summary."""
    events = read_events(events_dir)
    analysis = analyze_events(events)
    committed = [u.result for u in updates if u.result.status is UpdateStatus.COMMITTED]
    latencies = [r.duration_s for r in committed]
    publishes = [s.publish.latency_s for s in training.steps if s.publish is not None]
    request_latencies = [r.latency_s for r in traffic.records if r.ok]
    trainer_idle, fleet_idle = training.idle_fractions()
    summary = DemoSummary(
        steps=len(training.steps),
        updates_committed=len(committed),
        updates_failed=len(updates) - len(committed),
        update_latency_p50_s=_quantile(latencies, 0.5),
        update_latency_p95_s=_quantile(latencies, 0.95),
        publish_latency_p50_s=_quantile(publishes, 0.5),
        publish_latency_p95_s=_quantile(publishes, 0.95),
        transfer_path=next((s.publish.path for s in training.steps if s.publish is not None), "none"),
        trainer=trainer,
        requests_served=traffic.served,
        requests_failed=traffic.failed,
        request_latency_p50_s=_quantile(request_latencies, 0.5),
        request_latency_p95_s=_quantile(request_latencies, 0.95),
        checksum_mismatches=sum(1 for e in events if isinstance(e, ChecksumMismatchEvent)),
        reward_first=training.reward_first,
        reward_last=training.reward_last,
        exact_first=training.exact_first,
        exact_last=training.exact_last,
        final_weight_version=committed[-1].weight_version if committed else None,
        events_check_passed=analysis.passed,
        event_findings=[f.message for f in analysis.findings],
        servers=servers,
        server_cls=server_cls,
        strategy=strategy,
        pause_mode=pause_mode,
        loop=loop,
        max_staleness=training.max_staleness,
        staleness_counts=_staleness_counts(training),
        trainer_idle_fraction=trainer_idle,
        fleet_idle_fraction=fleet_idle,
        samples_dropped=training.samples_dropped,
        wall_s=wall_s,
        run_dir=str(run_dir),
    )
    (run_dir / "summary.json").write_text(summary.model_dump_json(indent=2) + "\n")
    (run_dir / "training.json").write_text(training.model_dump_json() + "\n")
    plots = [
        _plot_rewards(run_dir / "reward.png", training),
        _plot_updates(run_dir / "updates.png", updates),
        _plot_requests(run_dir / "requests.png", traffic, updates),
    ]
    (run_dir / "report.md").write_text(_markdown(summary, updates, plots))
    return summary


def _staleness_counts(training: TrainingSummary) -> list[int]:
    """How many GRPO samples were 0, 1, 2, ... versions stale, over the run."""
    grpo = [step.staleness.counts for step in training.steps if step.phase is Phase.GRPO]
    return [sum(column) for column in itertools.zip_longest(*grpo, fillvalue=0)]


def _plot_rewards(path: Path, training: TrainingSummary) -> Path:
    fig, (by_step, by_version) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [s.step for s in training.steps]
    by_step.plot(steps, [s.mean_reward for s in training.steps], label="mean reward", color="tab:blue")
    by_step.plot(steps, [s.exact_rate for s in training.steps], label="exact answers", color="tab:green", alpha=0.7)
    for s in training.steps:
        if s.phase is Phase.GRPO:
            by_step.axvspan(s.step - 0.5, s.step + 0.5, color="tab:orange", alpha=0.04, lw=0)
    by_step.set(
        xlabel="trainer step (shaded: GRPO)", ylabel="reward of server samples", title="Reward by step", ylim=(0, 1.05)
    )
    by_step.legend(loc="lower right")
    totals: dict[int, list[float]] = defaultdict(list)
    for group in (g for s in training.steps for g in s.rewards_by_version):
        if (number := version_number(group.weight_version)) is not None:
            totals[number].extend([group.mean_reward] * group.num_samples)
    versions = sorted(totals)
    by_version.plot(versions, [statistics.fmean(totals[v]) for v in versions], marker=".", color="tab:purple")
    by_version.set(
        xlabel="weight version that generated the sample",
        ylabel="mean reward",
        title="Reward by weight version",
        ylim=(0, 1.05),
    )
    return _saved(fig, path)


def _plot_updates(path: Path, updates: list[UpdateRecord]) -> Path:
    fig, ax = plt.subplots(figsize=(11, 3.5))
    good = [(u.at, u.result.duration_s) for u in updates if u.result.status is UpdateStatus.COMMITTED]
    bad = [(u.at, u.result.duration_s) for u in updates if u.result.status is not UpdateStatus.COMMITTED]
    _scatter_ms(ax, good, s=8, color="tab:green", label="committed")
    if bad:
        _scatter_ms(ax, bad, s=20, marker="x", color="tab:red", label="not committed")
    ax.set(
        xlabel="seconds since start (when the update finished)",
        ylabel="update latency (ms)",
        title="Weight updates: latency from taking the lock to commit",
    )
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right")
    return _saved(fig, path)


def _plot_requests(path: Path, traffic: TrafficStats, updates: list[UpdateRecord]) -> Path:
    fig, ax = plt.subplots(figsize=(11, 3.5))
    ok = [(r.started, r.latency_s) for r in traffic.records if r.ok]
    bad = [(r.started, r.latency_s) for r in traffic.records if not r.ok]
    _scatter_ms(ax, ok, s=6, color="tab:blue", label="served")
    if bad:
        _scatter_ms(ax, bad, s=14, color="tab:red", marker="x", label="failed")
    for record in updates:
        ax.axvline(record.at, color="tab:green", alpha=0.15, lw=1)
    ax.set(
        xlabel="seconds since start (green lines: updates committed)",
        ylabel="request latency (ms)",
        title="User requests around updates",
    )
    if traffic.records:
        ax.set_yscale("log")  # a log scale of nothing fails (a run without users)
    ax.legend(loc="upper right")
    return _saved(fig, path)


def _scatter_ms(ax: Axes, points: list[tuple[float, float]], **style: Any) -> None:
    """``(x, seconds)`` points, drawn in milliseconds."""
    ax.scatter([x for x, _ in points], [seconds * 1e3 for _, seconds in points], **style)


def _saved(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _markdown(summary: DemoSummary, updates: list[UpdateRecord], plots: list[Path]) -> str:
    verdict = "PASS" if summary.passed else "ATTENTION"
    lines = [
        "# miles demo run",
        "",
        f"Verdict: **{verdict}**: {summary.requests_failed} failed requests, {summary.checksum_mismatches} checksum "
        f"mismatches, event audit {'passed' if summary.events_check_passed else 'FAILED'}.",
        "",
        f"{summary.servers} {summary.server_cls} rollout servers, strategy `{summary.strategy}`, "
        f"pause mode `{summary.pause_mode}`, trainer {summary.trainer}, "
        f"{summary.wall_s:.0f} s wall time.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| trainer steps | {summary.steps} |",
        f"| updates committed / not committed | {summary.updates_committed} / {summary.updates_failed} |",
        f"| update latency p50 / p95 | {summary.update_latency_p50_s * 1e3:.1f} ms"
        f" / {summary.update_latency_p95_s * 1e3:.1f} ms |",
        f"| trainer | {summary.trainer} |",
        f"| publish latency p50 / p95 over {summary.transfer_path} (checksum, transfer, verified update)"
        f" | {summary.publish_latency_p50_s * 1e3:.1f} ms / {summary.publish_latency_p95_s * 1e3:.1f} ms |",
        f"| user requests served / failed | {summary.requests_served} / {summary.requests_failed} |",
        f"| request latency p50 / p95 | {summary.request_latency_p50_s * 1e3:.1f} ms"
        f" / {summary.request_latency_p95_s * 1e3:.1f} ms |",
        f"| mean reward of server samples, first / last steps"
        f" | {summary.reward_first:.3f} / {summary.reward_last:.3f} |",
        f"| exact answers, first / last steps | {summary.exact_first:.3f} / {summary.exact_last:.3f} |",
        f"| final weight version | {summary.final_weight_version} |",
        f"| GRPO loop | {summary.loop} |",
        f"| sample staleness (versions behind: samples) | {_staleness_text(summary.staleness_counts)} |",
        f"| trainer idle / fleet idle (GRPO) | {summary.trainer_idle_fraction:.0%}"
        f" / {summary.fleet_idle_fraction:.0%} |",
        f"| samples dropped | {summary.samples_dropped} |",
        "",
    ]
    if summary.event_findings:
        lines += ["## Event audit findings", "", *[f"- {f}" for f in summary.event_findings], ""]
    lines += ["## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    failed = [u for u in updates if u.result.status is not UpdateStatus.COMMITTED]
    if failed:
        lines += ["", "## Updates that did not commit", ""]
        lines += [f"- {u.result.update_id}: {u.result.status.value}: {u.result.message}" for u in failed]
    lines += [
        "",
        f"Files: `{summary.run_dir}/events/` (the event log; `miles events {summary.run_dir}/events --check` "
        "audits it), `summary.json`, `logs/` (one log per engine process).",
        "",
    ]
    return "\n".join(lines)


def _staleness_text(counts: list[int]) -> str:
    return ", ".join(f"{gap}: {count}" for gap, count in enumerate(counts) if count) or "no GRPO samples"
