"""`turnlog consumers list|show GROUP`: where each consumer group's hand-off stands.

Reads the store directly (`--database-url`, default TURNLOG_DATABASE_URL) or
asks a running server (`--url`). Prints only; the counts and rules are the
store's (`app/store/consumers.py`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from app.cli.analytics import AsJson, DatabaseUrl, ServerUrl, _fail, _with_store, out

consumers_cli = typer.Typer(no_args_is_help=True,
                            help="Consumer groups: exactly-once hand-off to trainers.")
COLUMNS = ("group", "labels", "from", "acked", "leased", "available",
           "oldest_available_closed_at")


def _get(url: str, path: str, params: dict[str, Any] | None = None) -> Any:
    import httpx

    response = httpx.get(url.rstrip("/") + path, params=params, timeout=60)
    if response.status_code >= 400:
        raise RuntimeError(f"{response.status_code}: {response.text}")
    return response.json()


def _table(groups: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for name in COLUMNS:
        table.add_column(name, justify="right" if name in ("acked", "leased", "available")
                         else "left", overflow="fold")
    for g in groups:
        table.add_row(escape(g["group"]), escape(json.dumps(g["labels"])), g["from"],
                      str(g["acked"]), str(g["leased"]), str(g["available"]),
                      g["oldest_available_closed_at"] or "-")
    return table


@consumers_cli.command("list")
def consumers_list(database_url: DatabaseUrl = None, url: ServerUrl = None,
                   as_json: AsJson = False) -> None:
    """Every consumer group with its acked / leased / available counts."""
    try:
        groups = _get(url, "/v1/consumers")["groups"] if url else \
            _with_store(database_url, lambda svc: svc.consumers.list_groups())
    except Exception as exc:  # reported, exit 2
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps({"groups": groups}, indent=2))
        return
    out.print(_table(groups, "consumer groups"))


@consumers_cli.command("show")
def consumers_show(
    group: Annotated[str, typer.Argument(help="The consumer group")],
    acks: Annotated[int, typer.Option(help="Also list the latest N acks (0: none)")] = 10,
    step: Annotated[int | None, typer.Option(help="Only the acks of this training step")]
    = None,
    database_url: DatabaseUrl = None,
    url: ServerUrl = None,
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
            page = await svc.consumers.acks(group, only, after, 1000)
            rows += page["acks"]
            if len(page["acks"]) < 1000:
                return rows
            after = page["next"]

    try:
        if url:
            doc = _get(url, f"/v1/consumers/{group}")
            rows, after = [], None
            while True:
                page = _get(url, f"/v1/consumers/{group}/acks",
                            {"step": step, "after": after, "limit": 1000})
                rows += page["acks"]
                if len(page["acks"]) < 1000:
                    break
                after = page["next"]
        else:
            doc, rows = _with_store(database_url, read)
    except Exception as exc:  # reported, exit 2
        raise _fail(exc) from None
    latest = rows[-acks:] if acks > 0 else []
    if as_json:
        typer.echo(json.dumps({**doc, "acks": latest}, indent=2))
        return
    out.print(_table([doc], f"consumer group {escape(group)}"))
    if latest:
        table = Table(title=f"latest {len(latest)} of {len(rows)} acks"
                      + ("" if step is None else f" of step {step}"))
        for name in ("acked_at", "session_id", "claim_id", "epoch", "step"):
            table.add_column(name, overflow="fold")
        for a in latest:
            table.add_row(a["acked_at"], escape(a["session_id"]), escape(a["claim_id"]),
                          str(a["epoch"]), "-" if a["step"] is None else str(a["step"]))
        out.print(table)
