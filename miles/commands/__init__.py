"""Subcommands of the ``miles`` command line, one module per command group."""

from typing import Any

import typer


def command_group(name: str, help: str, **options: Any) -> typer.Typer:
    """A typer app as every miles command group is built: no shell completion, help when called
    bare, errors shown plainly (``miles.cli.main`` prints them as one line)."""
    return typer.Typer(
        name=name, help=help, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, **options
    )
