"""`turnlog demo`: simulate sessions into the store and show what comes out.

A newcomer's tour of the whole path after the Quickstart: the session
simulator (a fake SGLang with a causal router) appends random trees in both
R3 modes through the real HTTP API (in process), closes them, then the demo
prints the samples it got back, checks every R3 tensor against a full forward
over the sample's tokens, and shows the spec-decoding rates per session.
"""

from __future__ import annotations

import asyncio
import io
import random
import uuid
from typing import Annotated, Any

import httpx
import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from app.settings import Settings, get_settings

console = Console()


async def _play(http: httpx.AsyncClient, index: int, seed: int) -> dict[str, Any]:
    from app.simulator import SessionSimulator, SimConfig, SimRates

    mode = ("in_place", "retract")[index % 2]
    config = SimConfig(session_id=f"demo-{uuid.uuid4().hex[:10]}", version="v2",
                       pause_generation_mode=mode, spec=True, max_trim_tokens=index % 2,
                       labels={"run_id": "demo", "rollout_id": index})
    sim = SessionSimulator(config, random.Random(seed + index), SimRates())
    (await http.post("/v1/sessions", json=sim.open_body())).raise_for_status()
    for body in sim.random_session(8):
        reply = await http.post(f"/v1/sessions/{config.session_id}/turns", json=body)
        reply.raise_for_status()
    closed = await http.post(f"/v1/sessions/{config.session_id}/close",
                             json={"max_seq_len": 60, "metadata": {"reward": 1.0}})
    closed.raise_for_status()
    samples = (await http.get(f"/v1/sessions/{config.session_id}/samples")).json()
    samples["mode"] = mode
    samples["config"] = config
    return samples


async def _r3_matches(http: httpx.AsyncClient, sid: str, sample: dict[str, Any],
                      config: Any) -> str:
    from app.simulator import route

    if sample["r3"] is None:
        return "-"
    reply = await http.get(f"/v1/sessions/{sid}/samples/{sample['index']}/r3")
    if reply.status_code != 200:
        return f"[yellow]{reply.json()['type'].rsplit(':', 1)[-1]}[/]"
    tensor = np.load(io.BytesIO(reply.content), allow_pickle=False)
    forward = route(np.asarray(sample["tokens"]), config.num_layers, config.topk,
                    config.num_experts, config.router_seed)
    ok = tensor.tobytes() == forward.tobytes()
    return f"{'[green]=fwd[/]' if ok else '[red]DIFF[/]'} {tensor.shape[0]}x{tensor.shape[1]}x" \
        f"{tensor.shape[2]}"


def demo(
    sessions: Annotated[int, typer.Option(help="How many sessions to simulate")] = 4,
    seed: Annotated[int, typer.Option(help="Simulator seed")] = 0,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL")] = None,
) -> None:
    """Simulate sessions into the store; print their samples and spec rates."""
    from app.main import create_app
    from app.store import migrate

    url = database_url or get_settings().database_url
    migrate.upgrade(url)

    async def go() -> None:
        app = create_app(Settings(database_url=url, migrate_on_start=False))
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://demo") as http:
                results = []
                with Progress(console=console, transient=True) as bar:
                    task = bar.add_task("simulating sessions", total=sessions)
                    for i in range(sessions):
                        results.append(await _play(http, i, seed))
                        bar.advance(task)
                await _show(http, results)
        finally:
            await app.state.services.db.dispose()

    asyncio.run(go())


async def _show(http: httpx.AsyncClient, results: list[dict[str, Any]]) -> None:
    from app.domain.specinfo import SpecInfo

    table = Table(title="samples")
    for column in ("session", "mode", "idx", "leaf", "path", "tok", "loss", "status", "R3"):
        table.add_column(column, no_wrap=True)
    rates = Table(title="spec decoding per session (every node counted once)")
    for column in ("session", "accepted/proposed", "accept rate", "accept length"):
        rates.add_column(column)
    for res in results:
        sid = res["session_id"]
        mode = "add" if res["mode"] == "in_place" else "full"
        for s in res["samples"]:
            r3 = await _r3_matches(http, sid, s, res["config"])
            table.add_row(sid[-6:], mode, str(s["index"]), str(s["leaf"]),
                          ",".join(map(str, s["path"])), str(len(s["tokens"])),
                          str(sum(s["loss_mask"])), s["status"], r3)
        for error in res["errors"]:
            table.add_row(sid[-6:], mode, "-", str(error["leaf"]), "", "", "",
                          f"[yellow]{error['type']}[/]", "")
        carrier = res["session_metrics"]
        if carrier is not None:
            info = SpecInfo.from_dict(carrier["metrics"]["spec_info"])
            rates.add_row(sid, f"{info.spec_num_correct_drafts}/{info.spec_num_proposed_drafts}",
                          f"{info.accept_rate:.3f}", f"{info.accept_length:.3f}")
    console.print(table)
    console.print(rates)
    console.print("Next: [bold]turnlog replay <session>[/] shows one session's tree; "
                  "[bold]turnlog rebuild[/] recomputes every projection from the log.")
    if results:
        ui = f"http://{get_settings().host}:{get_settings().port}/ui"
        console.print(f"In the browser (with `make run` serving this database): "
                      f"[bold]{ui}/sessions/{results[0]['session_id']}[/] (its tree), "
                      f"{ui}?run_id=demo (every demo session and the run view)")
