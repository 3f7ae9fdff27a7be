"""The `turnlog` command line, one module per command group.

`main` (the console-script entry point) and `cli` (the typer app) live in
`app.cli.main`; what several commands share lives in `app.cli.common`.
"""

import gc

# Importing the commands builds ~200k objects (SQLAlchemy, pydantic, typer, numpy,
# turnlog's own tables and types), none of them garbage: the collector's passes over
# them while they are built cost ~0.15-0.2 s of every command's start. Off while
# they are imported, on again after (and off only if it was on).
_collecting = gc.isenabled()
gc.disable()
try:
    from app.cli.main import cli, main
finally:
    gc.freeze()
    if _collecting:
        gc.enable()

__all__ = ["cli", "main"]
