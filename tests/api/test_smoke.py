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


async def test_readiness_reads_the_migration_scripts_at_most_once(client, monkeypatch):
    """`/readyz` compares the schema with the newest migration on every probe; reading
    the scripts took ~5 ms of the event loop each time (a tester's measurement)."""
    from alembic.script import ScriptDirectory

    from app.store.engine import migrate

    reads: list[int] = []
    original = ScriptDirectory.from_config

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        reads.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ScriptDirectory, "from_config", counted)
    for _ in range(5):
        r = await client.get("/readyz")
        assert r.status_code == 200, r.text
        assert r.json()["schema"] == migrate.head_revision()
    assert len(reads) <= 1
