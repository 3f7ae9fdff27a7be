"""Pointer for `alembic -c migrations.ini …` from a clone: the real env ships in the package.

turnlog's migrations live in `app/store/migrations/` so an installed wheel can
migrate without this folder; `turnlog migrate` uses them directly.
"""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[1] / "app/store/migrations/env.py"))
