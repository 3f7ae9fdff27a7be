"""The `turnlog` command line, one module per command group.

`main` (the console-script entry point) and `cli` (the typer app) live in
`app.cli.main`; what several commands share lives in `app.cli.common`.
"""

from app.cli.main import cli, main

__all__ = ["cli", "main"]
