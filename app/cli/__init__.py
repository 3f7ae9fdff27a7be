"""The `turnlog` command line, one module per command group.

`main` (the console-script entry point) and `cli` (the typer app) live in
`app.cli.main`; what several commands share lives in `app.cli.common`.
"""

import gc

# Importing the commands builds ~50k objects the collector tracks (typer, pydantic,
# numpy, turnlog's own types), none of them garbage: its passes over them while they
# are built, and again in every collection the command itself causes later (its
# database driver's imports, its query), cost ~0.1-0.3 s of a command's CPU
# (docs/development.md). Off while they are imported, frozen after, and on again
# only if it was on.
_collecting = gc.isenabled()
gc.disable()
try:
    from app.cli.main import cli, main
finally:
    gc.freeze()
    if _collecting:
        gc.enable()

__all__ = ["cli", "main"]
