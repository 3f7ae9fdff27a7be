"""A 100 MB record: accepted, stored narrowed, and read back byte-identical."""

import base64

import numpy as np
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from app.domain.wire import jsonio
from tests.factory import open_body, turn

LAYERS, TOPK = 64, 8


async def test_hundred_megabyte_record_round_trips(client, db_url, sid):
    rows = 36_000  # 36k rows x 64 layers x top-8 int32 = 74 MB raw, 98 MB of base64
    prompt = list(range(1, rows))
    rng = np.random.default_rng(0)
    r3 = rng.integers(0, 256, size=(rows, LAYERS, TOPK), dtype=np.int32)
    payload = base64.b64encode(r3.astype("<i4").tobytes()).decode()
    body = turn(prompt, [7, 8], r3=payload, start=0)
    raw = jsonio.dumps(body).encode()
    assert len(raw) > 98_000_000
    await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": LAYERS}))
    r = await client.post(f"/v1/sessions/{sid}/turns", content=raw,
                          headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text[:500]
    assert r.json()["r3"] == {"start": 0, "end": rows}

    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            stored = (await conn.execute(sa.text(
                "SELECT dtype, length(data) FROM r3_patches WHERE session_id = :s"),
                {"s": sid})).one()
    finally:
        await engine.dispose()
    assert stored[0] == "u1" and stored[1] == rows * LAYERS * TOPK  # a quarter of raw

    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    meta = evs[1]["record"]["response"]["choices"][0]["meta_info"]
    assert meta["routed_experts"] == payload
    assert evs[1]["record"] == body["record"]
