"""The analytics views of migration 0002 against the API and the pure rules, on both backends.

The property test builds random sessions over HTTP and checks that
`GET /v1/analytics/spec`, the `spec_rates_by_<key>` views, a hand-written
GROUP BY over `spec_turns`, and `app/domain` (SpecInfo, `rollout_metrics`)
give identical numbers — exact float equality, since every rate is one
float64 division of integer sums. Each example owns its label values,
weight versions and UTC day, so the shared database's other rows never
reach a group it looks at.
"""

import itertools
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.domain.body.specinfo import SPEC_INFO_KEYS, SpecInfo, sum_turns
from app.domain.body.turn import MISMATCH_TYPES
from app.domain.ci.rollout_metrics import (
    SPEC_ACCEPT_LENGTH,
    SPEC_ACCEPT_RATE,
    SampleRow,
    SessionRow,
    rollout_metrics,
    tito_key,
)
from app.domain.projection.rows import day_key, hour_key
from tests.factory import open_body, turn

GROUPS = {"weight_version": "weight_version", "model": "model", "run_id": "run_id",
          "rollout_id": "rollout_id", "hour": "record_hour", "day": "record_day"}
VIEWS = {"spec_turns", "spec_sessions", "rollout_samples",
         *(f"spec_rates_by_{name}" for name in GROUPS)}
DAY_2100 = 4102444800
_example_ids: Iterator[int] = itertools.count(random.randrange(10_000))


def ratio_sql(numerator: str, denominator: str) -> str:
    return (f"CASE WHEN {denominator} = 0 THEN 0.0 ELSE CAST({numerator} AS DOUBLE PRECISION)"
            f" / CAST({denominator} AS DOUBLE PRECISION) END")


@pytest.fixture
async def engine(db_url) -> AsyncEngine:
    eng = create_async_engine(db_url)
    yield eng
    await eng.dispose()


async def fetch(engine, sql, **params):
    async with engine.connect() as conn:
        return [dict(r) for r in (await conn.execute(sa.text(sql), params)).mappings()]


def normalized(row):
    """A view row as the API writes it: integer sums as int, rates as float."""
    out = dict(row)
    for name in ("sessions", "turns", *SPEC_INFO_KEYS):
        if name in out:
            out[name] = int(out[name])
    for name in ("accept_rate", "accept_length"):
        out[name] = float(out[name])
    return out


# --- the views exist and say what they mean ---------------------------------------------


async def test_the_migration_creates_every_view(engine):
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda c: set(sa.inspect(c).get_view_names()))
    assert names >= VIEWS


async def test_spec_turns_applies_the_guard_and_carries_labels(client, engine, sid):
    labels = {"run_id": f"r-{sid}", "model": "qwen", "rollout_id": 12}
    await client.post("/v1/sessions", json=open_body(sid, labels=labels))
    await client.post(f"/v1/sessions/{sid}/turns",
                      json=turn([1], [2, 3], spec=(0, 4, 5), weight_version=7))
    await client.post(f"/v1/sessions/{sid}/turns",
                      json=turn([9], [2], spec=(2, 1, 3), weight_version="7b"))
    rows = await fetch(engine, "SELECT * FROM spec_turns WHERE session_id = :sid ORDER BY seq",
                       sid=sid)
    picked = [{k: r[k] for k in ("seq", "weight_version", "model", "run_id", "rollout_id",
                                 "contributes", *SPEC_INFO_KEYS)} for r in rows]
    assert picked == [
        {"seq": 0, "weight_version": "7", "model": "qwen", "run_id": f"r-{sid}",
         "rollout_id": "12", "contributes": 0, "spec_num_correct_drafts": 0,
         "spec_num_proposed_drafts": 0, "spec_verify_ct": 0, "completion_tokens": 0},
        {"seq": 1, "weight_version": "7b", "model": "qwen", "run_id": f"r-{sid}",
         "rollout_id": "12", "contributes": 1, "spec_num_correct_drafts": 1,
         "spec_num_proposed_drafts": 3, "spec_verify_ct": 2, "completion_tokens": 1}]
    assert all(r["recorded_at"] is not None and r["record_day"] == "2025-08-21" for r in rows)


async def test_spec_sessions_is_the_session_carrier(client, engine, sid):
    await client.post("/v1/sessions", json=open_body(sid, spec=True))
    for i, counters in enumerate([(2, 1, 3), (0, 7, 7), (3, 2, 2)]):
        await client.post(f"/v1/sessions/{sid}/turns", json=turn([50 + i], [1, 2],
                                                                   spec=counters))
    closed = (await client.post(f"/v1/sessions/{sid}/close", json={})).json()
    (row,) = await fetch(engine, "SELECT * FROM spec_sessions WHERE session_id = :sid", sid=sid)
    carrier = closed["session_metrics"]["metrics"]["spec_info"]
    assert {k: int(row[k]) for k in SPEC_INFO_KEYS} == carrier
    info = SpecInfo.from_dict(carrier)
    assert (row["accept_rate"], row["accept_length"]) == (info.accept_rate, info.accept_length)
    assert row["status"] == "closed" and bool(row["spec"]) is True


# --- the equality property ---------------------------------------------------------------

BIG = (1 << 52) - 9  # near the per-turn cap (COUNTER_MAX): sums pass 2**53
counters = st.one_of(
    st.none(),
    st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 40)),
    st.tuples(st.integers(1, 3), st.integers(BIG, BIG + 9), st.integers(BIG, BIG + 9)),
)
mismatches = st.sampled_from([
    None, [], [{"type": "assistant_text"}],
    [{"type": "special_token_count"}, {"type": "assistant_text"}],
    [{"type": "non_assistant_text"}, {"type": "non_assistant_text"}],
])
turns = st.fixed_dictionaries({
    "spec": counters,
    "weight_version": st.sampled_from([None, 0, 1, 2]),
    "hour": st.integers(0, 23),
    "output": st.integers(1, 3),
    "finish_reason": st.sampled_from(["stop", "stop", "length"]),
    "mismatch": mismatches,
})
sessions = st.lists(st.fixed_dictionaries({
    "version": st.sampled_from(["v1", "v2"]),
    "spec": st.booleans(),
    "model": st.sampled_from([None, 0, 1]),
    "rollout": st.sampled_from([None, 0, 1]),
    "close": st.booleans(),
    "turns": st.lists(turns, max_size=3),
}), min_size=1, max_size=3)


class Example:
    """One drawn rollout with keys no other example (or test) uses."""

    def __init__(self, drawn):
        n = next(_example_ids)
        self.u = uuid.uuid4().hex[:10]
        self.run_id = f"prop-{self.u}"
        self.day0 = DAY_2100 + n * 86400
        self.rollout0 = 10**12 + n * 10
        self.sessions = drawn

    def labels(self, s):
        labels = {"run_id": self.run_id}
        if s["model"] is not None:
            labels["model"] = f"m-{self.u}-{s['model']}"
        if s["rollout"] is not None:
            labels["rollout_id"] = self.rollout0 + s["rollout"]
        return labels

    def weight_version(self, t):
        return None if t["weight_version"] is None else f"w-{self.u}-{t['weight_version']}"

    def timestamp(self, i, t):
        return self.day0 + t["hour"] * 3600 + i * 0.25

    def turn_keys(self, s, i, t):
        labels = self.labels(s)
        ts = self.timestamp(i, t)
        rollout = labels.get("rollout_id")
        return {"weight_version": self.weight_version(t), "model": labels.get("model"),
                "run_id": self.run_id, "rollout_id": None if rollout is None else str(rollout),
                "hour": hour_key(ts), "day": day_key(ts)}


def counters_of(t):
    verify, correct, proposed = t["spec"] or (0, 0, 0)
    return SpecInfo(spec_num_correct_drafts=correct, spec_num_proposed_drafts=proposed,
                    spec_verify_ct=verify, completion_tokens=t["output"])


def expected_groups(ex, group_by):
    groups = {}
    for si, s in enumerate(ex.sessions):
        for i, t in enumerate(s["turns"]):
            key = ex.turn_keys(s, i, t)[group_by]
            sids, spec_turns = groups.setdefault(key, (set(), []))
            sids.add(si)
            spec_turns.append(counters_of(t))
    out = []
    for key in sorted(groups, key=lambda k: (k is not None, k or "")):
        sids, spec_turns = groups[key]
        info = sum_turns(spec_turns)
        out.append({"key": key, "sessions": len(sids), "turns": len(spec_turns),
                    **info.as_dict(), "accept_rate": info.accept_rate,
                    "accept_length": info.accept_length})
    return out


def expected_rollout(ex):
    rows = []
    for si, s in enumerate(ex.sessions):
        if not s["close"]:
            continue
        leaves = s["turns"][-1:] if s["version"] == "v1" else s["turns"]
        rows.append(SessionRow(
            session_id=str(si), version=s["version"],
            samples=tuple(SampleRow(response_length=t["output"],
                                    status="truncated" if t["finish_reason"] == "length"
                                    else "completed", mismatch=t["mismatch"])
                          for t in leaves),
            carrier=sum_turns(counters_of(t) for t in s["turns"]) if s["spec"] else None))
    return rollout_metrics(rows)


async def record(client, ex):
    for s in ex.sessions:
        sid = f"s-{uuid.uuid4().hex}"
        r = await client.post("/v1/sessions", json=open_body(
            sid, version=s["version"], spec=s["spec"], labels=ex.labels(s)))
        assert r.status_code == 201, r.text
        for i, t in enumerate(s["turns"]):
            metadata = None if t["mismatch"] is None else {"tito_session_mismatch": t["mismatch"]}
            body = turn([1000 + i], list(range(1, 1 + t["output"])), spec=t["spec"],
                        weight_version=ex.weight_version(t), timestamp=ex.timestamp(i, t),
                        finish_reason=t["finish_reason"], metadata=metadata, parent=None)
            r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
            assert r.status_code == 201, r.text
        if s["close"]:
            assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200


async def view_groups(engine, ex, group_by, expected):
    """The example's groups from the grouped view (own keys) and from `spec_turns` (all)."""
    column = GROUPS[group_by]
    own = [g["key"] for g in expected if g["key"] is not None]
    from_view = []
    if own:
        rows = await fetch(engine, f"SELECT * FROM spec_rates_by_{group_by} WHERE key IN "
                           f"({', '.join(f':k{i}' for i in range(len(own)))})",
                           **{f"k{i}": key for i, key in enumerate(own)})
        from_view = sorted((normalized(r) for r in rows), key=lambda g: g["key"])
    sums = ", ".join(f"SUM({k}) AS {k}" for k in SPEC_INFO_KEYS)
    rows = await fetch(engine, f"""
        SELECT {column} AS key, COUNT(DISTINCT session_id) AS sessions, COUNT(*) AS turns,
               {sums},
               {ratio_sql("SUM(spec_num_correct_drafts)", "SUM(spec_num_proposed_drafts)")}
                   AS accept_rate,
               {ratio_sql("SUM(completion_tokens)", "SUM(spec_verify_ct)")} AS accept_length
        FROM spec_turns WHERE run_id = :rid GROUP BY {column}""", rid=ex.run_id)
    by_hand = sorted((normalized(r) for r in rows),
                     key=lambda g: (g["key"] is not None, g["key"] or ""))
    return from_view, by_hand


async def view_rollout(engine, ex):
    """`GET /v1/metrics/rollout` recomputed in SQL from `spec_sessions` and `rollout_samples`."""
    (head,) = await fetch(engine, f"""
        SELECT COUNT(*) AS sessions, SUM(CASE WHEN spec THEN 1 ELSE 0 END) AS spec_sessions,
               {ratio_sql("SUM(CASE WHEN spec THEN spec_num_correct_drafts ELSE 0 END)",
                          "SUM(CASE WHEN spec THEN spec_num_proposed_drafts ELSE 0 END)")}
                   AS accept_rate,
               {ratio_sql("SUM(CASE WHEN spec THEN completion_tokens ELSE 0 END)",
                          "SUM(CASE WHEN spec THEN spec_verify_ct ELSE 0 END)")}
                   AS accept_length
        FROM spec_sessions WHERE run_id = :rid AND status = 'closed'""", rid=ex.run_id)
    out = {"sessions": int(head["sessions"])}
    (samples,) = await fetch(engine, f"""
        SELECT COUNT(*) AS n, {ratio_sql("SUM(response_length)", "COUNT(*)")} AS mean,
               MAX(response_length) AS max, MIN(response_length) AS min,
               {ratio_sql("SUM(truncated)", "COUNT(*)")} AS truncated
        FROM rollout_samples WHERE run_id = :rid""", rid=ex.run_id)
    out["samples"] = int(samples["n"])
    if head["spec_sessions"]:
        out[SPEC_ACCEPT_RATE] = float(head["accept_rate"])
        out[SPEC_ACCEPT_LENGTH] = float(head["accept_length"])
    typed = ", ".join(f"{ratio_sql(f'SUM(mismatch_{t})', 'COUNT(*)')} AS {t}"
                      for t in MISMATCH_TYPES)
    for row in await fetch(engine, f"""
            SELECT version, {ratio_sql("SUM(mismatch_any)", "COUNT(*)")} AS mismatch_any,
                   {typed}
            FROM rollout_samples WHERE run_id = :rid AND tito_sent = 1
            GROUP BY version ORDER BY version""", rid=ex.run_id):
        out[tito_key(row["version"])] = float(row["mismatch_any"])
        for t in MISMATCH_TYPES:
            out[tito_key(row["version"], t)] = float(row[t])
    if out["samples"]:
        out["rollout/response_len/mean"] = float(samples["mean"])
        out["rollout/response_len/max"] = float(samples["max"])
        out["rollout/response_len/min"] = float(samples["min"])
        out["rollout/truncated_ratio"] = float(samples["truncated"])
    else:
        for key in ("response_len/mean", "response_len/max", "response_len/min",
                    "truncated_ratio"):
            out[f"rollout/{key}"] = 0.0
    return out


@settings(max_examples=10, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(drawn=sessions)
async def test_api_views_and_domain_rules_agree_exactly(client, engine, drawn):
    ex = Example(drawn)
    await record(client, ex)
    for group_by in GROUPS:
        expected = expected_groups(ex, group_by)
        r = await client.get("/v1/analytics/spec",
                             params={"group_by": group_by, "run_id": ex.run_id})
        assert r.status_code == 200, r.text
        assert r.json()["groups"] == expected, group_by
        from_view, by_hand = await view_groups(engine, ex, group_by, expected)
        assert from_view == [g for g in expected if g["key"] is not None], group_by
        assert by_hand == expected, group_by
    expected_metrics = expected_rollout(ex)
    r = await client.get("/v1/metrics/rollout", params={"run_id": ex.run_id})
    assert r.json() == expected_metrics
    assert await view_rollout(engine, ex) == expected_metrics


# --- the documented SQL runs as written ---------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "analytics.md"


def documented_statements() -> list[str]:
    blocks = re.findall(r"```sql\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.S)
    return [s.strip() for block in blocks for s in block.split(";") if s.strip()]


async def test_the_documented_queries_run_and_order_as_the_api(client, engine, sid):
    # A helper's finding: the example's `ORDER BY t.weight_version` put the null key
    # last on PostgreSQL (first on SQLite), unlike the API's order.
    labels = {"run_id": "run7", "team": "infra"}
    await client.post("/v1/sessions", json=open_body(sid, labels=labels))
    await client.post(f"/v1/sessions/{sid}/turns",
                      json=turn([1], [2, 3], spec=(2, 1, 3), weight_version="7"))
    await client.post(f"/v1/sessions/{sid}/turns",
                      json=turn([9], [2], spec=(2, 1, 3), weight_version=None))
    statements = documented_statements()
    assert len(statements) >= 3
    for statement in statements:
        await fetch(engine, statement)  # runs as written, on every backend
    by_version = next(s for s in statements if "GROUP BY t.weight_version" in s)
    api = (await client.get("/v1/analytics/spec", params={
        "group_by": "weight_version", "run_id": "run7", "team": "infra"})).json()["groups"]
    assert [r["weight_version"] for r in await fetch(engine, by_version)] == \
        [g["key"] for g in api] == [None, "7"]
