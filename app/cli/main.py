"""The `turnlog` command line: the app, its global options, `serve` and `migrate`.

Each command group lives in its own module and is registered here, in the
order `turnlog --help` lists them (serve first). Global options (`--version`,
`--debug`, `--log-format`, `--log-level`) are handled by the callback; the one
error path for every command is `TurnlogGroup` in `app.cli.common`.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import sys
import threading
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from app import __version__
from app.cli import common
from app.cli.analytics import analytics_cli, gate_cli, history_cli
from app.cli.browse import sessions, show, tail
from app.cli.common import (
    CliError,
    DatabaseUrl,
    check_database,
    err,
    mask,
    reader_gone,
    resolve_url,
)
from app.cli.consumers import consumers_cli
from app.cli.demo import demo
from app.cli.gateway import gateway
from app.cli.retention import retention_cli
from app.cli.store import rebuild, replay
from app.cli.transfer import export, import_
from app.settings import Settings, get_settings

if TYPE_CHECKING:
    import uvicorn

cli = typer.Typer(cls=common.TurnlogGroup, no_args_is_help=True,
                  pretty_exceptions_show_locals=False,  # locals may hold a password
                  help="turnlog: event-sourced session store for RL rollouts")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"turnlog {__version__}")
        raise typer.Exit()


@cli.callback()
def _global(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option(  # noqa: ARG001 (handled by its callback)
        "--version", is_eager=True, callback=_version, help="Print the version and exit")]
    = False,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show the traceback of a failure (also TURNLOG_DEBUG=1)")] = False,
    log_format: Annotated[str | None, typer.Option(
        "--log-format", metavar="auto|json|console",
        help="Logs on stderr: auto = readable on a terminal, JSON lines otherwise "
             "[env: TURNLOG_LOG_FORMAT]")] = None,
    log_level: Annotated[str | None, typer.Option(
        "--log-level", metavar="debug|info|warning|error",
        help="Log level (env TURNLOG_LOG_LEVEL; default info for serve and gateway, "
             "warning otherwise)",
    )] = None,
) -> None:
    import app.logs

    common.set_debug(debug)
    # The settings a command hands on (`common.settings_for`: serve's workers) keep them.
    common.set_log_options(log_format, log_level)
    settings = get_settings()
    serving = ctx.invoked_subcommand in ("serve", "gateway")
    if serving:
        # Options of the server's settings: checked as such (TURNLOG_LOG_FORMAT …).
        settings = settings.replace(**common.log_options())
    try:
        app.logs.configure_logging(log_level or settings.log.log_level
                                   or ("info" if serving else "warning"),
                                   log_format or settings.log.log_format)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def _cannot_listen(host: str, port: int, makefile_hint: bool = True) -> str | None:
    """Why uvicorn could not bind `host:port`, found before anything is migrated
    (`makefile_hint`: the command is `make run`'s, `turnlog serve`)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host}: {exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            import errno

            if exc.errno == errno.EADDRINUSE:
                hint = " (from the Makefile: make run PORT=N)" if makefile_hint else ""
                return (f"port {port} on {host} is already in use: stop the other server "
                        f"or pick another with --port{hint}")
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


@cli.command()
def serve(
    host: Annotated[str | None, typer.Option(
        help="Address to bind (env TURNLOG_HOST, default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="Port (env TURNLOG_PORT, default 8000)")] = None,
    database_url: DatabaseUrl = None,
    migrate: Annotated[bool, typer.Option(help="Apply migrations to head first")] = True,
    workers: Annotated[int, typer.Option(
        min=1, help="Server processes (each keeps its own validated state cache)")] = 1,
    insecure: Annotated[bool, typer.Option(
        help="Allow a non-loopback address without API tokens")] = False,
) -> None:
    """Apply migrations to head, then serve the REST API with uvicorn."""
    from app.store.engine import migrate as migrations

    url = resolve_url(database_url)
    settings = common.settings_for(url)
    bind = host or settings.server.host
    port = port or settings.server.port
    from app.access import is_loopback

    if not is_loopback(bind) and not settings.access.api_tokens:
        if not insecure:
            raise CliError(f"refusing to serve on non-loopback {bind} without API tokens; "
                           "set TURNLOG_API_TOKENS or pass --insecure")
        common.warn(f"serving on {bind} without API tokens (--insecure); only loopback Host "
                    "names are answered unless listed in TURNLOG_ALLOWED_HOSTS")
    # Before anything is created or migrated: is the port ours to take?
    problem = _cannot_listen(bind, port)
    if problem is not None:
        raise CliError(problem)
    # The bound address is one of the Host names the no-token guard answers
    # (app.api.middleware.guards).
    settings = settings.replace(host=bind, port=port)
    if migrate and settings.store.migrate_on_start:
        check_database(url, creating=True)
        migrations.upgrade(url)
        common.say(f"schema at head on {mask(url)}")
    else:
        check_database(url)
    run_server(uvicorn_config(settings, workers))


def uvicorn_config(settings: Settings, workers: int) -> uvicorn.Config:
    """What `turnlog serve` hands uvicorn. The app and the protocol are partials of
    module-level callables (app.served) bound to `settings`: uvicorn pickles its
    configuration to each spawned worker, so every worker serves these settings (not
    the environment's)."""
    import uvicorn

    from app.served import guarded_protocol, served_app

    server = settings.server
    # log_config=None: uvicorn keeps the logging that the factory sets up per worker.
    # The guarded protocol bounds request headers and their time (app.api.middleware.serving);
    # the rest of the connection limits are uvicorn's own (docs/operations.md,
    # "Limits and timeouts"). uvicorn types `http` as a protocol class; it only calls it,
    # once per connection, so a factory of `GuardedHttpTools` does (hence the ignore).
    return uvicorn.Config(functools.partial(served_app, settings), factory=True,
                          host=server.host, port=server.port, workers=workers,
                          log_level=settings.log.log_level or "info", log_config=None,
                          http=functools.partial(guarded_protocol, bounds=server),  # type: ignore[arg-type]
                          timeout_keep_alive=server.keep_alive_timeout_s,
                          limit_concurrency=server.limit_concurrency or None,
                          h11_max_incomplete_event_size=server.max_header_bytes)


def run_server(config: uvicorn.Config) -> None:
    """`uvicorn.run` for an app that is not an import string: one server in this process,
    or a supervisor of `config.workers` spawned processes sharing one bound socket."""
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    server = uvicorn.Server(config)
    try:
        if config.workers > 1:
            Multiprocess(config, sockets=[config.bind_socket()]).run()
        else:
            server.run()
    except KeyboardInterrupt:
        pass
    if config.workers == 1 and not server.started:
        raise SystemExit(STARTUP_FAILURE)


class MigrateAction(StrEnum):
    upgrade = "upgrade"
    downgrade = "downgrade"
    current = "current"


@cli.command()
def migrate(
    action: Annotated[MigrateAction, typer.Argument()] = MigrateAction.upgrade,
    revision: Annotated[str | None, typer.Argument(help="Target revision")] = None,
    database_url: DatabaseUrl = None,
    as_json: common.AsJson = False,
    drop_data: Annotated[bool, typer.Option(
        "--drop-data", help="downgrade: also when it drops data (the event log at base, the "
        "metric history, consumer acks, which sessions' R3 retention freed, which groups "
        "wait for rewards)")] = False,
) -> None:
    """Apply (upgrade), revert (downgrade) or show (current) the schema revision."""
    from app.store.engine import migrate as migrations

    if action is MigrateAction.current and revision is not None:
        raise CliError(f"`migrate current` takes no revision (got {revision!r}): it shows "
                       "the database's")
    url = resolve_url(database_url)
    # Relative forms (-1, +2, head-1, 0011+1) are alembic's to resolve; a name must be ours.
    if revision is not None and revision not in ("head", "heads", "base") \
            and not any(sign in revision for sign in "+-") and not migrations.knows(revision):
        raise CliError(f"no revision {revision!r}: expected head, base or "
                       f"one of this turnlog's revisions (0001 … {migrations.head_revision()})")
    if action is MigrateAction.upgrade:
        check_database(url, creating=True)
        migrations.upgrade(url, revision or "head")
        err().print(f"upgraded {mask(url)} to {revision or 'head'}")
    else:
        _exists(url)  # reading or reverting never creates a database
        if action is MigrateAction.downgrade:
            target = revision or "-1"
            lost = migrations.data_a_downgrade_drops(url, target)
            if lost and not drop_data:
                # One mistyped revision (`base`) dropped every rollout without a word.
                held = ", ".join(f"{table} ({'over 1000' if rows > 1000 else rows} "
                                 f"{'row' if rows == 1 else 'rows'})" for table, rows in lost)
                raise CliError(f"downgrading to {target} drops data: {held}; "
                               "nothing was changed (back up first; --drop-data to go on)")
            migrations.downgrade(url, target)
            err().print(f"downgraded {mask(url)} to {migrations.current(url) or 'base'}")
    current, head = migrations.current(url), migrations.head_revision()
    if as_json:
        common.echo_json({"current": current, "head": head})
    else:
        typer.echo(f"current: {current} (head: {head})")


def _exists(url: str) -> None:
    path = common.sqlite_path(url)
    if path is not None and not path.exists():
        raise CliError(f"no database at {path}: run `turnlog migrate` to create one")


cli.command()(gateway)
for command in (sessions, show, tail, replay, rebuild, demo):
    cli.command()(command)
cli.command("import")(import_)
cli.command()(export)
cli.add_typer(gate_cli, name="gate")
cli.add_typer(history_cli, name="history")
cli.add_typer(analytics_cli, name="analytics")
cli.add_typer(consumers_cli, name="consumers")
cli.add_typer(retention_cli, name="retention")


# Help read through a pipe or a pager (no terminal to size it) is laid out 120 columns
# wide, not rich's 80: at 80 the option tables cut names like
# `TURNLOG_GATEWAY_PAUSE_GENERATION_MODE` to `TURNLOG_GATEWAY_…`.
HELP_WIDTH = 120


def _help_width() -> None:
    """typer takes the width from TERMINAL_WIDTH when it imports `typer.rich_utils`,
    which it does only to render help or an error: set there, not by importing it
    first (rich's markdown and tables, ~0.15 s of every command's start). Only for
    the command itself: a program embedding `cli` keeps its own environment."""
    if not sys.stdout.isatty() and not os.environ.get("COLUMNS") \
            and not os.environ.get("TERMINAL_WIDTH"):
        if "typer.rich_utils" in sys.modules:  # imported already: nothing to save
            import typer.rich_utils

            typer.rich_utils.MAX_WIDTH = HELP_WIDTH
        else:
            os.environ["TERMINAL_WIDTH"] = str(HELP_WIDTH)


def main() -> NoReturn:
    _help_width()
    code: str | int | None = 0
    try:
        cli()
    except SystemExit as exc:
        code = exc.code
        # rich and click end a write to a reader that went away with 1; every other
        # such end is 141, as a SIGPIPE gives (TurnlogGroup.invoke).
        # (click wraps stdout in its `_PacifyFlushWrapper` when it met the EPIPE.)
        pacified = type(sys.stdout).__name__.endswith("PacifyFlushWrapper")
        if code == 1 and (reader_gone[0] or pacified):
            code = 141
    end(code)


def end(code: str | int | None) -> NoReturn:
    """End the process as `sys.exit(code)` would, without tearing the interpreter down.

    A normal exit joins the other threads, runs the `atexit` handlers and flushes the
    standard streams, and then frees every module and object one at a time: 0.15-0.3 s
    of the ~1.5 s of CPU a command takes on the development machine, which nothing of
    a finished command needs. Where no other non-daemon thread is alive, this does the
    first three and ends with `os._exit`; otherwise (a thread still working) it exits
    the normal way."""
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.main_thread()):
        raise SystemExit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # what `sys.exit("message")` does
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # the reader went away: as a SIGPIPE ends it
            status = 141 if status == 0 else status
        except (OSError, ValueError):  # closed, or no file: nothing left to write
            pass
    os._exit(status & 0xFF)


if __name__ == "__main__":
    main()
