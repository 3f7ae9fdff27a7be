"""The UI's JSON fragments read their query like the API: bad input is a 4xx
problem+json, never a 500 (every backend; PostgreSQL refuses a NUL in text).
And `/ui/`, as a browser user may type it, leads to the list."""

from __future__ import annotations

import pytest

from tests.api.helpers import assert_problem


@pytest.mark.parametrize("status", ["\x00", "bogus", "OPEN"])
async def test_live_rows_refuse_a_bad_status(client, status):
    r = await client.get("/ui/rows", params={"status": status})
    assert_problem(r, 422, "invalid-request")
    assert r.json()["field"] == "status"


@pytest.mark.parametrize("status", ["", "open", "closed"])
async def test_live_rows_take_a_good_or_blank_status(client, sid, status):
    await client.post("/v1/sessions", json={"session_id": sid, "version": "v2",
                                            "labels": {"run_id": sid}})
    r = await client.get("/ui/rows", params={"status": status, "run_id": sid})
    assert r.status_code == 200, r.text
    listed = [s["session_id"] for s in r.json()["sessions"]]
    assert listed == ([] if status == "closed" else [sid])


async def test_the_list_with_a_trailing_slash_redirects_to_the_list(client):
    r = await client.get("/ui/", params={"status": "open", "run_id": "x"})
    assert r.status_code == 308
    assert r.headers["location"] == "/ui?status=open&run_id=x"
    assert (await client.get("/ui/")).headers["location"] == "/ui"


async def test_a_null_weight_version_reads_null_in_the_sample_table(client, sid):
    """A review's finding: the sample table printed Python's "None" for a turn that
    sent `"weight_version": null` (listed since this round, as miles lists it)."""
    from tests.factory import open_body, turn

    await client.post("/v1/sessions", json=open_body(sid))
    await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2], weight_version=None))
    await client.post(f"/v1/sessions/{sid}/close", json={})
    page = await client.get(f"/ui/sessions/{sid}")
    assert page.status_code == 200
    row = page.text[page.text.index('data-testid="sample-row"'):]
    row = row[:row.index("</tr>")]
    assert "None" not in row and "null" in row
