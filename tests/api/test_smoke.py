import json
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "data"


async def test_example_session_round_trips(client, sid):
    open_body = json.loads((EXAMPLES / "open_session.json").read_text())
    open_body["session_id"] = sid
    r = await client.post("/v1/sessions", json=open_body)
    assert r.status_code == 201, r.text
    for i in range(2):
        turn = json.loads((EXAMPLES / f"turn_{i}.json").read_text())
        r = await client.post(f"/v1/sessions/{sid}/turns", json=turn)
        assert r.status_code == 201, r.text
        assert r.json()["seq"] == i
    r = await client.get(f"/v1/sessions/{sid}/events")
    assert r.status_code == 200, r.text
    evs = r.json()
    for i in range(2):
        turn = json.loads((EXAMPLES / f"turn_{i}.json").read_text())
        assert evs[i + 1]["record"] == turn["record"]
    r = await client.get(f"/v1/sessions/{sid}/state")
    assert r.json()["next_routed_experts_start_len"] == 17
