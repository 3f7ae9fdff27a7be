"""What an append costs as its session grows: CPU per append at a session's node count.

Run by hand (not in CI):

    .venv/bin/python -m bench.big_session [--nodes 1000] [--shape roots|siblings|chain]

Appends `--nodes` small turns to one v2 session, in process, through the store
services on a temporary SQLite file (no HTTP), and reports the process CPU per
append in windows of 100 nodes. An append finds its parent by the common
prefix of its prompt with every node of the session (`SessionState.attach`),
so its cost grows with the node count; the shapes say which nodes it meets:
- `roots`: every turn a new root (its prompt shares nothing): every node's
  tail differs at its first token;
- `siblings`: every turn a retry of the same prompt (a branchy session):
  children of one root, their tails differing at once;
- `chain`: every turn extends the last (an agentic rollout): every node
  matches in full.
Uses only the store services, so the same script measures any version of the
code (`PYTHONPATH=<tree>`).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from app.logs import configure_logging
from app.services import build_services
from app.settings import Settings
from app.store.engine import migrate
from tests.factory import open_body, turn

WINDOW = 100


def body_of(shape: str, i: int) -> dict[str, Any]:
    if shape == "roots":
        return turn([100 + i], [1, 2])
    if shape == "siblings":
        return turn([7, 8, 9], [10 + i, 11])
    # chain: each prompt is the last turn's prompt and output, plus one new token
    prompt = [t for k in range(i) for t in (1000 + k, 50_000 + k)]
    return turn([*prompt, 1000 + i], [50_000 + i])


async def run(nodes: int, shape: str) -> list[tuple[int, float]]:
    with tempfile.TemporaryDirectory(prefix="turnlog-big-session-") as scratch:
        url = f"sqlite+aiosqlite:///{Path(scratch) / 'bench.db'}"
        await asyncio.to_thread(migrate.upgrade, url)
        settings = Settings.load(database_url=url, migrate_on_start=False, api_tokens="",
                                 max_nodes=max(nodes, 1024))
        services = build_services(settings)
        try:
            sid = f"bench-{uuid.uuid4().hex}"
            await services.writer.open(open_body(sid, labels={}, version="v2"))
            windows: list[tuple[int, float]] = []
            started = time.process_time()
            for i in range(nodes):
                await services.writer.append_turn(sid, body_of(shape, i))
                if (i + 1) % WINDOW == 0:
                    now = time.process_time()
                    windows.append((i + 1, (now - started) / WINDOW * 1e3))
                    started = now
            return windows
        finally:
            await services.db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000,
                        help="turns appended to the session (default 1000)")
    parser.add_argument("--shape", choices=["roots", "siblings", "chain"], default="roots")
    args = parser.parse_args()
    if args.nodes < WINDOW:
        parser.error(f"--nodes must be at least {WINDOW}")
    configure_logging("warning")
    print(f"one v2 session, {args.nodes} {args.shape} turns, SQLite, in process")
    print(f"{'nodes':>7s}  CPU ms per append (the {WINDOW} appends up to there)")
    for count, ms in asyncio.run(run(args.nodes, args.shape)):
        print(f"{count:7d}  {ms:6.2f}")


if __name__ == "__main__":
    main()
