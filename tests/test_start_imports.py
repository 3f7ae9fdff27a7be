"""What a process imports before it serves: the heavy libraries a command does not use
stay out of its start (each `turnlog` process pays its imports in CPU at every start;
the gateway's tests start hundreds of them).

Checked in a fresh interpreter, as a command starts: a test process has imported
everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serverproc import server_env


def imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, env=server_env(None), check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_gateway_serves_without_fastapi() -> None:
    # What `turnlog gateway` imports to serve: its app and the guarded HTTP protocol.
    modules = imported_after(
        "import app.cli.main, app.cli.gateway, app.gateway.proxy, app.served\n"
        "from app.api.middleware.serving import GuardedHttpTools")
    assert "app.gateway.proxy" in modules  # the probe ran what it says
    assert "fastapi" not in modules


@pytest.mark.parametrize("library", ["typer.rich_utils", "httpx", "fastapi", "sqlalchemy"])
def test_a_command_starts_without_what_only_some_commands_use(library: str) -> None:
    modules = imported_after("import app.cli.main")
    assert "app.cli.main" in modules
    assert library not in modules


def test_a_command_checks_the_schema_without_alembic(tmp_path) -> None:
    """Every command against a database first checks its schema is at head: read without
    alembic (~0.2 s of imports: its DDL layer, Mako, Pygments), which stays for
    migrating and for the refusals."""
    from app.store.engine import migrate

    url = f"sqlite:///{tmp_path / 'store.db'}"
    migrate.upgrade(url)
    modules = imported_after("from app.cli.common import check_database\n"
                             f"check_database({url!r})")
    assert "app.store.engine.revision" in modules  # the check ran
    assert not {m for m in modules if m == "alembic" or m.startswith(("alembic.", "mako"))}


@pytest.mark.parametrize("collecting", [True, False])
def test_the_commands_import_out_of_the_collectors_sight(collecting: bool) -> None:
    """Importing the commands (what the `turnlog` script does first) runs without the
    collector's passes and leaves what it built frozen, the collector on again only if
    it was on (~0.1-0.3 s of CPU less a command: docs/development.md)."""
    probe = (f"import gc\n{'' if collecting else 'gc.disable()'}\nimport app.cli\n"
             "print(gc.isenabled(), gc.get_freeze_count() > 10000)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, env=server_env(None), check=True)
    assert done.stdout.split() == [str(collecting), "True"]
