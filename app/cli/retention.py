"""`turnlog retention r3 --consumer G --acked-before T [--dry-run]`: free acknowledged R3.

Runs against the store directly (`--database-url`, default
TURNLOG_DATABASE_URL), one session per transaction behind a progress bar,
then VACUUMs the patch table on PostgreSQL so the freed pages are reusable
at once. The rules are the store's (`app/store/ops/retention.py`); this prints.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn

from app.cli.common import (
    AsJson,
    CliError,
    DatabaseUrl,
    check_database,
    echo_json,
    out,
    progress,
    resolve_url,
    with_services,
)
from app.domain.errors import InvalidRequest
from app.domain.handoff.retention import parse_r3_retention
from app.domain.projection.rows import iso_us

# The request's fields, as this command's flags name them.
FLAGS = {"consumer": "--consumer", "acked_before": "--acked-before"}

retention_cli = typer.Typer(no_args_is_help=True,
                            help="Retention: free R3 a consumer group has trained on.")


@retention_cli.command("r3")
def retention_r3(
    consumer: Annotated[str, typer.Option(help="Consumer group whose acks count")],
    acked_before: Annotated[str, typer.Option(
        help="ISO-8601 time (UTC without a zone): sessions acked strictly before it")],
    dry_run: Annotated[bool, typer.Option(help="Report what would be freed, change nothing")]
    = False,
    vacuum: Annotated[bool, typer.Option(
        help="VACUUM r3_patches afterwards (PostgreSQL) so the space is reusable now")] = True,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Free the stored R3 of every session CONSUMER acknowledged before ACKED_BEFORE."""
    # A bad argument is the domain's refusal, said with the flag that carried it (exit 2).
    try:
        request = parse_r3_retention({"consumer": consumer, "acked_before": acked_before,
                                      "dry_run": dry_run})
    except InvalidRequest as exc:
        field = exc.field or ""
        flag = FLAGS.get(field, field)
        detail = exc.detail.replace(field, flag, 1) if field and field in exc.detail \
            else f"{flag}: {exc.detail}"
        raise CliError(detail + (f" (expected {exc.expected})" if exc.expected else "")
                       ) from None

    async def run(svc: Any) -> Any:
        with progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeRemainingColumn(),
                      transient=True) as bar:
            task = bar.add_task("checking sessions" if dry_run else "freeing R3", total=None)
            result = await svc.retention.prune(
                request, lambda done, total: bar.update(task, completed=done, total=total))
        if result.sessions and vacuum and not dry_run:
            await svc.retention.vacuum()
        return result

    store = resolve_url(database_url)
    check_database(store)
    result = with_services(store, run)
    # The instant used, in UTC, as the server's route names it (a time given without
    # a zone was read as UTC, and says so).
    instant = iso_us(request.acked_before_us)
    body: dict[str, Any] = {"sessions": result.sessions, "bytes": result.bytes,
                            "acked_before": instant, "dry_run": dry_run}
    if result.held_by:
        body["held_by"] = result.held_by
    if as_json:
        echo_json(body)
        return
    verb = "would free" if dry_run else "freed"
    out().print(f"{verb} {result.bytes} bytes of R3 in {result.sessions} session(s) "
                f"{consumer!r} acknowledged before {instant}")
    for name, count in result.held_by.items():
        out().print(f"kept {count} session(s) that group {name!r} matches and has not "
                    "acknowledged yet")
