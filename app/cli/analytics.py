"""`turnlog gate …`, `turnlog history …`, `turnlog analytics …`: the operator's and CI's commands.

`gate check` judges a run's metric history against trusted baselines and
exits 0 (trusted), 1 (failed) or 2 (error: a gate could not be judged, or
the check itself failed — bad spec file, unreachable database). It talks to
the database directly through the store (`--database-url`, default
TURNLOG_DATABASE_URL) or to a running server (`--url`). Rules live in
`app/domain/gate_definitions.py` and `app/domain/gates.py`; this module only parses options
and prints.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.domain.gate_definitions import parse_check
from app.domain.labels import parse_label_filters
from app.domain.metric_history import parse_submission
from app.domain.queries import parse_group_by
from app.settings import Settings, get_settings

gate_cli = typer.Typer(no_args_is_help=True, help="Regression gates over the metric history.")
history_cli = typer.Typer(no_args_is_help=True, help="CI metric history.")
analytics_cli = typer.Typer(no_args_is_help=True, help="Speculative-decoding analytics.")
out = Console()
err = Console(stderr=True)
T = TypeVar("T")

DatabaseUrl = Annotated[str | None, typer.Option(
    help="SQLAlchemy URL (default: TURNLOG_DATABASE_URL)")]
ServerUrl = Annotated[str | None, typer.Option(
    "--url", help="Ask a running turnlog server (e.g. http://127.0.0.1:8000) instead")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the JSON reply instead of a table")]
STATUS_STYLE = {"PASS": "green", "INACTIVE": "cyan", "FAIL": "bold red", "ERROR": "bold magenta"}


def _settings(database_url: str | None) -> Settings:
    settings = get_settings()
    if database_url:
        settings = settings.model_copy(update={"database_url": database_url})
    return settings


def _check_sqlite_path(url: str) -> None:
    # SQLite would fail to open the file deep inside aiosqlite's worker thread, which
    # then reports on a closed loop; say plainly what is wrong instead.
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database or "").resolve().parent
        if not folder.is_dir():
            raise RuntimeError(f"no directory {folder} for the SQLite database")


def _with_store(database_url: str | None, use: Callable[[Any], Awaitable[T]]) -> T:
    """Run `use(services)` against the database, then release its connections."""
    from app.services import build_services

    settings = _settings(database_url)
    _check_sqlite_path(settings.database_url)

    async def run() -> T:
        services = build_services(settings)
        try:
            return await use(services)
        finally:
            await services.db.dispose()

    return asyncio.run(run())


def _post(url: str, path: str, body: Any) -> Any:
    import httpx

    response = httpx.post(url.rstrip("/") + path, json=body, timeout=120)
    if response.status_code >= 400:
        raise RuntimeError(f"{response.status_code}: {response.text}")
    return response.json()


def _fail(exc: BaseException) -> typer.Exit:
    detail = getattr(exc, "detail", None) or str(exc) or type(exc).__name__
    err.print(f"[bold red]error:[/] {detail}", markup=True, highlight=False)
    return typer.Exit(2)


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.6g}"
    return str(value)


def _spec_list(spec: Path | None, metrics: list[str] | None) -> list[Any] | None:
    specs: list[Any] = []
    if spec is not None:
        loaded = json.loads(spec.read_text())
        if isinstance(loaded, dict) and "specs" in loaded:
            loaded = loaded["specs"]
        specs.extend(loaded if isinstance(loaded, list) else [loaded])
    specs.extend({"metric": metric} for metric in metrics or ())
    return specs or None


def print_verdict(report: dict[str, Any]) -> None:
    coordinate = report["coordinate"]
    table = Table(title=escape(f"gates of {report['run_id']} at {coordinate['test_path']} "
                               f"[{coordinate['backend']}, {coordinate['suite']}]"))
    for name in ("metric", "steps", "step", "status", "value", "baseline", "n", "lo", "hi",
                 "detail"):
        # Long texts fold; a status or a number must stay on one line to be read.
        table.add_column(name, overflow="fold", no_wrap=name not in ("metric", "detail"))
    for r in report["results"]:
        style = STATUS_STYLE.get(r["status"], "")
        step = "-" if r["step"] is None else str(r["step"])
        if r["step"] == -1:
            step = f"last ({r['at_step']})"
        table.add_row(escape(r["metric"]), escape(r["steps_key"]), step,
                      f"[{style}]{r['status']}[/]", _number(r["value"]), _number(r["baseline"]),
                      str(r["baseline_n"]), _number(r["lo"]), _number(r["hi"]),
                      escape(r["detail"]))
    out.print(table)
    recorded = report.get("recorded")
    note = "" if recorded is None else (
        f"; {recorded['rows']} value(s) recorded"
        + (" as baseline" if recorded["baseline"] else " (not a baseline)"))
    out.print(f"outcome: [bold]{report['outcome']}[/] (exit {report['exit_code']}){note}")


@gate_cli.command("check")
def gate_check(
    run_id: Annotated[str, typer.Option(help="The run to judge")],
    test_path: Annotated[str, typer.Option(help="Run coordinate: test path")],
    backend: Annotated[str, typer.Option(help="Run coordinate: backend")],
    suite: Annotated[str, typer.Option(help="Run coordinate: suite")],
    spec: Annotated[Path | None, typer.Option(
        help="JSON file: a list of gate specs {metric, steps?, constraint?}",
        exists=True, dir_okay=False)] = None,
    metric: Annotated[list[str] | None, typer.Option(
        help="Gate this metric with its default steps and constraint (repeatable)")] = None,
    dry_run: Annotated[bool, typer.Option(
        help="Judge only: do not record this run's values as (candidate) baselines")] = False,
    database_url: DatabaseUrl = None,
    url: ServerUrl = None,
    as_json: AsJson = False,
) -> None:
    """Judge a run against trusted baselines; exit 0 trusted, 1 failed, 2 error.

    Without --spec and --metric every default gate is checked.
    """
    try:
        body: dict[str, Any] = {
            "coordinate": {"test_path": test_path, "backend": backend, "suite": suite},
            "run_id": run_id,
            "record": not dry_run,
        }
        specs = _spec_list(spec, metric)
        if specs is not None:
            body["specs"] = specs
        if url:
            report = _post(url, "/v1/gates/evaluate", body)
        else:
            report = _with_store(database_url, lambda svc: svc.gates.evaluate(parse_check(body)))
    except Exception as exc:  # every failure to judge is exit 2, never a traceback
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_verdict(report)
    raise typer.Exit(int(report["exit_code"]))


@history_cli.command("submit")
def history_submit(
    file: Annotated[Path, typer.Argument(
        help="JSON body of POST /v1/metric-history (coordinate, run_id, attempt, trusted, "
             "points)", exists=True, dir_okay=False)],
    database_url: DatabaseUrl = None,
    url: ServerUrl = None,
) -> None:
    """Store one attempt's metric points (only whitelisted metrics are kept)."""
    try:
        body = json.loads(file.read_text())
        if url:
            reply = _post(url, "/v1/metric-history", body)
        else:
            submission = parse_submission(body)
            reply = _with_store(database_url, lambda svc: svc.history.submit(submission))[0]
    except Exception as exc:  # reported, exit 2
        raise _fail(exc) from None
    dropped = f", dropped {', '.join(reply['dropped'])}" if reply["dropped"] else ""
    out.print(f"run {reply['run_id']} attempt {reply['attempt']}: kept {reply['kept']} "
              f"point(s){dropped}; attempts {reply['attempts']}")


def _labels(pairs: list[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--label")
        labels[key] = value
    return labels


@analytics_cli.command("spec")
def analytics_spec(
    group_by: Annotated[str, typer.Option(
        help="weight_version | model | run_id | rollout_id | hour | day")],
    label: Annotated[list[str] | None, typer.Option(
        help="Label filter KEY=VALUE (repeatable), as in the API")] = None,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Speculative-decoding accept rate and length per group (sums first, then ratios)."""
    filters = _labels(label)
    try:
        query = parse_group_by(group_by), parse_label_filters(filters)
        reply = _with_store(database_url, lambda svc: svc.analytics.spec_rates(*query))
    except Exception as exc:  # reported, exit 2
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(reply, indent=2))
        return
    table = Table(title=f"spec decoding by {group_by}")
    for name in ("key", "sessions", "turns", "correct", "proposed", "verify", "completion",
                 "accept_rate", "accept_length"):
        table.add_column(name, justify="left" if name == "key" else "right")
    for g in reply["groups"]:
        table.add_row("(none)" if g["key"] is None else str(g["key"]), str(g["sessions"]),
                      str(g["turns"]), str(g["spec_num_correct_drafts"]),
                      str(g["spec_num_proposed_drafts"]), str(g["spec_verify_ct"]),
                      str(g["completion_tokens"]), f"{g['accept_rate']:.4f}",
                      f"{g['accept_length']:.4f}")
    out.print(table)
