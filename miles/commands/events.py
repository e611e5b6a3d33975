"""``miles events DIR``: show an event log as a table, JSON lines or update timelines; check it.

Exit status: 0 when all went well, 1 when ``--check`` found violations, 2 when the log could not
be read or an option is invalid.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from miles.commands import command_group
from miles.errors import EventLogError
from miles.utils.audit_utils.event_analyzer import AnalysisReport, analyze_events
from miles.utils.audit_utils.event_analyzer.timeline import UpdateTimeline, update_timelines
from miles.utils.audit_utils.event_logger.logger import read_events
from miles.utils.audit_utils.event_logger.models import EVENT_TYPES, Event

_MAX_SERVERS_SHOWN = 3

app = command_group(
    "events",
    "Show and check a miles event log directory.",
    invoke_without_command=True,
    # The app is a group only so that ``add_typer`` mounts its callback as ``miles events``; it has
    # no subcommands, so options may follow DIR as they would on a plain command.
    subcommand_metavar="",
    context_settings={"allow_interspersed_args": True},
)


@app.callback(invoke_without_command=True)
def events(
    directory: Annotated[
        Path, typer.Argument(metavar="DIR", help="Event log directory (its *.jsonl files).", show_default=False)
    ],
    types: Annotated[
        list[str] | None,
        typer.Option("--type", "-t", help="Only events of this type (repeatable).", show_default=False),
    ] = None,
    server: Annotated[str | None, typer.Option("--server", "-s", help="Only events about this server id.")] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", "-n", min=1, help="Show only the N most recent matching events.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines instead of a table.")] = False,
    check: Annotated[
        bool,
        typer.Option("--check", help="Run the analyzer over the whole log (filters do not apply); exit 1 on findings."),
    ] = False,
    timeline: Annotated[
        bool,
        typer.Option(
            "--timeline",
            help="One block per weight update: its phases as bars, then its servers' steps "
            "(--server and --limit apply: updates of that server, the N most recent).",
        ),
    ] = False,
) -> None:
    """Print the events logged in DIR, oldest first; with --check, also what the analyzer finds."""
    wanted_types = _validate_types(types or ())
    try:
        logged = read_events(directory)
    except EventLogError as exc:
        typer.echo(f"error: cannot read event log {directory}: {exc}", err=True)
        raise typer.Exit(2) from exc

    shown = [
        event
        for event in logged
        if (not wanted_types or event.type in wanted_types) and (server is None or server in event.involved_servers())
    ]
    shown = shown[-limit:] if limit else shown

    console = Console(highlight=False)
    if timeline:
        updates = [t for t in update_timelines(logged) if server is None or server in t.server_ids]
        updates = updates[-limit:] if limit else updates
        for update in updates:
            if as_json:
                typer.echo(update.model_dump_json())
            else:
                for line in timeline_lines(update):
                    console.print(Text(line))
        if not updates and not as_json:
            console.print(Text("no weight updates in this log"))
    elif as_json:
        for event in shown:
            typer.echo(event.model_dump_json())
    else:
        console.print(_event_table(shown, total=len(logged)))

    if not check:
        return
    report = analyze_events(logged)
    _print_report(report, console=console, as_json=as_json)
    if not report.passed:
        raise typer.Exit(1)


def _validate_types(types: Sequence[str]) -> frozenset[str]:
    unknown = sorted(set(types) - set(EVENT_TYPES))
    if unknown:
        raise typer.BadParameter(
            f"unknown event type(s) {', '.join(unknown)}; valid types: {', '.join(EVENT_TYPES)}", param_hint="--type"
        )
    return frozenset(types)


def _event_table(events: Sequence[Event], *, total: int) -> Table:
    table = Table(title=f"{len(events)} of {total} events", title_justify="left")
    for column in ("time", "type"):
        table.add_column(column, no_wrap=True)
    for column in ("source", "model", "server", "step", "version", "details"):
        table.add_column(column, overflow="fold")
    for event in events:
        cells = (
            event.timestamp.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            event.type,
            f"{event.source.component}/{event.source.id}",
            _text(getattr(event, "model_name", None)),
            _servers(event),
            _text(getattr(event, "step", None)),
            _text(getattr(event, "weight_version", None)),
            event.summary(),
        )
        table.add_row(*map(Text, cells))
    return table


def _servers(event: Event) -> str:
    servers = event.involved_servers()
    if len(servers) <= _MAX_SERVERS_SHOWN:
        return ",".join(servers)
    return ",".join(servers[:_MAX_SERVERS_SHOWN]) + f",… ({len(servers)})"


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _print_report(report: AnalysisReport, *, console: Console, as_json: bool) -> None:
    if as_json:
        for finding in report.findings:
            typer.echo(finding.model_dump_json())
        return
    if report.passed:
        console.print(Text(f"check passed: {report.events_checked} events, no findings"))
        return
    console.print(Text(f"check failed: {len(report.findings)} finding(s) in {report.events_checked} events"))
    for finding in report.findings:
        console.print(Text(f"[{finding.rule}] {finding.message}"))


_BAR_WIDTH = 40


def timeline_lines(update: UpdateTimeline, *, width: int = 80) -> list[str]:
    """An update as lines of at most ``width`` characters: a header, a bar per phase, its steps."""
    took = "running" if update.duration_s is None else _seconds(update.duration_s)
    blocked = "" if update.serving_blocked_s is None else f" blocked {_seconds(update.serving_blocked_s)}"
    lines = [
        f"{update.started_at.strftime('%H:%M:%S.%f')[:-3]} {update.update_id[:8]} {update.model_name} "
        f"-> {update.weight_version} {update.strategy} {update.status} {took}{blocked}"
    ]
    longest = max(update.phases.values(), default=0.0)
    for phase, seconds in update.phases.items():
        cells = 0 if longest <= 0 else max(1 if seconds > 0 else 0, round(_BAR_WIDTH * seconds / longest))
        lines.append(f"  {phase:<10}{_seconds(seconds):>10} {'#' * cells}")
    lines += [f"  +{step.at_s:8.3f}s {step.server_id or '':<12} {step.what}" for step in update.steps]
    if update.message:
        lines.append(f"  {update.message}")
    lines.append("")
    return [line if len(line) <= width else line[: width - 1] + "…" for line in lines]


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f}ms" if value < 1 else f"{value:.2f}s"
