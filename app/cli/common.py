"""What every `turnlog` command shares: the database URL, the store check, output, errors.

- One database URL resolver (`resolve_url`): `--database-url`, else
  `TURNLOG_DATABASE_URL`, else `./turnlog.db`; `postgres://`, `postgresql://`
  and `sqlite://` are accepted (normalized by `app.store.engine.db.normalize_url`).
  URLs are only ever printed masked (`mask`).
- One check before touching the store (`check_database`): a command that reads
  never creates a SQLite file, and says "not migrated: run `turnlog migrate`"
  instead of failing deep inside a query.
- One error path (`TurnlogGroup`): any failure of any command is one line on
  stderr and exit code 2; `turnlog --debug …` shows the traceback too.
- One label-filter parser (`parse_labels`) and one output policy (`out`, `err`,
  `table`): on a terminal rich tables; without one, plain wide rows that a CI
  log keeps intact.

Refuses: business rules (the store and the domain own them) and HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Annotated, Any, NoReturn, TypeVar

import typer
import typer.core
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from app.settings import DEFAULT_DATABASE_URL, Settings, get_settings

T = TypeVar("T")
# Wide enough that a CI log never folds a row; rich tables only take what they need.
PLAIN_WIDTH = 4000

DatabaseUrl = Annotated[str | None, typer.Option(
    "--database-url", metavar="URL",
    help="SQLAlchemy URL (postgresql://… or sqlite:///FILE); default: TURNLOG_DATABASE_URL, "
         f"else {DEFAULT_DATABASE_URL.replace('+aiosqlite', '')} in the current folder")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout")]
Labels = Annotated[list[str] | None, typer.Option(
    "--label", metavar="KEY=VALUE",
    help="Label filter KEY=VALUE (repeatable); the value is matched as text")]
ServerUrl = Annotated[str | None, typer.Option(
    "--url", help="Ask a running turnlog server (e.g. http://127.0.0.1:8000) instead")]
Token = Annotated[str | None, typer.Option(
    "--token", envvar="TURNLOG_TOKEN", show_envvar=True,
    help="Bearer token for --url (a write token: the server records values)")]
ReadToken = Annotated[str | None, typer.Option(
    "--token", envvar="TURNLOG_TOKEN", show_envvar=True,
    help="Bearer token for --url (a read token will do)")]


class CliError(Exception):
    """A failure the user can act on: printed as one line, exit code 2."""


# -- output ------------------------------------------------------------------------------


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits 1 here; the reader went away (`| head`), which the one handler
        # (`TurnlogGroup.invoke`) ends quietly with the status a SIGPIPE gives.
        raise BrokenPipeError


# Output that typer renders itself (`--help`) goes through its own rich consoles, which
# exit 1 on a reader gone (`turnlog --help | head -1`); click does the same for an
# EPIPE it meets. `main` tells those exits apart by this mark and ends them with 141.
reader_gone = [False]
_rich_broken_pipe = Console.on_broken_pipe


def _mark_broken_pipe(self: Console) -> None:
    reader_gone[0] = True
    _rich_broken_pipe(self)


Console.on_broken_pipe = _mark_broken_pipe  # type: ignore[method-assign]


def _console(stream: IO[str]) -> Console:
    tty = stream.isatty()
    return _Console(file=stream, width=None if tty else PLAIN_WIDTH, highlight=False,
                    no_color=not tty or None)


class _WholeWrites(io.TextIOBase):
    """Results written to stdout's descriptor with `os.write`, each write whole.

    When the reader of a pipe goes away during a large write (`turnlog sessions |
    head -1`), the kernel returns the part it took; CPython's buffered stdout then
    drops the rest and reports success, so the command exited 0 with its output cut.
    Here the next `os.write` raises BrokenPipeError, which ends the command with 141.
    """

    def __init__(self, stream: io.TextIOBase | IO[str]) -> None:
        self.stream = stream
        self.fd = stream.fileno()
        self.codec = getattr(stream, "encoding", None) or "utf-8"
        self.codec_errors = getattr(stream, "errors", None) or "strict"

    def write(self, text: str) -> int:
        self.stream.flush()  # what was printed before comes first
        view = memoryview(text.encode(self.codec, self.codec_errors))
        while view:
            view = view[os.write(self.fd, view):]
        return len(text)

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.fd

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.codec


def results() -> IO[str]:
    """Where results go: stdout, written whole (`_WholeWrites`) where it is a file
    descriptor (a test runner's captured stdout is not)."""
    try:
        return _WholeWrites(sys.stdout)  # type: ignore[return-value]
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation included
        return sys.stdout


def out() -> Console:
    """Results: stdout (a script pipes this)."""
    return _console(results())


def err() -> Console:
    """Progress, warnings and errors: stderr."""
    return _console(sys.stderr)


# Control characters (C0, DEL, C1) shown, never acted on by the terminal.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}


def printable(text: str) -> str:
    """Stored text (a session id, a label) as the terminal may print it: rich markup
    escaped, control characters as `\\xNN` (an ANSI escape in a label recoloured the
    output, a line break in it forged a log line: a tester's finding)."""
    return escape(text.translate(_CONTROL))


def progress(*columns: Any, **options: Any) -> Progress:
    """A progress bar on stderr, drawn only on a terminal (off one, rich still wrote a
    blank line when it stopped: noise in CI logs, and "empty stderr" checks failed)."""
    console = err()
    return Progress(*columns, console=console, disable=not console.is_terminal, **options)


def table(title: str | None = None) -> Table:
    """A results table: boxed on a terminal, plain aligned columns without one."""
    tty = sys.stdout.isatty()
    return Table(title=None if title is None else escape(title),
                 box=box.SIMPLE_HEAD if tty else None, title_justify="left",
                 show_edge=tty, pad_edge=False)


def warn(message: str) -> None:
    if not _as_log_record("warning", message):
        err().print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def say(message: str) -> None:
    """A line of the command's own on stderr (a server's start line, a migration done):
    as written, or a log record when JSON logs were asked for by name."""
    if not _as_log_record("info", message):
        err().print(escape(message), soft_wrap=True)


def _as_log_record(level: str, message: str) -> bool:
    """With `--log-format json` (by name), `message` goes out as a log record of
    `level`, one JSON object like every other line on stderr (a log shipper that takes
    JSON lines reads them all); True when it went so."""
    import app.logs

    if not app.logs.json_asked():
        return False
    import structlog

    getattr(structlog.get_logger("turnlog.cli"), level)(message)
    return True


def echo_json(value: Any) -> None:
    from app.domain.wire import jsonio

    text = jsonio.dumps_bytes(value).decode() if not isinstance(value, str) else value
    stream = results()
    stream.write(text + "\n")
    stream.flush()


# -- the database ------------------------------------------------------------------------

_last_url: list[str] = []


def resolve_url(database_url: str | None) -> str:
    """The URL a command uses, normalized to the async drivers; remembered for errors."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from app.store.engine.db import normalize_url

    if database_url is not None and not database_url.strip():
        # An unset shell variable (`--database-url "$DB"`): not the default file.
        raise CliError("--database-url is empty: give a URL, or leave the option out for "
                       "TURNLOG_DATABASE_URL (else ./turnlog.db)")
    raw = database_url or get_settings().store.database_url
    try:
        url = normalize_url(raw)
    except ArgumentError:
        raise CliError("invalid database URL: expected postgresql://USER:PW@HOST/DB or "
                       "sqlite:///FILE") from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if sqlite_path(url) is None and make_url(url).get_backend_name() == "sqlite":
        # Each connection of an in-memory database is a database of its own: the
        # migrations would fill one, the command read another (empty) one.
        raise CliError("an in-memory SQLite database (sqlite:// or sqlite:///:memory:) "
                       "lasts only as long as one connection: give a file, sqlite:///FILE")
    _last_url[:] = [url]
    return url


def mask(url: str) -> str:
    """A URL as it may be printed or logged: the password replaced by `***`."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL at all: print nothing of it
        return "<unparseable URL>"


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None for PostgreSQL or an in-memory database)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database or "").expanduser().resolve()


def settings_for(url: str) -> Settings:
    """The environment's settings with this URL and the command line's log options
    (keeps metric keys, pool sizes…): what a command hands the services it runs."""
    return get_settings().replace(database_url=url, **_log_options)


def check_database(url: str, *, creating: bool = False) -> None:
    """Before anything touches the store: the file exists and the schema is at head.

    `creating` (migrate, serve, import, demo): a missing SQLite file is created
    by the migrations, and said so on stderr; the schema is not checked.
    """
    path = sqlite_path(url)
    if path is not None:
        if not path.parent.is_dir():
            raise CliError(f"no directory {path.parent} for the SQLite database")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            # SQLite (in WAL mode, as turnlog keeps it) writes `-wal` and `-shm` files
            # beside the database even to read it: "unable to open database file".
            raise CliError(f"the folder {path.parent} is not writable: SQLite writes its "
                           f"-wal and -shm files beside {path.name}, even to read it (copy "
                           "the file to a writable folder)")
        if not path.exists():
            if creating:
                say(f"creating a new SQLite database at {path}")
                return
            raise CliError(f"no database at {path}: run `turnlog migrate` to create one, or "
                           "point --database-url / TURNLOG_DATABASE_URL at yours")
    if creating:
        return
    # The revisions read without alembic (~0.2 s of imports a command need not pay);
    # its migration module only on the way to a refusal.
    from app.store.engine.revision import current, head_revision

    now, head = current(url), head_revision()
    if now == head:
        return
    from app.store.engine import migrate

    if now is None:
        # Another application's file: `turnlog migrate` would refuse it too (it was
        # suggested, then refused: a tester's finding).
        refusal = migrate.why_not_turnlog(url)
        if refusal is not None:
            raise CliError(refusal)
        where = mask(url) if path is None else str(path)
        raise CliError(f"not migrated: run `turnlog migrate` (database {where})")
    raise CliError(migrate.newer_schema(now) if not migrate.knows(now) else
                   f"schema at revision {now}, this turnlog expects {head}: "
                   "run `turnlog migrate`")


def with_services(url: str, use: Callable[[Any], Awaitable[T]]) -> T:
    """Run `use(services)` against the (checked) database, then release its connections."""
    from app.services import build_services

    async def run() -> T:
        services = build_services(settings_for(url))
        try:
            return await use(services)
        finally:
            await services.db.dispose()

    return asyncio.run(run())


async def resolve_session(db: Any, prefix: str) -> str:
    """A session id from what a person typed: the id itself or a unique prefix of it."""
    from app.store.read.selects import sessions_with_prefix

    async with db.read() as conn:
        matches = await sessions_with_prefix(conn, prefix, limit=6)
    if prefix in matches or len(matches) == 1:
        return prefix if prefix in matches else matches[0]
    if not matches:
        raise CliError(f"no session {prefix!r} (and no session id starts with it)")
    shown = ", ".join(matches[:5]) + (", …" if len(matches) > 5 else "")
    raise CliError(f"session prefix {prefix!r} is ambiguous: {shown}")


# -- a running server ---------------------------------------------------------------


def remote(url: str, token: str | None, call: str, *args: Any, **kwargs: Any) -> Any:
    """One call of the project's client against a running server (`--url`, `--token`)."""
    from turnlog_client import TurnlogClient, TurnlogConnectionError, TurnlogError

    async def run() -> Any:
        async with TurnlogClient(url, token=token, retries=2) as client:
            return await getattr(client, call)(*args, **kwargs)

    try:
        return asyncio.run(run())
    except TurnlogConnectionError as exc:
        raise CliError(exc.detail) from None  # names the URL and how to start a server
    except TurnlogError as exc:
        status = "" if exc.status is None else f"{exc.status} "
        hint = " (pass --token or set TURNLOG_TOKEN)" if exc.status in (401, 403) else ""
        raise CliError(f"{url}: {status}{exc.detail or exc}{hint}") from None



# -- labels ------------------------------------------------------------------------------


def parse_labels(items: list[str] | None, option: str = "--label") -> dict[str, str]:
    """`KEY=VALUE` pairs into a filter; the value is matched as text, as in the API."""
    labels: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=option)
        labels[key] = value
    return labels


# -- one error path ----------------------------------------------------------------------

_debug: list[bool] = [False]
# `--log-format` / `--log-level` of this invocation, by their settings' names.
_log_options: dict[str, str] = {}


def set_log_options(log_format: str | None, log_level: str | None) -> None:
    _log_options.clear()
    if log_format:
        _log_options["log_format"] = log_format
    if log_level:
        _log_options["log_level"] = log_level.lower()


def log_options() -> dict[str, str]:
    """`--log-format` / `--log-level` as settings (`log_format`, `log_level`), if given."""
    return dict(_log_options)


def set_debug(on: bool) -> None:
    _debug[0] = on


def debugging() -> bool:
    return _debug[0] or os.environ.get("TURNLOG_DEBUG", "") not in ("", "0", "false")


def describe_failure(exc: BaseException) -> str:
    """One line saying what is wrong and, where it is known, what to do."""
    from pydantic import ValidationError
    from sqlalchemy.exc import ArgumentError, DBAPIError

    from app.domain.errors import DomainError

    where = mask(_last_url[0]) if _last_url else "the database"
    from app.store.engine.disk import disk_full
    from app.store.engine.migrate import NotTurnlogDatabase

    if isinstance(exc, CliError | NotTurnlogDatabase):
        return str(exc)
    if isinstance(exc, DomainError):
        return exc.detail
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        if not errors:
            return f"invalid settings: {exc}"
        field = ".".join(str(p) for p in errors[0]["loc"]) or "settings"
        # Settings come from TURNLOG_* variables (or the flag that sets one).
        return f"invalid setting TURNLOG_{field.upper()}: {errors[0]['msg']}"
    if isinstance(exc, ArgumentError):
        return "invalid database URL: expected postgresql://USER:PW@HOST/DB or sqlite:///FILE"
    if isinstance(exc, DBAPIError):
        reason = _first_line(exc.orig or exc)
        if "no such table" in reason or ("relation" in reason and "does not exist" in reason):
            return f"not migrated: run `turnlog migrate` (database {where}: {reason})"
        if reason in ("disk I/O error", "database disk image is malformed"):
            # Besides a failing disk: a -wal removed (or a file replaced) under a server.
            return (f"cannot use {where}: {reason} (SQLite: check the disk; a -wal or -shm "
                    "file removed, or a database file replaced, while a server had it open "
                    "also does this: restore the file from a backup)")
        if disk_full(exc):
            # Freeing R3 writes too (its records, SQLite's write-ahead log): room first.
            return (f"cannot use {where}: the database's disk is full; free space on it "
                    "first (`turnlog retention r3` needs a few MB itself; the sessions it "
                    "freed before it stopped stay freed), then run this again")
        return f"cannot use {where}: {reason}"
    if isinstance(exc, OSError) and exc.filename is not None:
        # A file's error (a full disk under an export, a read-only checkpoint folder):
        # named as the file's, never as the database's. A socket's carries no name.
        name = exc.filename2 if exc.filename2 is not None else exc.filename
        return f"cannot use the file {os.fsdecode(name)}: {exc.strerror or _first_line(exc)}"
    if isinstance(exc, OSError | TimeoutError) or type(exc).__module__.startswith("asyncpg"):
        reason = _first_line(exc)
        if isinstance(exc, TimeoutError) and not str(exc).strip():
            reason = "no answer in time (it took the connection but never answered)"
        return (f"cannot connect to {where}: {reason} "
                "(check --database-url or TURNLOG_DATABASE_URL)")
    hint = "" if debugging() else " (`turnlog --debug …` shows the traceback)"
    return f"{type(exc).__name__}: {_first_line(exc)}{hint}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def fail(exc: BaseException) -> NoReturn:
    if not _as_log_record("error", describe_failure(exc)):
        err().print(f"[bold red]error:[/] {escape(describe_failure(exc))}", soft_wrap=True)
    raise typer.Exit(2)


class TurnlogGroup(typer.core.TyperGroup):
    """Every command runs inside this `invoke`: the one place failures are reported."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)  # registration order: serve first

    def invoke(self, ctx: Any) -> Any:
        try:
            result = super().invoke(ctx)
            # Buffered output meets a reader that stopped early (`| head`) here, inside
            # this handler, not in click's (which would exit 1).
            sys.stdout.flush()
            return result
        except (typer.Exit, typer.Abort):
            raise
        except typer.TyperException as exc:  # a usage error: one line too, naming the help
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            where = getattr(exc, "ctx", None)
            hint = "" if where is None else f" (see `{where.command_path} --help`)"
            if not _as_log_record("error", message + hint):
                err().print(f"[bold red]error:[/] {escape(message)}{escape(hint)}",
                            soft_wrap=True)
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None
        except KeyboardInterrupt:
            # What the command wrote stays (each write is whole, an export's file is not
            # left half-written); say it stopped, with the status a SIGINT gives.
            if not _as_log_record("warning", "interrupted"):
                err().print("interrupted", soft_wrap=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            # The reader of the output went away (`turnlog sessions | head`): stop quietly,
            # as Unix tools do (the status a SIGPIPE gives), not as a failure of ours.
            with contextlib.suppress(OSError, ValueError):  # a stdout with no file
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(141) from None
        except Exception as exc:
            if debugging():
                # The traceback, and still the status every failure exits with (it was 1).
                traceback.print_exc()
                fail(exc)
            fail(exc)


# Boolean flags show no `<bool>` type in help: `--close/--no-close` already says it.
_display_type = typer.core.TyperOption.display_type_rich


def _flag_display_type(self: typer.core.TyperOption, ctx: Any) -> str | None:
    if self.is_flag:
        return None
    return _display_type(self, ctx)


typer.core.TyperOption.display_type_rich = _flag_display_type  # type: ignore[method-assign]


