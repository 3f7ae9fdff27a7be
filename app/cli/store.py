"""`turnlog rebuild` and `turnlog replay`: recompute projections, fold one session.

Both read the database directly (checked first: never created, must be
migrated). Results go to stdout (a table, readable text or `--json`);
progress to stderr. Refuses: the rebuild and fold themselves (`app.store`,
`app.domain`) and the rebuild's checkpoint protocol (`app.store.ops.checkpoint`):
this module asks for them and shows the result.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TimeRemainingColumn
from rich.table import Table

from app.cli.browse import print_tree
from app.cli.common import (
    AsJson,
    CliError,
    DatabaseUrl,
    check_database,
    echo_json,
    err,
    out,
    progress,
    resolve_session,
    resolve_url,
    settings_for,
    table,
)

# No SQLAlchemy at import (the CLI starts without it); `_checkpoint_key` as tests know it.
from app.store.ops.checkpoint import Checkpoint, Resume
from app.store.ops.checkpoint import checkpoint_key as _checkpoint_key  # noqa: F401

if TYPE_CHECKING:
    from app.metrics import RebuildProgress
    from app.store.ops.rebuild import RebuildReport


def rebuild(
    session: Annotated[str | None, typer.Option(help="Only this session (or a unique prefix)")]
    = None,
    database_url: DatabaseUrl = None,
    metrics_port: Annotated[int | None, typer.Option(
        min=1, max=65535,
        help="Serve the progress gauges for Prometheus on 127.0.0.1:PORT while running")] = None,
    checkpoint: Annotated[Path, typer.Option(
        help="Where progress is kept after each batch; an interrupted rebuild of the same "
             "database resumes from it, a finished one removes it")] = Path(
        ".turnlog-rebuild.json"),
    restart: Annotated[bool, typer.Option(
        help="Ignore a checkpoint left by an interrupted run and start over")] = False,
    parallel: Annotated[int, typer.Option(
        min=1, help="Batches rebuilt at once on PostgreSQL (SQLite: always one)")] = 2,
    as_json: AsJson = False,
) -> None:
    """Drop and recompute every projection from the events; checksums must match.

    Resumable: progress is checkpointed after each batch of sessions, and a
    rebuild interrupted (Ctrl-C, a lost connection) carries on from there when
    run again with the same database, comparing against the checksums taken
    when it first started.
    """
    url = resolve_url(database_url)
    check_database(url)
    gauges = _progress_gauges(metrics_port)
    saved = Checkpoint(checkpoint, url, session)
    resume = _resume_from(saved, restart)
    try:
        report = asyncio.run(_run_rebuild(url, session, gauges, saved, resume, parallel))
    except KeyboardInterrupt:
        err().print("interrupted: " + (
            f"run the same command again to resume (progress is in {checkpoint})"
            if checkpoint.exists() else
            "no batch was checkpointed yet; the next run starts over"), soft_wrap=True)
        raise typer.Exit(130) from None
    saved.remove()
    if as_json:
        echo_json(_report_json(report))
    else:
        out().print(_report_table(report))
    _print_problems(report)
    if not report.ok:
        raise typer.Exit(1)


def _progress_gauges(metrics_port: int | None) -> RebuildProgress:
    """The progress gauges, served for Prometheus on 127.0.0.1:`metrics_port` if given."""
    from prometheus_client import start_http_server

    from app.metrics import RebuildProgress

    gauges = RebuildProgress()
    if metrics_port is not None:
        try:
            start_http_server(metrics_port, addr="127.0.0.1", registry=gauges.registry)
        except OSError as exc:  # said as the port's, not as the database's (it was)
            raise CliError(f"cannot serve the progress metrics on 127.0.0.1:{metrics_port}: "
                           f"{exc.strerror or exc} (check --metrics-port)") from None
    return gauges


def _resume_from(saved: Checkpoint, restart: bool) -> Resume | None:
    """This run's checkpoint, unless `--restart`; said on stderr when resuming."""
    from app.store.ops.checkpoint import ForeignCheckpoint

    try:
        resume = None if restart else saved.load()
    except ForeignCheckpoint as exc:
        raise CliError(str(exc)) from None
    if resume is not None:
        err().print(f"resuming the rebuild after session id {resume.last_id} "
                    f"(checkpoint {saved.path})")
    return resume


async def _run_rebuild(url: str, session: str | None, gauges: RebuildProgress,
                       saved: Checkpoint, resume: Resume | None,
                       parallel: int) -> RebuildReport:
    """The rebuild, with a progress bar on stderr and a checkpoint after each batch."""
    from app.store.engine.db import Database
    from app.store.ops.rebuild import rebuild as run_rebuild

    db = Database(url, settings_for(url))
    try:
        only = None if session is None else await resolve_session(db, session)
        with progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeRemainingColumn(),
                      transient=True) as bar:
            task = bar.add_task("rebuilding sessions", total=None)

            def advance(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)
                gauges(done, total)

            return await run_rebuild(db, only, advance,
                                     start_after=None if resume is None else resume.last_id,
                                     before=None if resume is None else resume.before,
                                     mark=None if resume is None else resume.mark,
                                     on_batch=saved.save, parallel=parallel)
    finally:
        await db.dispose()


def _report_json(report: RebuildReport) -> dict[str, Any]:
    return {"sessions": report.sessions, "equal": report.equal,
            "changed_during_rebuild": report.changed,
            "projections": {name: {"before": before, "after": report.after[name],
                                   "equal": before == report.after[name]}
                            for name, before in report.before.items()}}


def _report_table(report: RebuildReport) -> Table:
    grid = table(f"projections of {report.sessions} session(s)")
    for column in ("projection", "before", "after", ""):
        grid.add_column(column, no_wrap=True)
    for name, before in report.before.items():
        after = report.after[name]
        grid.add_row(name, before[:16], after[:16],
                     "[green]equal[/]" if before == after else "[red]DIFFERENT[/]")
    return grid


def _print_problems(report: RebuildReport) -> None:
    """Orphan rows, changed or differing checksums, unaccounted log rows: on stderr."""
    for name, found in report.orphans.items():
        total = sum(found.values())
        shown = ", ".join(f"{sid} ({n})" for sid, n in list(found.items())[:10])
        more = f" and {len(found) - 10} more" if len(found) > 10 else ""
        err().print(f"[red]{total} {name} row(s) belong to no session[/] "
                    f"(session row missing): {shown}{more}")
    if not report.equal and report.changed:
        err().print(f"[red]the store changed during the rebuild ({report.changed} event(s) "
                    "written by a live server), so its checksums cannot be compared: "
                    "every session was rebuilt under its append lock, but proving the "
                    "projections equal needs a quiet store — run `turnlog rebuild` again "
                    "with no server writing[/]")
    elif not report.equal:
        err().print("[red]rebuilt projections differ from the incremental ones[/]")
    if not report.accounted:
        err().print("[red]the log holds rows this rebuild cannot account for; restore the "
                    "missing sessions rows from a backup[/]")


def replay(
    session: Annotated[str, typer.Argument(help="Session id (or a unique prefix)")],
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Fold one session from its events and print its tree, state and samples."""
    from app.domain.projection.rows import tree_entry
    from app.domain.projection.samples import build_samples
    from app.store.engine.db import Database
    from app.store.fold.loader import fold_events, r3_freed, session_row

    url = resolve_url(database_url)
    check_database(url)

    async def go() -> Any:
        db = Database(url, settings_for(url))
        try:
            sid = await resolve_session(db, session)
            async with db.read() as conn:
                await session_row(conn, sid)
                return await fold_events(conn, None, sid), await r3_freed(conn, sid)
        finally:
            await db.dispose()

    state, pruned = asyncio.run(go())
    spec = state.definition
    result = None if state.close is None else build_samples(state, state.close)
    head = {"session_id": spec.session_id, "version": spec.version,
            "pause_generation_mode": spec.pause_generation_mode,
            "r3": None if spec.num_layers is None else {"num_layers": spec.num_layers},
            "spec": spec.speculative, "labels": spec.labels,
            "status": "open" if state.close is None else "closed"}
    tree = [tree_entry(node) for node in state.nodes]
    resume = state.resume()
    if as_json:
        echo_json({**head, "tree": tree, "state": resume,
                   "samples": None if result is None else result.to_json(False, pruned)})
        return
    console = out()
    labels = " ".join(f"{k}={v}" for k, v in spec.labels.items()) or "-"
    console.print(f"[bold]{escape(spec.session_id)}[/] {spec.version} "
                  f"{spec.pause_generation_mode} r3 layers={spec.num_layers or '-'} "
                  f"spec={'on' if spec.speculative else 'off'} labels: {escape(labels)} "
                  f"({head['status']})", soft_wrap=True)
    print_tree(tree)
    console.print("state (what a restarted session server resumes from):")
    for key, value in resume.items():
        shown = (f"{len(value)} tokens" if key == "checkpoint_token_ids"
                 else value if isinstance(value, str) else json.dumps(value))
        console.print(f"  {key}: {escape(shown)}", soft_wrap=True)
    if result is None:
        console.print("open: no samples until it is closed")
        return
    samples = table(f"samples (empty_reason: {result.empty_reason or '-'})")
    for column in ("index", "leaf", "path", "tokens", "response", "loss tokens", "status",
                   "r3"):
        samples.add_column(column, no_wrap=column != "path")
    for s in result.samples:
        samples.add_row(str(s.index), str(s.leaf), ",".join(map(str, s.path)), str(len(s.tokens)),
                        str(s.response_length), str(sum(s.loss_mask)), s.status,
                        "-" if s.r3 is None else "x".join(map(str, s.r3["shape"]))
                        + (" (freed)" if pruned else ""))
    console.print(samples)
    for error in result.errors:
        console.print(f"[yellow]left out[/] leaf {error['leaf']}: {escape(str(error['detail']))}",
                      soft_wrap=True)
