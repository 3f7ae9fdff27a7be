"""`turnlog demo`: simulate sessions into the store and show what comes out.

A newcomer's tour of the whole path after the Quickstart: the session
simulator (a fake SGLang with a causal router) appends random trees in both
R3 modes through the real HTTP API (in process), closes them, then the demo
prints the samples it got back, checks every R3 tensor against a full forward
over the sample's tokens, and shows the spec-decoding rates per session.
Results go to stdout (tables, or `--json`); the progress bar and logs to stderr.
"""

from __future__ import annotations

import asyncio
import io
import random
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
import typer
from rich.markup import escape

from app.cli.common import (
    AsJson,
    CliError,
    DatabaseUrl,
    check_database,
    echo_json,
    err,
    out,
    progress,
    resolve_url,
    settings_for,
    table,
)
from app.settings import get_settings

if TYPE_CHECKING:
    import httpx

# The demo's sessions start over the last few hours, ending now: the run view's
# hourly plots then show today, with more than one point.
SPREAD_S = 4 * 3600.0


def start_clock(index: int, sessions: int, now: float) -> float:
    """When session `index` of `sessions` starts: evenly over the last SPREAD_S."""
    return now - SPREAD_S * (sessions - index) / max(sessions, 1)


def _answered(reply: httpx.Response) -> None:
    """The store took the write; else what it said (a full disk, a lost database), as
    the one line every failed command ends with."""
    if reply.is_success:
        return
    try:
        problem = reply.json()
    except ValueError:
        problem = None
    said = (f"{problem.get('title') or reply.reason_phrase}: {problem.get('detail')}"
            if isinstance(problem, dict) else reply.reason_phrase)
    raise CliError(f"the store answered {reply.status_code} to "
                   f"{reply.request.method} {reply.request.url.path}: {said}")


async def _play(http: httpx.AsyncClient, index: int, seed: int, clock: float) -> dict[str, Any]:
    from app.sim.simulator import SessionSimulator, SimConfig, SimRates

    mode = ("in_place", "retract")[index % 2]
    config = SimConfig(session_id=f"demo-{uuid.uuid4().hex[:10]}", version="v2",
                       pause_generation_mode=mode, speculative=True, max_trim_tokens=index % 2,
                       labels={"run_id": "demo", "rollout_id": index})
    rng = random.Random(seed + index)
    sim = SessionSimulator(config, rng, SimRates())
    sim.clock = clock
    _answered(await http.post("/v1/sessions", json=sim.open_body()))
    for body in sim.random_session(8):
        _answered(await http.post(f"/v1/sessions/{config.session_id}/turns", json=body))
    _answered(await http.post(f"/v1/sessions/{config.session_id}/close",
                              json={"max_seq_len": 60,
                                    "metadata": {"reward": round(rng.random(), 2)}}))
    samples = (await http.get(f"/v1/sessions/{config.session_id}/samples")).json()
    samples["mode"] = mode
    samples["config"] = config
    return samples


async def _r3_matches(http: httpx.AsyncClient, sid: str, sample: dict[str, Any],
                      config: Any) -> str:
    from app.sim.simulator import route

    if sample["r3"] is None:
        return "-"
    reply = await http.get(f"/v1/sessions/{sid}/samples/{sample['index']}/r3")
    if reply.status_code != 200:
        return str(reply.json()["type"].rsplit(":", 1)[-1])
    tensor = np.load(io.BytesIO(reply.content), allow_pickle=False)
    forward = route(np.asarray(sample["tokens"]), config.num_layers, config.topk,
                    config.num_experts, config.router_seed)
    ok = tensor.tobytes() == forward.tobytes()
    return f"{'=fwd' if ok else 'DIFF'} {tensor.shape[0]}x{tensor.shape[1]}x{tensor.shape[2]}"


def demo(
    sessions: Annotated[int, typer.Option(min=1, help="How many sessions to simulate")] = 4,
    seed: Annotated[int, typer.Option(help="Simulator seed")] = 0,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Simulate sessions into the store; print their samples and spec rates."""
    import httpx  # here: every other command starts without it

    from app.main import create_app
    from app.store.engine import migrate

    url = resolve_url(database_url)
    check_database(url, creating=True)
    migrate.upgrade(url)
    report: list[dict[str, Any]] = []

    async def go() -> None:
        app = create_app(settings_for(url).replace(migrate_on_start=False, api_tokens={}))
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
                results = []
                now = time.time()
                with progress(transient=True) as bar:
                    task = bar.add_task("simulating sessions", total=sessions)
                    for i in range(sessions):
                        results.append(await _play(http, i, seed,
                                                    start_clock(i, sessions, now)))
                        bar.advance(task)
                report.extend(await _summarize(http, results))
        finally:
            await app.state.services.db.dispose()

    asyncio.run(go())
    if as_json:
        echo_json({"sessions": report})
    else:
        _show(report)


async def _summarize(http: httpx.AsyncClient,
                     results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per session: its samples (R3 checked against a full forward) and spec rates."""
    from app.domain.body.specinfo import SpecInfo

    report = []
    for res in results:
        sid = res["session_id"]
        samples = [{"index": s["index"], "leaf": s["leaf"], "path": s["path"],
                    "tokens": len(s["tokens"]), "loss_tokens": sum(s["loss_mask"]),
                    "status": s["status"], "r3": await _r3_matches(http, sid, s, res["config"])}
                   for s in res["samples"]]
        rates = None
        carrier = res["session_metrics"]
        if carrier is not None:
            info = SpecInfo.from_dict(carrier["metrics"]["spec_info"])
            rates = {"accepted": info.spec_num_correct_drafts,
                     "proposed": info.spec_num_proposed_drafts,
                     "accept_rate": info.accept_rate, "accept_length": info.accept_length}
        report.append({"session_id": sid, "pause_generation_mode": res["mode"],
                       "samples": samples,
                       "errors": [{"leaf": e["leaf"], "type": e["type"]}
                                  for e in res["errors"]],
                       "spec": rates})
    return report


def _show(report: list[dict[str, Any]]) -> None:
    grid = table("samples")
    for column in ("session", "mode", "idx", "leaf", "path", "tok", "loss", "status", "R3"):
        grid.add_column(column, no_wrap=True)
    rates = table("spec decoding per session (every node counted once)")
    for column in ("session", "accepted/proposed", "accept rate", "accept length"):
        rates.add_column(column, no_wrap=True)
    for res in report:
        sid = escape(res["session_id"])
        mode = "add" if res["pause_generation_mode"] == "in_place" else "full"
        for s in res["samples"]:
            r3 = s["r3"]
            style = ("green" if r3.startswith("=fwd") else
                     "red" if r3.startswith("DIFF") else "yellow")
            grid.add_row(sid, mode, str(s["index"]), str(s["leaf"]),
                         ",".join(map(str, s["path"])), str(s["tokens"]),
                         str(s["loss_tokens"]), s["status"],
                         r3 if r3 == "-" else f"[{style}]{escape(r3)}[/]")
        for error in res["errors"]:
            grid.add_row(sid, mode, "-", str(error["leaf"]), "", "", "",
                         f"[yellow]{escape(error['type'])}[/]", "")
        spec = res["spec"]
        if spec is not None:
            rates.add_row(sid, f"{spec['accepted']}/{spec['proposed']}",
                          f"{spec['accept_rate']:.3f}", f"{spec['accept_length']:.3f}")
    console = out()
    console.print(grid)
    console.print(rates)
    err().print("Next: [bold]turnlog show <session>[/] shows one session's tree (a unique "
                "prefix of the id is enough); [bold]turnlog replay <session>[/] folds it from "
                "its events; [bold]turnlog rebuild[/] recomputes every projection.")
    if report:
        ui = f"http://{get_settings().server.host}:{get_settings().server.port}/ui"
        err().print(f"In the browser (with `make run` serving this database; served on "
                    "another port, that port): "
                    f"[bold]{ui}/sessions/{report[0]['session_id']}[/] (its tree), "
                    f"{ui}?run_id=demo (every demo session and the run view)")
