"""`turnlog sessions`, `turnlog show`, `turnlog tail`: look around the store without curl.

They read the database directly through the store's readers (the same
answers as `GET /v1/sessions`, `GET /v1/sessions/{id}` and `GET /v1/events`),
after `check_database`. A session id may be given as a unique prefix.
Readable text on stdout, or `--json`. Refuses: writing anything, and any rule
(the readers and the domain own what a summary or a tree is).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from app.cli.common import (
    AsJson,
    CliError,
    DatabaseUrl,
    Labels,
    check_database,
    echo_json,
    err,
    out,
    parse_labels,
    printable,
    resolve_session,
    resolve_url,
    table,
    with_services,
)
from app.domain.errors import DomainError

PAGE = 1000


def _labels_text(labels: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in labels.items()) or "-"


def sessions(
    status: Annotated[str | None, typer.Option(help="open | closed")] = None,
    label: Labels = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many sessions")] = 50,
    newest: Annotated[bool, typer.Option(
        "--newest", help="The newest --limit sessions (default: the oldest)")] = False,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """List sessions in the order they were opened, newest last (filters: --status,
    --label; --newest: the last --limit of them)."""
    from app.domain.body.labels import parse_label_filters
    from app.domain.body.queries import parse_status

    filters = parse_label_filters(parse_labels(label))
    try:
        status = parse_status(status)
    except DomainError:
        raise CliError(f"--status {status!r}: expected open or closed") from None
    url = resolve_url(database_url)
    check_database(url)

    async def go(svc: Any) -> tuple[list[dict[str, Any]], bool]:
        if newest:
            last = await svc.reader.newest_sessions(status, limit, filters)
            return last["sessions"], last["more"]
        found: list[dict[str, Any]] = []
        after = None
        while len(found) < limit:
            want = min(PAGE, limit - len(found))
            page = await svc.reader.list_sessions(status, after, want, filters)
            found.extend(page["sessions"])
            after = page["next"]
            if len(page["sessions"]) < want:
                return found, False
        more = await svc.reader.list_sessions(status, after, 1, filters)
        return found, bool(more["sessions"])

    found, more = with_services(url, go)
    if as_json:
        echo_json({"sessions": found, "more": more})
        return
    grid = table(f"{len(found)} session(s)")
    for column in ("session", "status", "version", "mode", "nodes", "created", "labels"):
        grid.add_column(column, no_wrap=column != "labels")
    for s in found:
        grid.add_row(printable(s["session_id"]), s["status"], s["version"],
                     s["pause_generation_mode"], str(s["num_nodes"]), s["created_at"],
                     printable(_labels_text(s["labels"])))
    out().print(grid)
    if more:
        older = "older" if newest else "newer"
        err().print(f"(more sessions match, {older} ones: raise --limit above {limit}"
                    + ("" if newest else ", or show the newest with --newest") + ")")


def print_tree(tree: list[dict[str, Any]]) -> None:
    """A session's turn tree, one node a line, children indented under their parent."""
    console = out()
    children: dict[int | None, list[dict[str, Any]]] = {}
    for node in tree:
        children.setdefault(node["parent"], []).append(node)
    console.print(f"tree ({len(tree)} node(s)):")
    if not tree:
        console.print("  (no turns yet)")

    def walk(node: dict[str, Any], depth: int) -> None:
        start, end = node["completion_span"]
        r3 = "-" if node["r3"] is None else f"[{node['r3']['start']}, {node['r3']['end']})"
        weight = "-" if node["weight_version"] is None else node["weight_version"]
        finish = node["finish_reason"] or "-"
        console.print(
            f"  {'  ' * depth}#{node['seq']}  tokens {node['num_tokens']}  "
            f"completion [{start}, {end})  finish {printable(str(finish))}  "
            f"weight_version {printable(str(weight))}  r3 {r3}"
            f"{'  (leaf)' if node['is_leaf'] else ''}", soft_wrap=True)
        for child in children.get(node["seq"], []):
            walk(child, depth + 1)

    for root in children.get(None, []):
        walk(root, 0)


def show(
    session: Annotated[str, typer.Argument(help="Session id (or a unique prefix)")],
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """One session: its summary and its turn tree."""
    url = resolve_url(database_url)
    check_database(url)

    async def go(svc: Any) -> dict[str, Any]:
        sid = await resolve_session(svc.db, session)
        body: dict[str, Any] = await svc.reader.session(sid)
        return body

    body = with_services(url, go)
    if as_json:
        echo_json(body)
        return
    console = out()
    console.print(f"[bold]{printable(body['session_id'])}[/] ({body['status']})", soft_wrap=True)
    r3 = body["r3"]
    for key, value in (
        ("version", body["version"]),
        ("pause_generation_mode", f"{body['pause_generation_mode']} (addition R3: "
                                  f"{'yes' if body['use_addition_r3'] else 'no'})"),
        ("r3", "off" if r3 is None else f"{r3['num_layers']} layers"),
        ("spec decoding", "on" if body["spec"] else "off"),
        ("max_trim_tokens", body["max_trim_tokens"]),
        ("labels", _labels_text(body["labels"])),
        # Who opened it when the open said (the recording gateway does: "gateway").
        ("opened by", body.get("opened_by") or "-"),
        ("created", body["created_at"]),
        ("closed", body["closed_at"] or "-"),
    ):
        console.print(f"  {key}: {printable(str(value))}", soft_wrap=True)
    print_tree(body["tree"])


def tail(
    after: Annotated[str | None, typer.Option(
        help="Start after this feed cursor (printed when tail stops)")] = None,
    from_start: Annotated[bool, typer.Option(
        "--from-start", help="Print the whole feed first (default: only new events)")] = False,
    until_idle: Annotated[bool, typer.Option(
        "--until-idle", help="Stop when nothing new came for --wait seconds")] = False,
    wait: Annotated[float, typer.Option(min=0.0, max=30.0,
                                        help="Long-poll this many seconds per page")] = 10.0,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Follow the global feed: one line per event, in commit order (Ctrl-C stops)."""
    from app.store.read.cursor import decode

    try:
        decode(after, 2)  # refused before the database is asked, naming the option
    except DomainError:
        raise CliError(f"--after {(after or '')[:80]!r} is not a feed cursor: give one that "
                       "`turnlog tail` printed when it stopped") from None
    url = resolve_url(database_url)
    check_database(url)
    cursor: list[str | None] = [after]

    async def go(svc: Any) -> None:
        if cursor[0] is None and not from_start:
            cursor[0] = await svc.reader.feed_end()  # `tail -f`, not `cat`
            # Silence would read as "broken": say what it waits for.
            err().print("waiting for new events (older ones: turnlog tail --from-start)",
                        soft_wrap=True)
        while True:
            try:
                page = await svc.reader.feed(cursor[0], PAGE, wait)
            except DomainError as exc:
                if exc.field != "after" or cursor[0] != after:
                    raise
                # Well formed, but naming no event of this store (another's, a backup's).
                raise CliError(f"--after {(after or '')[:80]!r} names no event of this "
                               "store: give a cursor `turnlog tail` printed for it") from None
            for event in page["events"]:
                if as_json:
                    echo_json(event)
                else:
                    seq = "" if event["seq"] is None else f" seq {event['seq']}"
                    typer.echo(f"{event['recorded_at']}  {event['session_id']}  "
                               f"{event['type']}{seq}")
            cursor[0] = page["next"]
            if not page["events"] and until_idle:
                return

    try:
        with_services(url, go)
    except KeyboardInterrupt:
        # Ctrl-C is how a follow stops: where to go on from, then `interrupted` and
        # 130 as every command (TurnlogGroup); a reader gone (`| head`) is 141 there.
        resume_hint(cursor[0])
        raise
    resume_hint(cursor[0])


def resume_hint(cursor: str | None) -> None:
    if cursor:
        err().print(f"resume with: turnlog tail --after {cursor}", soft_wrap=True)
