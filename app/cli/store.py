"""`turnlog rebuild` and `turnlog replay`: recompute projections, inspect one session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
from rich.table import Table

from app.domain.errors import DomainError
from app.settings import Settings, get_settings
from app.store.db import Database

console = Console()
T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a store coroutine; a domain error (unknown session…) is a clean exit 2."""
    try:
        return asyncio.run(coro)
    except DomainError as exc:
        console.print(f"[red]{exc.detail}[/]")
        raise typer.Exit(2) from None


def _database(database_url: str | None) -> Database:
    settings = get_settings()
    url = database_url or settings.database_url
    return Database(url, Settings(database_url=url))


def _checkpoint_key(url: str, session: str | None) -> str:
    from sqlalchemy.engine import make_url

    return f"{make_url(url).render_as_string(hide_password=True)} session={session}"


def rebuild(
    session: Annotated[str | None, typer.Option(help="Only this session")] = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        help="Serve the progress gauges for Prometheus on 127.0.0.1:PORT while running")] = None,
    checkpoint: Annotated[Path, typer.Option(
        help="Where progress is kept after each batch; an interrupted rebuild of the same "
             "database resumes from it, a finished one removes it")] = Path(
        ".turnlog-rebuild.json"),
    restart: Annotated[bool, typer.Option(
        help="Ignore a checkpoint left by an interrupted run and start over")] = False,
    parallel: Annotated[int, typer.Option(
        min=1, help="Batches rebuilt at once on PostgreSQL (SQLite: always one)")] = 2,
) -> None:
    """Drop and recompute every projection from the events; checksums must match.

    Resumable: progress is checkpointed after each batch of sessions, and a
    rebuild interrupted (Ctrl-C, a lost connection) carries on from there when
    run again with the same database, comparing against the checksums taken
    when it first started.
    """
    from prometheus_client import start_http_server

    from app.metrics import RebuildProgress
    from app.store.rebuild import rebuild as run_rebuild

    gauges = RebuildProgress()
    if metrics_port is not None:
        start_http_server(metrics_port, addr="127.0.0.1", registry=gauges.registry)
    url = database_url or get_settings().database_url
    key = _checkpoint_key(url, session)
    resume: dict[str, Any] = {}
    if checkpoint.exists() and not restart:
        saved = json.loads(checkpoint.read_text())
        if saved.get("key") == key:
            resume = saved
            console.print(f"resuming the rebuild after session id {saved['last_id']} "
                          f"(checkpoint {checkpoint})")

    def save(last_id: int, before: dict[str, str]) -> None:
        # Written whole then renamed: an interruption never leaves half a checkpoint.
        tmp = checkpoint.with_name(checkpoint.name + ".tmp")
        tmp.write_text(json.dumps({"key": key, "last_id": last_id, "before": before}))
        tmp.replace(checkpoint)

    async def go() -> Any:
        db = _database(url)
        try:
            with Progress("[progress.description]{task.description}", BarColumn(),
                          MofNCompleteColumn(), TimeRemainingColumn(), console=console,
                          transient=True) as bar:
                task = bar.add_task("rebuilding sessions", total=None)

                def advance(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)
                    gauges(done, total)

                return await run_rebuild(db, session, advance,
                                         start_after=resume.get("last_id"),
                                         before=resume.get("before"), on_batch=save,
                                         parallel=parallel)
        finally:
            await db.dispose()

    report = _run(go())
    checkpoint.unlink(missing_ok=True)
    table = Table(title=f"projections of {report.sessions} session(s)")
    for column in ("projection", "before", "after", ""):
        table.add_column(column)
    for name, before in report.before.items():
        after = report.after[name]
        table.add_row(name, before[:16], after[:16],
                      "[green]equal[/]" if before == after else "[red]DIFFERENT[/]")
    console.print(table)
    if not report.equal:
        console.print("[red]rebuilt projections differ from the incremental ones[/]")
        raise typer.Exit(1)


def replay(
    session: Annotated[str, typer.Argument(help="Session id")],
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL")] = None,
) -> None:
    """Fold one session from its events and print its tree, state and samples."""
    from app.domain.samples import build_samples
    from app.store.loader import fold_events, session_row

    async def go() -> Any:
        db = _database(database_url)
        try:
            async with db.read() as conn:
                await session_row(conn, session)
                return await fold_events(conn, None, session)
        finally:
            await db.dispose()

    state = _run(go())
    spec = state.spec
    console.print(f"[bold]{spec.session_id}[/] {spec.version} {spec.pause_generation_mode} "
                  f"r3={spec.num_layers} spec={spec.spec} labels={spec.labels}")
    tree = Table(title="tree")
    for column in ("seq", "parent", "depth", "tokens", "completion", "finish", "weight",
                   "r3 rows"):
        tree.add_column(column)
    for node in state.nodes:
        span = node.r3_span
        tree.add_row(str(node.seq), str(node.parent), str(node.depth), str(node.num_tokens),
                     f"[{node.prompt_len}, {node.num_tokens})", str(node.facts.finish_reason),
                     str(node.facts.weight_version),
                     "-" if span is None else f"[{span[0]}, {span[1]})")
    console.print(tree)
    resume = state.resume()
    resume["checkpoint_token_ids"] = f"<{len(resume['checkpoint_token_ids'])} tokens>"
    console.print("state:", resume)
    if state.close is None:
        console.print("open: no samples yet")
        return
    result = build_samples(state, state.close)
    samples = Table(title=f"samples (empty_reason={result.empty_reason})")
    for column in ("index", "leaf", "path", "tokens", "response", "loss tokens", "status",
                   "r3"):
        samples.add_column(column)
    for s in result.samples:
        samples.add_row(str(s.index), str(s.leaf), str(s.path), str(len(s.tokens)),
                        str(s.response_length), str(sum(s.loss_mask)), s.status,
                        "-" if s.r3 is None else str(s.r3["shape"]))
    console.print(samples)
    for error in result.errors:
        console.print(f"[yellow]left out[/] leaf {error['leaf']}: {error['detail']}")
