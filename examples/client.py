"""A session server's life with turnlog, end to end: `python examples/client.py [URL]`.

Opens a session, appends the two example turns of `tests/data/`, reads the
resume state, closes the session, reads its samples and one R3 tensor, and
follows the global feed until it is idle. Run it against `make run` (from a
clone, with the venv active); set TURNLOG_TOKEN if the server has API tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from turnlog_client import TurnlogClient, TurnlogError, new_event_id

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


async def main(base_url: str) -> None:
    definition = json.loads((DATA / "open_session.json").read_text())
    definition.pop("session_id")  # let the client pick a fresh one each run
    # A turn's `record` is what the session server logged for one SGLang call
    # (method, path, request with input_ids, response with output_ids and
    # meta_info); tests/data/turn_*.json hold two of them.
    records = [json.loads((DATA / f"turn_{i}.json").read_text())["record"] for i in (0, 1)]

    async with TurnlogClient(base_url, token=os.environ.get("TURNLOG_TOKEN"),
                             timeout=30.0, retries=5) as tl:
        session = await tl.open(definition)
        sid = session["session_id"]
        print("opened", sid)
        for record in records:
            event_id = new_event_id()  # keep it until the append succeeded
            reply = await tl.append(sid, record, event_id=event_id)
            print(f"turn seq {reply['seq']} (parent {reply['parent']})")
        state = await tl.resume(sid)
        print("resume from", len(state["checkpoint_token_ids"]), "tokens")
        await tl.close(sid, metadata={"reward": 1.0})
        samples = await tl.samples(sid)
        for sample in samples["samples"]:
            print(f"sample {sample['index']}: {len(sample['tokens'])} tokens")
        r3 = await tl.r3(sid, 0)
        print("R3 tensor", r3.shape, r3.dtype)
        seen = 0
        async for page in tl.follow_pages(after=None, wait=1.0, until_idle=True):
            seen += sum(1 for event in page.events if event["session_id"] == sid)
        print("feed events of this session:", seen)


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
    except TurnlogError as exc:
        sys.exit(f"turnlog: {exc}")
