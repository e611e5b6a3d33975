"""Subcommands of the ``miles`` command line, one module per command group."""
