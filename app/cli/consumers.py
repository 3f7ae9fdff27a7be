"""`turnlog consumers list|show GROUP`: where each consumer group's hand-off stands.

Reads the store directly (`--database-url`, default TURNLOG_DATABASE_URL) or
asks a running server (`--url`). Prints only; the counts and rules are the
store's (`app/store/handoff/consumers.py`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from app.cli.common import (
    AsJson,
    DatabaseUrl,
    ReadToken,
    ServerUrl,
    check_database,
    echo_json,
    out,
    remote,
    resolve_url,
    table,
    with_services,
)
from app.domain.handoff.consumers import parse_step_filter

consumers_cli = typer.Typer(no_args_is_help=True,
                            help="Consumer groups: exactly-once hand-off to trainers.")
COLUMNS = ("group", "labels", "from", "rewards", "acked", "leased", "available",
           "oldest_available_closed_at")


def _table(groups: list[dict[str, Any]], title: str) -> Table:
    grid = table(title)
    for name in COLUMNS:
        grid.add_column(name, justify="right" if name in ("acked", "leased", "available")
                        else "left", overflow="fold")
    for g in groups:
        grid.add_row(escape(g["group"]), escape(json.dumps(g["labels"])), g["from"],
                     "required" if g.get("require_reward") else "-",
                     str(g["acked"]), str(g["leased"]), str(g["available"]),
                     g["oldest_available_closed_at"] or "-")
    return grid


@consumers_cli.command("list")
def consumers_list(database_url: DatabaseUrl = None, url: ServerUrl = None,
                   token: ReadToken = None, as_json: AsJson = False) -> None:
    """Every consumer group with its acked / leased / available counts."""
    if url:
        groups = remote(url, token, "groups")
    else:
        store = resolve_url(database_url)
        check_database(store)
        groups = with_services(store, lambda svc: svc.consumers.list_groups())
    if as_json:
        echo_json({"groups": groups})
        return
    out().print(_table(groups, "consumer groups"))


@consumers_cli.command("show")
def consumers_show(
    group: Annotated[str, typer.Argument(help="The consumer group")],
    acks: Annotated[int, typer.Option(min=0, help="Also list the latest N acks (0: none)")] = 10,
    step: Annotated[int | None, typer.Option(help="Only the acks of this training step")]
    = None,
    database_url: DatabaseUrl = None,
    url: ServerUrl = None,
    token: ReadToken = None,
    as_json: AsJson = False,
) -> None:
    """One group: its definition, counts, and which sessions trained which step."""
    async def read(svc: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        doc = await svc.consumers.group(group)
        return doc, await _all_acks(svc, step)

    async def _all_acks(svc: Any, only: int | None) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        after = None
        while True:
            page = await svc.consumers.acks(group, parse_step_filter(only), after, 1000)
            rows += page["acks"]
            if len(page["acks"]) < 1000:
                return rows
            after = page["next"]

    if url:
        doc = remote(url, token, "group", group)
        rows, after = [], None
        while True:
            page = remote(url, token, "acks", group, step=step, after=after, limit=1000)
            rows += page["acks"]
            if len(page["acks"]) < 1000:
                break
            after = page["next"]
    else:
        store = resolve_url(database_url)
        check_database(store)
        doc, rows = with_services(store, read)
    latest = rows[-acks:] if acks > 0 else []
    if as_json:
        echo_json({**doc, "acks": latest})
        return
    out().print(_table([doc], f"consumer group {escape(group)}"))
    if latest:
        grid = table(f"latest {len(latest)} of {len(rows)} acks"
                     + ("" if step is None else f" of step {step}"))
        for name in ("acked_at", "session_id", "claim_id", "epoch", "step"):
            grid.add_column(name, overflow="fold")
        for a in latest:
            grid.add_row(a["acked_at"], escape(a["session_id"]), escape(a["claim_id"]),
                          str(a["epoch"]), "-" if a["step"] is None else str(a["step"]))
        out().print(grid)
