"""The `turnlog` command line: serve, migrate (and more as the store grows)."""

from __future__ import annotations

import ipaddress
import os
from enum import StrEnum
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from app.cli.analytics import analytics_cli, gate_cli, history_cli
from app.cli.consumers import consumers_cli
from app.cli.demo import demo
from app.cli.retention import retention_cli
from app.cli.store import rebuild, replay
from app.cli.transfer import export, import_
from app.settings import get_settings

cli = typer.Typer(no_args_is_help=True, help="turnlog: event-sourced session store for RL rollouts")
cli.add_typer(gate_cli, name="gate")
cli.add_typer(history_cli, name="history")
cli.add_typer(analytics_cli, name="analytics")
cli.add_typer(consumers_cli, name="consumers")
cli.add_typer(retention_cli, name="retention")
cli.command()(rebuild)
cli.command()(replay)
cli.command()(demo)
cli.command("import")(import_)
cli.command()(export)
console = Console(stderr=True)


def _url(database_url: str | None) -> str:
    if database_url:
        os.environ["TURNLOG_DATABASE_URL"] = database_url
        get_settings.cache_clear()
    return get_settings().database_url


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8000)")] = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL")] = None,
    migrate: Annotated[bool, typer.Option(help="Apply migrations to head first")] = True,
    workers: Annotated[int, typer.Option(
        min=1, help="Server processes (each keeps its own validated state cache)")] = 1,
    insecure: Annotated[bool, typer.Option(
        help="Allow a non-loopback address without API tokens")] = False,
) -> None:
    """Apply migrations to head, then serve the REST API with uvicorn."""
    import uvicorn

    from app.logs import configure_logging
    from app.store import migrate as migrations

    try:
        url = _url(database_url)
        settings = get_settings()
    except ValidationError as exc:
        console.print(f"[red]invalid settings:[/] {exc}")
        raise typer.Exit(2) from None
    bind = host or settings.host
    try:
        loopback = ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = bind == "localhost"
    if not loopback and not settings.token_scopes:
        if not insecure:
            console.print(f"[red]refusing to serve on non-loopback {bind} without API tokens[/];"
                          " set TURNLOG_API_TOKENS or pass --insecure")
            raise typer.Exit(2)
        console.print(f"[yellow]warning:[/] serving on {bind} without API tokens (--insecure)")
    configure_logging()
    if migrate and settings.migrate_on_start:
        migrations.upgrade(url)
        console.print(f"[green]schema at head[/] on {settings.database_url}")
    # log_config=None: uvicorn keeps the JSON logging that the factory sets up per worker.
    uvicorn.run("app.main:create_served_app", factory=True, host=bind, port=port or settings.port,
                workers=workers, log_level="info", log_config=None)


class MigrateAction(StrEnum):
    upgrade = "upgrade"
    downgrade = "downgrade"
    current = "current"


@cli.command()
def migrate(
    action: Annotated[MigrateAction, typer.Argument()] = MigrateAction.upgrade,
    revision: Annotated[str | None, typer.Argument(help="Target revision")] = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL")] = None,
) -> None:
    """Apply (upgrade), revert (downgrade) or show (current) the schema revision."""
    from app.store import migrate as migrations

    url = _url(database_url)
    if action is MigrateAction.upgrade:
        migrations.upgrade(url, revision or "head")
        console.print(f"upgraded to {revision or 'head'}")
    elif action is MigrateAction.downgrade:
        migrations.downgrade(url, revision or "-1")
        console.print(f"downgraded to {revision or '-1'}")
    typer.echo(f"current: {migrations.current(url)} (head: {migrations.head_revision()})")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
