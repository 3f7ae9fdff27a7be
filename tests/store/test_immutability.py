"""The event log cannot be changed: UPDATE/DELETE of event and patch rows fail."""

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from tests.factory import open_body, r3_b64, turn


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET payload = '{}' WHERE session_id = :s",
        "DELETE FROM events WHERE session_id = :s",
        "UPDATE r3_patches SET data = :b WHERE session_id = :s",
        "DELETE FROM r3_patches WHERE session_id = :s",
    ],
)
async def test_log_rows_are_immutable(client, db_url, sid, statement):
    await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": 2}))
    r = await client.post(f"/v1/sessions/{sid}/turns",
                          json=turn([1, 2], [3], r3=r3_b64(2, 2, 2), start=0))
    assert r.status_code == 201
    engine = create_async_engine(db_url)
    try:
        with pytest.raises(DBAPIError, match="immutable"):
            async with engine.begin() as conn:
                await conn.execute(sa.text(statement), {"s": sid, "b": b"x"})
    finally:
        await engine.dispose()
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert len(evs) == 2


async def test_truncate_is_refused_on_postgres(client, db_url, backend):
    if backend == "sqlite":
        pytest.skip("SQLite has no TRUNCATE")
    engine = create_async_engine(db_url)
    try:
        with pytest.raises(DBAPIError, match="immutable"):
            async with engine.begin() as conn:
                await conn.execute(sa.text("TRUNCATE events CASCADE"))
    finally:
        await engine.dispose()
