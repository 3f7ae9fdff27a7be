"""`turnlog gate …`, `turnlog history …`, `turnlog analytics …`: the operator's and CI's commands.

`gate check` judges a run's metric history against trusted baselines and
exits 0 (trusted), 1 (failed) or 2 (error: a gate could not be judged, or
the check itself failed — bad spec file, unreachable database). It talks to
the database directly through the store (`--database-url`, default
TURNLOG_DATABASE_URL) or to a running server (`--url`). Rules live in
`app/domain/ci/gate_definitions.py` and `app/domain/ci/gates.py`; this module only parses options
and prints.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from app.cli.common import (
    AsJson,
    CliError,
    DatabaseUrl,
    Labels,
    ServerUrl,
    Token,
    check_database,
    echo_json,
    out,
    parse_labels,
    remote,
    resolve_url,
    table,
    warn,
    with_services,
)

gate_cli = typer.Typer(no_args_is_help=True, help="Regression gates over the metric history.")
history_cli = typer.Typer(no_args_is_help=True, help="CI metric history.")
analytics_cli = typer.Typer(no_args_is_help=True, help="Speculative-decoding analytics.")
STATUS_STYLE = {"PASS": "green", "INACTIVE": "cyan", "FAIL": "bold red", "ERROR": "bold magenta"}


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
        if not specs:
            # It ran every default gate, and recorded their values (a tester's finding).
            raise CliError(f"--spec {spec} lists no gate: name at least one, or leave "
                           "--spec out for the default gates")
    specs.extend({"metric": metric} for metric in metrics or ())
    return specs or None


def print_verdict(report: dict[str, Any]) -> None:
    coordinate = report["coordinate"]
    grid = table(f"gates of {report['run_id']} at {coordinate['test_path']} "
                 f"[{coordinate['backend']}, {coordinate['suite']}]")
    for name in ("metric", "steps", "step", "status", "value", "baseline", "n", "lo", "hi",
                 "detail"):
        # Long texts fold; a status or a number must stay on one line to be read.
        grid.add_column(name, overflow="fold", no_wrap=name not in ("metric", "detail"))
    for r in report["results"]:
        style = STATUS_STYLE.get(r["status"], "")
        step = "-" if r["step"] is None else str(r["step"])
        if r["step"] == -1:
            step = f"last ({r['at_step']})"
        grid.add_row(escape(r["metric"]), escape(r["steps_key"]), step,
                      f"[{style}]{r['status']}[/]", _number(r["value"]), _number(r["baseline"]),
                      str(r["baseline_n"]), _number(r["lo"]), _number(r["hi"]),
                      escape(r["detail"]))
    console = out()
    console.print(grid)
    recorded = report.get("recorded")
    note = "" if recorded is None else (
        f"; {recorded['rows']} value(s) recorded"
        + (" as baseline" if recorded["baseline"] else " (not a baseline)"))
    console.print(f"outcome: [bold]{report['outcome']}[/] (exit {report['exit_code']}){note}")


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
        "--dry-run", help="Judge only: do not record this run's values as (candidate) "
                          "baselines")] = False,
    database_url: DatabaseUrl = None,
    url: ServerUrl = None,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Judge a run against trusted baselines; exit 0 trusted, 1 failed, 2 error.

    Without --spec and --metric every default gate is checked.
    """
    coordinate = {"test_path": test_path, "backend": backend, "suite": suite}
    body: dict[str, Any] = {"coordinate": coordinate, "run_id": run_id, "record": not dry_run}
    try:
        specs = _spec_list(spec, metric)
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read --spec {spec}: {exc}") from None
    if specs is not None:
        body["specs"] = specs
    from app.domain.ci.gate_definitions import parse_check

    check = parse_check(body)  # a bad spec is reported before anything is asked of the store

    def no_such_run(history: dict[str, Any]) -> None:
        # Judging a run nobody submitted would list every metric as missing.
        if not history["attempts"]:
            raise CliError(f"no such run {run_id!r} at {test_path} [{backend}, {suite}]: "
                           "check --run-id and the coordinate, or submit its metric history "
                           "first (turnlog history submit)")

    if url:
        no_such_run(remote(url, token, "metric_history", coordinate, run_id))
        report = remote(url, token, "evaluate_gates", body)
    else:
        from app.domain.ci.metric_history import parse_coordinate

        store = resolve_url(database_url)
        check_database(store)

        async def judge(svc: Any) -> Any:
            history = await svc.history.run(parse_coordinate(coordinate), run_id)
            no_such_run(history.as_dict())
            return await svc.gates.evaluate(check)

        report = with_services(store, judge)
    if as_json:
        echo_json(report)
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
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Store one attempt's metric points (only whitelisted metrics are kept)."""
    try:
        body = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {file}: {exc}") from None
    if url:
        reply = remote(url, token, "submit_history", body)
    else:
        store = resolve_url(database_url)
        check_database(store)
        from app.domain.ci.metric_history import parse_submission

        submission = parse_submission(body)
        reply = with_services(store, lambda svc: svc.history.submit(submission))[0]
    if reply["dropped"]:
        # Said now, not when a gate later finds the metric missing.
        warn(f"dropped {len(reply['dropped'])} metric(s) not in the whitelist: "
             f"{', '.join(reply['dropped'])} (the whitelist is TURNLOG_METRIC_KEYS "
             f"{'of the server' if url else 'here'}; default: the gated metrics)")
    if as_json:
        echo_json(reply)
        return
    dropped = f", dropped {', '.join(reply['dropped'])}" if reply["dropped"] else ""
    out().print(f"run {escape(str(reply['run_id']))} attempt {reply['attempt']}: kept "
                f"{reply['kept']} point(s){escape(dropped)}; attempts {reply['attempts']}",
                soft_wrap=True)


@analytics_cli.command("spec")
def analytics_spec(
    group_by: Annotated[str, typer.Option(
        help="weight_version | model | run_id | rollout_id | hour | day")],
    label: Labels = None,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Speculative-decoding accept rate and length per group (sums first, then ratios)."""
    from app.domain.body.labels import parse_label_filters
    from app.domain.body.queries import parse_group_by

    filters = parse_label_filters(parse_labels(label))
    grouping = parse_group_by(group_by)
    store = resolve_url(database_url)
    check_database(store)
    reply = with_services(store, lambda svc: svc.analytics.spec_rates(grouping, filters))
    if as_json:
        echo_json(reply)
        return
    grid = table(f"spec decoding by {group_by}")
    for name in ("key", "sessions", "turns", "correct", "proposed", "verify", "completion",
                 "accept_rate", "accept_length"):
        grid.add_column(name, justify="left" if name == "key" else "right", no_wrap=True)
    for g in reply["groups"]:
        grid.add_row("(none)" if g["key"] is None else escape(str(g["key"])),
                     str(g["sessions"]), str(g["turns"]), str(g["spec_num_correct_drafts"]),
                     str(g["spec_num_proposed_drafts"]), str(g["spec_verify_ct"]),
                     str(g["completion_tokens"]), f"{g['accept_rate']:.4f}",
                     f"{g['accept_length']:.4f}")
    out().print(grid)
