"""`turnlog import` and `turnlog export`: session dumps in, training samples out.

Both talk to the database directly through the store services (no server
needed); `import` applies the migrations first, like `serve`. The work is in
`app/transfer/dump_import.py` and `app/transfer/npz.py`; this module parses
options, shows progress bars (stderr) and prints the summary (stdout).
"""

from __future__ import annotations

import asyncio
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from app.cli.common import (
    AsJson,
    CliError,
    DatabaseUrl,
    Labels,
    check_database,
    echo_json,
    out,
    parse_labels,
    progress,
    resolve_url,
    settings_for,
    table,
    warn,
    with_services,
)

if TYPE_CHECKING:
    from app.transfer.dump_import import ImportReport

def import_(
    files: Annotated[list[Path], typer.Argument(
        exists=True, dir_okay=False, readable=True,
        help="Session dumps: JSON (an object or an array) or JSONL, one session each")],
    database_url: DatabaseUrl = None,
    num_layers: Annotated[int | None, typer.Option(
        min=1, help="R3 layers when a dump's metadata does not say (num_layers)")] = None,
    max_trim_tokens: Annotated[int, typer.Option(
        min=0, help="TITO trim allowed, unless a dump's metadata says (max_trim_tokens)")] = 0,
    label: Annotated[list[str] | None, typer.Option(
        "--label", metavar="KEY=VALUE",
        help="Label every imported session KEY=VALUE (repeatable; values are text)")] = None,
    close: Annotated[bool, typer.Option(
        "--close", help="Close each session after import, so its samples can be read "
                        "(not one with a rejected record: see --close-incomplete)")] = False,
    close_incomplete: Annotated[bool, typer.Option(
        "--close-incomplete", help="With --close: close sessions with rejected records "
                                   "too (their samples miss those turns)")] = False,
    as_json: AsJson = False,
) -> None:
    """Import miles session-server dumps (`GET /sessions/{id}`) as v1 sessions, idempotently.

    Every record becomes a turn with a deterministic event id, so importing
    the same dump again adds nothing. Records that fail validation are
    reported and skipped; the exit code is 1 if anything failed.
    """
    from app.services import build_services
    from app.store.engine import migrate
    from app.transfer.dump_import import (
        Failure,
        ImportOptions,
        ImportReport,
        Unreadable,
        import_dump,
        read_dumps,
    )

    options = ImportOptions(num_layers=num_layers, max_trim_tokens=max_trim_tokens,
                            labels=parse_labels(label), close=close,
                            close_incomplete=close_incomplete)
    url = resolve_url(database_url)
    check_database(url, creating=True)
    migrate.upgrade(url)

    async def go() -> ImportReport:
        svc = build_services(settings_for(url))
        report = ImportReport()
        total = sum(path.stat().st_size for path in files)
        try:
            with progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                          TaskProgressColumn(), TextColumn("{task.fields[counts]}"),
                          TimeRemainingColumn(), transient=True) as bar:
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
        echo_json(report.to_json())
    else:
        _print_import(report)
    if report.sessions == 0 and not report.failures:
        warn("no session dump in " + ", ".join(str(path) for path in files)
             + ": nothing imported")
    for sid in report.left_open:
        warn(f"left {sid} open: a record was rejected (fix the dump and import it again, "
             "or pass --close-incomplete)")
    if report.failures:
        raise typer.Exit(1)


def _print_import(report: ImportReport) -> None:
    grid = table("import")
    grid.show_header = False
    grid.add_column()
    grid.add_column()
    grid.add_row("sessions", f"{report.sessions} ({report.sessions_new} new, "
                              f"{report.sessions_present} already present)")
    grid.add_row("turns imported", str(report.turns_imported))
    grid.add_row("turns already present", str(report.turns_present))
    if report.closed:
        grid.add_row("sessions closed", str(report.closed))
    if report.left_open:
        grid.add_row("sessions left open", str(len(report.left_open)))
    grid.add_row("failures", str(len(report.failures)))
    console = out()
    console.print(grid)
    if not report.failures:
        return
    console.print("[bold]failures[/] (skipped):")
    for failure in report.failures:
        problem = failure.problem
        where = "session" if failure.index is None else f"record {failure.index}"
        slug = str(problem.get("type", "")).removeprefix("urn:turnlog:")
        field = f" {problem['field']}" if problem.get("field") else ""
        # soft_wrap: one line per failure, whatever the terminal width (greppable).
        session = "" if failure.session_id is None else f" {failure.session_id}"
        console.print(f"  {escape(failure.source)}{escape(session)} {where}: "
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


def _export_parquet(url: str, filters: dict[str, str], out_file: Path, target: Path,
                    as_json: bool) -> None:
    from app.services import build_services
    from app.transfer.parquet import ParquetReport, export_parquet

    async def go() -> ParquetReport:
        svc = build_services(settings_for(url))
        try:
            with progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                          MofNCompleteColumn(), TextColumn("{task.fields[samples]} samples"),
                          TimeRemainingColumn(), transient=True) as bar:
                task = bar.add_task("exporting sessions", total=None, samples=0)

                def advance(done: int, total: int, samples: int) -> None:
                    bar.update(task, completed=done, total=total, samples=samples)

                return await export_parquet(svc, filters, target, progress=advance)
        finally:
            await svc.db.dispose()

    report = asyncio.run(go())
    if as_json:
        echo_json({**report.to_json(), "out": str(out_file)})  # as given (a link: kept)
        return
    out().print(f"wrote {escape(str(out_file))}: {report.sessions} session(s), "
                f"{report.samples} sample(s) in {report.row_groups} row group(s), "
                f"{report.r3_tensors} R3 tensor(s)"
                + (f", [yellow]{report.r3_errors} unreadable R3[/]" if report.r3_errors
                   else "") + f", {report.bytes} bytes", soft_wrap=True)


# What an --out name says the file is.
SUFFIX_FORMATS = {".npz": "npz", ".parquet": "parquet", ".pq": "parquet"}


def _export_format(out_file: Path, given: ExportFormat | None) -> ExportFormat:
    """The format: `--format`, else the one `--out`'s suffix names, else npz; a
    `--format` its suffix contradicts is refused (a `.parquet` file holding npz
    failed only when a trainer read it)."""
    named = SUFFIX_FORMATS.get(out_file.suffix.lower())
    if given is None:
        return ExportFormat(named or "npz")
    if named is not None and named != given.value:
        raise CliError(f"--out {out_file} names a .{named} file, but --format is "
                       f"{given.value}: make them agree")
    return given


def _check_out(out_file: Path) -> Path:
    """Where the export's file goes: `--out`, or the file a symlink there names (the
    link is kept). It can be written there (its folder exists and takes a file, and
    nothing but a regular file is in its place: a device, a pipe or a socket was
    replaced by the export's file, `--out /dev/full` too): said first, naming `--out`,
    not later as a failure to reach the database."""
    from app.transfer.npz import partial_path

    try:
        target = out_file.resolve() if out_file.is_symlink() else out_file
    except (RuntimeError, OSError):  # a loop of links (3.11 raises RuntimeError)
        raise CliError(f"cannot write {out_file}: a loop of symlinks (check --out)") from None
    # What the path names, links followed (`/dev/stdout` names a pipe its path does not).
    if out_file.exists() and not out_file.is_file():
        kind = "a folder" if out_file.is_dir() else "not a regular file (a device, a pipe?)"
        raise CliError(f"cannot write {out_file}: it is {kind}; name a file (check --out)")
    probe = partial_path(target)  # the name the writers use
    try:
        probe.open("wb").close()
    except OSError as exc:
        raise CliError(f"cannot write {out_file}: {exc.strerror or exc} (check --out)"
                       ) from None
    probe.unlink(missing_ok=True)
    return target


def export(
    run_id: Annotated[str, typer.Option(help="Only sessions labelled run_id=RUN")],
    out_file: Annotated[Path, typer.Option(
        "--out", dir_okay=False, help="The file to write (.npz or .parquet)")],
    label: Labels = None,
    database_url: DatabaseUrl = None,
    compress: Annotated[bool, typer.Option(help="Deflate the entries (np.savez_compressed)")]
    = False,
    fmt: Annotated[ExportFormat | None, typer.Option(
        "--format", help="npz (numpy) or parquet (one row per sample, pyarrow); default: "
        "what --out's suffix says (.npz, .parquet), else npz", show_default=False)]
    = None,
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

    labels = parse_labels(label)
    if labels.get("run_id", run_id) != run_id:
        raise CliError(f"--label run_id={labels['run_id']} contradicts --run-id {run_id}: "
                       "give the run once")
    filters = {**labels, "run_id": run_id}
    fmt = _export_format(out_file, fmt)
    url = resolve_url(database_url)
    target = _check_out(out_file)
    check_database(url)
    wanted = " ".join(f"{k}={v}" for k, v in filters.items())

    async def matched(svc: Any) -> None:
        open_sessions = await _count(svc, "open", filters)
        if open_sessions:
            warn(f"skipping {open_sessions} open session(s) labelled {wanted}: only "
                 "closed sessions have samples")
        if not await _count(svc, "closed", filters, at_most=1):
            raise CliError(f"nothing matched: no closed session labelled {wanted}; "
                           f"{out_file} not written")

    with_services(url, matched)
    if fmt is ExportFormat.parquet:
        _export_parquet(url, filters, out_file, target, as_json)
        return

    async def go() -> ExportReport:
        svc = build_services(settings_for(url))
        try:
            with progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                          MofNCompleteColumn(), TimeRemainingColumn(),
                          transient=True) as bar:
                task = bar.add_task("exporting sessions", total=None)

                def advance(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                return await export_samples(svc, filters, target, compress=compress,
                                            progress=advance)
        finally:
            await svc.db.dispose()

    report = asyncio.run(go())
    if as_json:
        echo_json({**report.to_json(), "out": str(out_file)})  # as given (a link: kept)
        return
    out().print(f"wrote {escape(str(out_file))}: {report.sessions} session(s), "
                  f"{report.samples} sample(s), {report.r3_tensors} R3 tensor(s)"
                  + (f", [yellow]{report.r3_errors} unreadable R3[/]" if report.r3_errors
                     else "") + f", {report.bytes} bytes", soft_wrap=True)


def _label_filters(filters: dict[str, str]) -> Any:
    from app.domain.body.labels import parse_label_filters

    return parse_label_filters(filters)


async def _count(svc: Any, status: str, filters: dict[str, str], at_most: int = 10**9) -> int:
    """How many sessions of `status` match the filters (paging the store's list)."""
    found, after = 0, None
    while found < at_most:
        page = await svc.reader.list_sessions(status, after, 1000, _label_filters(filters))
        found += len(page["sessions"])
        if len(page["sessions"]) < 1000:
            break
        after = page["next"]
    return found
