"""`turnlog export --format parquet`: one row per sample, readable by pyarrow, equal to
the served samples and R3 tensors (both backends)."""

from __future__ import annotations

import io
import json
import uuid

import numpy as np
import pyarrow.parquet as pq

from tests.test_import_export import linear_dump, run_cli, write_jsonl


async def wire_meta(client, sid: str, index: int) -> dict | None:
    """Sample `index` of the samples wire's `_samples_meta`; None when the session has
    an R3 gap (the wire then refuses the whole session)."""
    from safetensors.numpy import load

    r = await client.get(f"/v1/sessions/{sid}/samples", params={"format": "safetensors"})
    if r.status_code != 200:
        return None
    return json.loads(load(r.content)["_samples_meta"].tobytes())["samples"][index]


async def test_parquet_export_round_trip(client, db_url, tmp_path):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    dumps = [linear_dump("in_place", turns=5, seed=7, mismatch=True),
             linear_dump("retract", turns=3, seed=8),
             linear_dump("retract", turns=2, r3=False, layers_key=None, seed=9)]
    gap = linear_dump("in_place", turns=3, seed=10)
    gap["records"][1]["request"]["return_routed_experts"] = False
    gap["records"][1]["request"].pop("routed_experts_start_len")
    gap["records"][1]["response"]["choices"][0]["meta_info"].pop("routed_experts")
    dumps.append(gap)
    path = write_jsonl(tmp_path / "run.jsonl", dumps)
    code, _, output = await run_cli("import", str(path), "--database-url", db_url, "--close",
                                    "--label", f"run_id={run_id}")
    assert code == 0, output

    out = tmp_path / "samples.parquet"
    code, report, output = await run_cli("export", "--run-id", run_id, "--format", "parquet",
                                         "--out", str(out), "--database-url", db_url, "--json")
    assert code == 0, output
    assert report["samples"] == 4 and (report["r3_tensors"], report["r3_errors"]) == (2, 1)
    assert not list(tmp_path.glob("*.partial"))

    table = pq.read_table(out)
    assert table.num_rows == 4
    assert str(table.schema.field("tokens").type) == "list<element: int64>"
    types = {name: str(table.schema.field(name).type) for name in (
        "labels", "weight_versions", "prefix_cache_info", "response", "reward_source")}
    assert types == {
        "labels": "map<string, string ('labels')>",
        "weight_versions": "list<element: string>",
        "prefix_cache_info": "struct<cached_tokens: int64, total_prompt_tokens: int64>",
        "response": "string", "reward_source": "string"}
    rows = table.to_pylist()
    assert [r["session_id"] for r in rows] == [d["session_id"] for d in dumps]
    for row in rows:
        sid, index = row["session_id"], row["index"]
        sample = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"][index]
        assert row["tokens"] == sample["tokens"]
        assert row["loss_mask"] == sample["loss_mask"]
        assert row["rollout_log_probs"] == sample["rollout_log_probs"]
        assert row["status"] == sample["status"]
        assert json.loads(row["reward_json"]) == sample["reward"]
        assert row["spec_info"] == sample["spec_info"]
        assert json.loads(row["metadata"]) == sample["metadata"]
        assert dict(row["labels"]) == {"run_id": run_id}
        # The samples wire's fields, in native types, equal to its `_samples_meta`.
        meta = await wire_meta(client, sid, index)
        if meta is not None:
            assert row["response"] == meta["response"]
            assert row["prefix_cache_info"] == meta["prefix_cache_info"]
        assert row["weight_versions"] == [None if v is None else str(v)
                                          for v in sample["weight_versions"]]
        assert row["reward_source"] == sample.get("reward_source")
        r = await client.get(f"/v1/sessions/{sid}/samples/{index}/r3")
        if sample["r3"] is None:
            assert row["r3"] is None and row["r3_shape"] is None
        elif r.status_code == 422:
            assert row["r3"] is None
            assert json.loads(row["r3_error"])["type"] == "urn:turnlog:r3-gap"
        else:
            tensor = np.frombuffer(row["r3"], "<i4").reshape(row["r3_shape"])
            assert tensor.tobytes() == np.load(io.BytesIO(r.content)).tobytes()


async def test_parquet_rows_go_out_in_bounded_row_groups(client, db_url, tmp_path):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    dumps = [linear_dump("retract", turns=2, seed=s) for s in range(5)]
    path = write_jsonl(tmp_path / "run.jsonl", dumps)
    assert (await run_cli("import", str(path), "--database-url", db_url, "--close",
                          "--label", f"run_id={run_id}"))[0] == 0
    from app.services import build_services
    from app.settings import Settings
    from app.transfer.parquet import export_parquet

    svc = build_services(Settings.load(database_url=db_url))
    try:
        report = await export_parquet(svc, {"run_id": run_id}, tmp_path / "x.parquet",
                                      row_group_rows=2)
    finally:
        await svc.db.dispose()
    meta = pq.ParquetFile(tmp_path / "x.parquet").metadata
    assert report.row_groups == meta.num_row_groups == 3
    assert [meta.row_group(i).num_rows for i in range(3)] == [2, 2, 1]
