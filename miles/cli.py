"""The ``miles`` command: one entry point, one module per command group under ``miles.commands``."""

from __future__ import annotations

import typer
from pydantic import ValidationError

from miles.commands import checkpoint, command_group, controller, demo, events
from miles.config import SettingsError
from miles.errors import MilesError
from miles.utils.progress_bars import disable_library_progress_bars

app = command_group("miles", "Keep serving a model while you train it: verified weight updates for a rollout fleet.")
app.add_typer(checkpoint.app, name="checkpoint")
app.add_typer(events.app, name="events")
app.command(name="serve")(controller.serve)
app.command(name="update")(controller.update)
app.command(name="health")(controller.health)
app.command(name="demo")(demo.demo)


def main() -> None:
    # miles shows its own progress (rich) or none: transformers' and huggingface_hub's bars
    # ("Writing model shards", "Loading weights") would land in its output and its engines' logs.
    disable_library_progress_bars()
    try:
        app()
    except MilesError as exc:
        # A refusal miles explains (a port in use, an unsafe bind, a checkpoint it cannot
        # verify, a setting it cannot use) is shown as its message, not as a traceback.
        typer.echo(f"miles: {exc}", err=True)
        raise SystemExit(2) from None
    except ValidationError as exc:
        # Settings a command did not check itself (read from MILES_* deeper down): one line too.
        typer.echo(f"miles: {SettingsError.from_validation(exc)}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
