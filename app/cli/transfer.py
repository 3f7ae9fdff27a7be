"""`turnlog import` and `turnlog export`: session dumps in, training samples out.

Both talk to the database directly through the store services (no server
needed); `import` applies the migrations first, like `serve`. The work is in
`app/dump_import.py` and `app/npz_export.py`; this module parses options,
shows progress bars and prints the summary.
"""

from __future__ import annotations

import asyncio
import json
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from app.settings import Settings, get_settings

if TYPE_CHECKING:
    from app.transfer.dump_import import ImportReport

console = Console(stderr=True)

DatabaseUrl = Annotated[str | None, typer.Option(
    help="SQLAlchemy URL (default: TURNLOG_DATABASE_URL)")]
Labels = Annotated[list[str] | None, typer.Option(
    "--label", help="k=v (repeatable); the value is matched as text")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout")]


def _url(database_url: str | None) -> str:
    return database_url or get_settings().database_url


def parse_labels(items: list[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not k=v", param_hint="--label")
        labels[key] = value
    return labels


def import_(
    files: Annotated[list[Path], typer.Argument(
        exists=True, dir_okay=False, readable=True,
        help="Session dumps: JSON (an object or an array) or JSONL, one session each")],
    database_url: DatabaseUrl = None,
    num_layers: Annotated[int | None, typer.Option(
        min=1, help="R3 layers when a dump's metadata does not say (num_layers)")] = None,
    max_trim_tokens: Annotated[int, typer.Option(
        min=0, help="TITO trim allowed, unless a dump's metadata says (max_trim_tokens)")] = 0,
    label: Labels = None,
    close: Annotated[bool, typer.Option(
        help="Close each session after import, so its samples can be read")] = False,
    as_json: AsJson = False,
) -> None:
    """Import miles session-server dumps (`GET /sessions/{id}`) as v1 sessions, idempotently.

    Every record becomes a turn with a deterministic event id, so importing
    the same dump again adds nothing. Records that fail validation are
    reported and skipped; the exit code is 1 if anything failed.
    """
    from app.services import build_services
    from app.store import migrate
    from app.transfer.dump_import import (
        Failure,
        ImportOptions,
        ImportReport,
        Unreadable,
        import_dump,
        read_dumps,
    )

    url = _url(database_url)
    options = ImportOptions(num_layers=num_layers, max_trim_tokens=max_trim_tokens,
                            labels=parse_labels(label), close=close)
    migrate.upgrade(url)

    async def go() -> ImportReport:
        svc = build_services(Settings(database_url=url))
        report = ImportReport()
        total = sum(path.stat().st_size for path in files)
        try:
            with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                          TaskProgressColumn(), TextColumn("{task.fields[counts]}"),
                          TimeRemainingColumn(), console=console, transient=True) as bar:
                task = bar.add_task("importing", total=total or None, counts="")
                for path in files:
                    for item in read_dumps(path):
                        if isinstance(item, Unreadable):
                            report.failures.append(Failure(item.source, None, None, {
                                "type": "urn:turnlog:invalid-dump", "title": "Invalid dump",
                                "detail": item.detail}))
                        else:
                            await import_dump(svc.writer, item, options, report)
                        bar.update(task, advance=item.size, counts=(
                            f"{report.sessions} sessions, {report.turns_imported} new turns, "
                            f"{len(report.failures)} failures"))
        finally:
            await svc.db.dispose()
        return report

    report = asyncio.run(go())
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        _print_import(report)
    if report.failures:
        raise typer.Exit(1)


def _print_import(report: ImportReport) -> None:
    table = Table(title="import", show_header=False)
    table.add_row("sessions", f"{report.sessions} ({report.sessions_new} new, "
                              f"{report.sessions_present} already present)")
    table.add_row("turns imported", str(report.turns_imported))
    table.add_row("turns already present", str(report.turns_present))
    if report.closed:
        table.add_row("sessions closed", str(report.closed))
    table.add_row("failures", str(len(report.failures)))
    console.print(table)
    if not report.failures:
        return
    console.print("[bold]failures[/] (skipped):")
    for failure in report.failures:
        problem = failure.problem
        where = "session" if failure.index is None else f"record {failure.index}"
        slug = str(problem.get("type", "")).removeprefix("urn:turnlog:")
        field = f" {problem['field']}" if problem.get("field") else ""
        # soft_wrap: one line per failure, whatever the terminal width (greppable).
        console.print(f"  {escape(failure.source)} {escape(str(failure.session_id))} {where}: "
                      f"[red]{escape(slug)}[/]{escape(field)}: {escape(_detail(problem))}",
                      soft_wrap=True)


def _detail(problem: dict[str, Any]) -> str:
    detail = str(problem.get("detail", ""))
    if problem.get("expected") is not None or problem.get("actual") is not None:
        detail += f" (expected {problem.get('expected')!r}, got {problem.get('actual')!r})"
    return detail


class ExportFormat(StrEnum):
    npz = "npz"
    parquet = "parquet"


def _export_parquet(url: str, filters: dict[str, str], out: Path, as_json: bool) -> None:
    from app.services import build_services
    from app.transfer.parquet import ParquetReport, export_parquet

    async def go() -> ParquetReport:
        svc = build_services(Settings(database_url=url))
        try:
            with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                          MofNCompleteColumn(), TextColumn("{task.fields[samples]} samples"),
                          TimeRemainingColumn(), console=console, transient=True) as bar:
                task = bar.add_task("exporting sessions", total=None, samples=0)

                def advance(done: int, total: int, samples: int) -> None:
                    bar.update(task, completed=done, total=total, samples=samples)

                return await export_parquet(svc, filters, out, progress=advance)
        finally:
            await svc.db.dispose()

    report = asyncio.run(go())
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    console.print(f"wrote {escape(str(out))}: {report.sessions} session(s), "
                  f"{report.samples} sample(s) in {report.row_groups} row group(s), "
                  f"{report.r3_tensors} R3 tensor(s)"
                  + (f", [yellow]{report.r3_errors} unreadable R3[/]" if report.r3_errors
                     else "") + f", {report.bytes} bytes")


def export(
    run_id: Annotated[str, typer.Option(help="Only sessions labelled run_id=RUN")],
    out: Annotated[Path, typer.Option(dir_okay=False, help="The file to write")],
    label: Labels = None,
    database_url: DatabaseUrl = None,
    compress: Annotated[bool, typer.Option(help="Deflate the entries (np.savez_compressed)")]
    = False,
    fmt: Annotated[ExportFormat, typer.Option(
        "--format", help="npz (numpy) or parquet (one row per sample, pyarrow)")]
    = ExportFormat.npz,
    as_json: AsJson = False,
) -> None:
    """Write the samples of the matching closed sessions to one .npz or Parquet file.

    Parquet (`--format parquet`): one row per sample, written in row groups;
    columns are documented in docs/trainers.md.

    Keys: `{session_id}/{index}/tokens` (int64), `…/loss_mask` (uint8),
    `…/rollout_log_probs` (float64), `…/r3` (int32, when readable), plus
    `manifest` and `sessions`: uint8 arrays of JSON text
    (`json.loads(npz["manifest"].tobytes())`).
    """
    from app.services import build_services
    from app.transfer.npz import ExportReport, export_samples

    url = _url(database_url)
    filters = {**parse_labels(label), "run_id": run_id}
    if fmt is ExportFormat.parquet:
        _export_parquet(url, filters, out, as_json)
        return

    async def go() -> ExportReport:
        svc = build_services(Settings(database_url=url))
        try:
            with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                          MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                          transient=True) as bar:
                task = bar.add_task("exporting sessions", total=None)

                def advance(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                return await export_samples(svc, filters, out, compress=compress,
                                            progress=advance)
        finally:
            await svc.db.dispose()

    report = asyncio.run(go())
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        return
    console.print(f"wrote {escape(str(out))}: {report.sessions} session(s), "
                  f"{report.samples} sample(s), {report.r3_tensors} R3 tensor(s)"
                  + (f", [yellow]{report.r3_errors} unreadable R3[/]" if report.r3_errors
                     else "") + f", {report.bytes} bytes")
