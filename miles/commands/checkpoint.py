"""``miles checkpoint``: create a tiny checkpoint, verify one, print its checksum, seal a directory.

Exit status: 0 when all went well, 1 when the checkpoint has problems (or its checksum differs
from the manifest), 2 when the path is not a checkpoint at all or an argument is invalid.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from miles.commands import command_group
from miles.errors import CheckpointError, CheckpointFileMissingError, ManifestMissingError

if TYPE_CHECKING:
    from miles.weights.checkpoint import VerificationReport

# The commands import what reads or builds weights (torch, transformers: seconds to import) when
# they run, so that the ``miles`` command, which mounts this group, starts in a fraction of a
# second for the commands that need neither (``health``, ``update``, ``events``).

app = command_group("checkpoint", "Create, verify, checksum and seal miles checkpoints.")


class ExitCode(IntEnum):
    """What ``miles checkpoint`` exits with."""

    OK = 0
    PROBLEMS = 1
    NOT_A_CHECKPOINT = 2


class PresetName(StrEnum):
    """The presets ``init`` offers (miles.models.presets.PRESETS; a test keeps the two equal)."""

    TINY = "tiny"
    TINY_TIED = "tiny-tied"
    SMALL = "small"
    M500 = "500m"


DirArg = Annotated[Path, typer.Argument(metavar="DIR", help="Checkpoint directory.", show_default=False)]


def _fail(message: str, code: ExitCode) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(int(code))


def _require_checkpoint(directory: Path) -> None:
    if not (
        directory.is_dir() and ((directory / "miles_manifest.json").exists() or any(directory.glob("*.safetensors")))
    ):
        raise _fail(f"{directory} is not a checkpoint (no manifest, no safetensors files)", ExitCode.NOT_A_CHECKPOINT)


@app.command("init")
def init(
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Directory to create.", show_default=False)],
    model_name: Annotated[str, typer.Option("--model-name", help="Model name for the manifest.")],
    seed: Annotated[int, typer.Option(help="Init seed: same seed, same weights.")] = 0,
    preset: Annotated[PresetName, typer.Option(help="Model preset.")] = PresetName.TINY,
    step: Annotated[int, typer.Option(help="Training step recorded in the manifest.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Build a preset model with its tokenizer and write it as a sealed checkpoint at OUT."""
    from miles.models.presets import get_preset, init_checkpoint

    try:
        manifest = init_checkpoint(
            out, model_name=model_name, preset=preset.value, seed=seed, step=step, overwrite=overwrite
        )
    except CheckpointError as exc:
        raise _fail(str(exc), ExitCode.NOT_A_CHECKPOINT) from None
    typer.echo(f"path: {out.absolute()}")
    typer.echo(f"model: {manifest.model_name}")
    typer.echo(f"preset: {preset.value}")
    typer.echo(f"params: {get_preset(preset.value).num_parameters():,}")
    typer.echo(f"checksum: {manifest.checksum}")


@app.command("verify")
def verify(directory: DirArg) -> None:
    """Recompute every digest from the files and compare with the manifest."""
    _require_checkpoint(directory)
    from miles.weights.checkpoint import verify_checkpoint

    report = verify_checkpoint(directory)
    if report.ok:
        typer.echo(f"OK {report.checksum}")
        return
    Console(width=160).print(_problem_table(report))
    raise typer.Exit(int(ExitCode.PROBLEMS))


def _problem_table(report: VerificationReport) -> Table:
    table = Table(title=f"{len(report.problems)} problem(s) in {report.directory}")
    for column in ("kind", "tensor", "file", "expected", "actual", "what to do"):
        table.add_column(column, overflow="fold")
    for p in report.problems:
        table.add_row(p.kind.value, p.tensor or "", p.file or "", p.expected or "", p.actual or "", p.message)
    return table


@app.command("checksum")
def checksum(directory: DirArg) -> None:
    """Print the model checksum recomputed from the weight files (exit 1 if it differs from the manifest)."""
    _require_checkpoint(directory)
    from miles.weights.checkpoint import read_manifest
    from miles.weights.checksum import checksum_safetensors

    try:
        actual = checksum_safetensors(directory).checksum
    except CheckpointError as exc:
        raise _fail(f"cannot checksum {directory}: {exc}", ExitCode.PROBLEMS) from None
    typer.echo(actual)
    try:
        expected = read_manifest(directory).checksum
    except ManifestMissingError:
        return  # A plain Hugging Face directory: nothing to compare with.
    except CheckpointError as exc:
        raise _fail(str(exc), ExitCode.PROBLEMS) from None
    if expected != actual:
        raise _fail(
            f"checksum {actual} differs from the manifest's {expected}; run `miles checkpoint verify "
            f"{directory}` to see which tensors",
            ExitCode.PROBLEMS,
        )


@app.command("seal")
def seal(
    directory: DirArg,
    model_name: Annotated[str, typer.Option("--model-name", help="Model name for the manifest.")],
    step: Annotated[int, typer.Option(help="Training step recorded in the manifest.")],
    weight_version: Annotated[
        str | None, typer.Option(help="Weight version (default: the step).", show_default=False)
    ] = None,
) -> None:
    """Write a manifest for an existing Hugging Face model directory."""
    from miles.weights.checkpoint import seal_checkpoint

    try:
        manifest = seal_checkpoint(directory, model_name=model_name, step=step, weight_version=weight_version)
    except CheckpointFileMissingError as exc:
        raise _fail(str(exc), ExitCode.NOT_A_CHECKPOINT) from None
    except CheckpointError as exc:
        raise _fail(str(exc), ExitCode.PROBLEMS) from None
    typer.echo(f"sealed {directory} ({len(manifest.tensors)} tensors) checksum: {manifest.checksum}")


__all__ = ["ExitCode", "PresetName", "app"]
