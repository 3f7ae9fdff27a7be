"""`turnlog consumers list|show GROUP` against the store (both backends)."""

from __future__ import annotations

import uuid

from tests.api.test_consumers import closed_session, group
from tests.test_import_export import run_cli


async def test_list_and_show_report_counts_and_acks(client, db_url):
    labels = {"run_id": uuid.uuid4().hex}
    sids = [await closed_session(client, labels) for _ in range(3)]
    name = await group(client, labels)
    c = (await client.post(f"/v1/consumers/{name}/claims",
                           json={"claim_id": "c1", "limit": 2})).json()
    await client.post(f"/v1/consumers/{name}/claims/c1/ack",
                      json={"sessions": c["sessions"][:1], "step": 5})

    code, report, output = await run_cli("consumers", "list", "--database-url", db_url,
                                         "--json")
    assert code == 0, output
    mine = next(g for g in report["groups"] if g["group"] == name)
    assert (mine["acked"], mine["leased"], mine["available"]) == (1, 1, 1)

    code, report, output = await run_cli("consumers", "show", name, "--database-url", db_url,
                                         "--json")
    assert code == 0, output
    assert report["labels"] == labels
    assert [(a["session_id"], a["step"]) for a in report["acks"]] == [(sids[0], 5)]

    code, _, output = await run_cli("consumers", "show", name, "--database-url", db_url)
    assert code == 0 and name in output and "acks" in output

    code, _, output = await run_cli("consumers", "show", "nope", "--database-url", db_url)
    assert code == 2 and "no consumer group" in output


async def test_the_tables_say_which_groups_wait_for_rewards(client, db_url):
    labels = {"run_id": uuid.uuid4().hex}
    plain = await group(client, labels)
    rewarded = f"g-{uuid.uuid4().hex[:12]}"
    r = await client.put(f"/v1/consumers/{rewarded}",
                         json={"labels": labels, "require_reward": True})
    assert r.status_code == 201, r.text
    for name, said in ((plain, False), (rewarded, True)):
        code, _, output = await run_cli("consumers", "show", name, "--database-url", db_url)
        assert code == 0, output
        assert ("required" in output) is said, output
        assert "rewards" in output
