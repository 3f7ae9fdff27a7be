"""`turnlog import` and `turnlog export` on both backends.

Dumps are built like miles' `GET /sessions/{id}` (linear v1 records from the
simulator); imports go through the real CLI, reads through the API."""

from __future__ import annotations

import asyncio
import io
import json
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from typer.testing import CliRunner

from app.cli import cli
from app.domain.body.session import parse_close
from app.domain.projection.samples import build_samples
from app.sim.simulator import SessionSimulator, SimConfig, SimRates, fold_in_memory
from app.transfer.dump_import import event_id


def linear_dump(mode: str = "retract", turns: int = 4, *, layers_key: str | None = "num_layers",
                r3: bool = True, seed: int = 0, mismatch: bool = False) -> dict[str, Any]:
    """A v1 session as the session server dumps it: records in order, no ids."""
    sid = f"dump-{uuid.uuid4().hex[:12]}"
    config = SimConfig(session_id=sid, version="v1", pause_generation_mode=mode,
                       num_layers=2 if r3 else None)
    sim = SessionSimulator(config, random.Random(seed), SimRates())
    records = []
    for i in range(turns):
        body = sim.turn(None if i == 0 else i - 1, new_tokens=2 + i % 3,
                        output_tokens=1 + i % 4, with_r3=r3)
        records.append(body["record"])
    metadata: dict[str, Any] = {"max_trim_tokens": 0}
    if layers_key == "num_layers":
        metadata["num_layers"] = 2
    elif layers_key == "r3.num_layers":
        metadata["r3"] = {"num_layers": 2}
    if mismatch:
        metadata["tito_session_mismatch"] = [{"type": "assistant_text", "segment_index": 1}]
    return {"session_id": sid, "records": records, "metadata": metadata}


async def run_cli(*args: str) -> tuple[int, dict[str, Any] | None, str]:
    """The real command line, in a thread (it runs its own event loop)."""
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args))
    report = None
    if "--json" in args and result.stdout.strip():
        report = json.loads(result.stdout)
    return result.exit_code, report, result.output


def write_json(path: Path, value: Any) -> Path:
    path.write_text(json.dumps(value))
    return path


def write_jsonl(path: Path, values: list[Any], extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("\n".join([json.dumps(v) for v in values] + list(extra_lines)) + "\n")
    return path


async def events_of(client, sid: str) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/sessions/{sid}/events")
    assert r.status_code == 200, r.text
    return r.json()


async def test_import_twice_adds_nothing(client, db_url, tmp_path):
    dump = linear_dump("in_place", turns=5, mismatch=True)
    path = write_json(tmp_path / "session.json", dump)

    code, first, output = await run_cli("import", str(path), "--database-url", db_url,
                                        "--json")
    assert code == 0, output
    assert first == {"sessions": 1, "sessions_new": 1, "sessions_present": 0,
                     "turns_imported": 5, "turns_present": 0, "closed": 0, "left_open": [],
                     "failures": []}

    code, again, output = await run_cli("import", str(path), "--database-url", db_url,
                                        "--json")
    assert code == 0, output
    assert again == {"sessions": 1, "sessions_new": 0, "sessions_present": 1,
                     "turns_imported": 0, "turns_present": 5, "closed": 0, "left_open": [],
                     "failures": []}

    sid = dump["session_id"]
    summary = (await client.get(f"/v1/sessions/{sid}")).json()
    assert (summary["version"], summary["pause_generation_mode"], summary["r3"]) == (
        "v1", "in_place", {"num_layers": 2})
    assert summary["num_nodes"] == 5
    turns = [e for e in await events_of(client, sid) if e["type"] == "turn_recorded"]
    assert [e["record"] for e in turns] == dump["records"]
    assert [e["event_id"] for e in turns] == [event_id(sid, i) for i in range(5)]
    assert [e["parent"] for e in turns] == [None, 0, 1, 2, 3]
    assert turns[-1]["metadata"] == {"tito_session_mismatch":
                                     dump["metadata"]["tito_session_mismatch"]}


async def test_jsonl_with_several_sessions(client, db_url, tmp_path):
    dumps = [linear_dump("retract", layers_key="r3.num_layers", seed=1),
             linear_dump("in_place", layers_key=None, seed=2),  # layers from --num-layers
             linear_dump("retract", r3=False, layers_key=None, seed=3)]
    path = write_jsonl(tmp_path / "sessions.jsonl", dumps)

    code, report, output = await run_cli("import", str(path), "--database-url", db_url,
                                         "--num-layers", "2", "--label", "run_id=imported",
                                         "--json")
    assert code == 0, output
    assert report["sessions_new"] == 3
    assert report["turns_imported"] == sum(len(d["records"]) for d in dumps)

    expected = [("retract", {"num_layers": 2}), ("in_place", {"num_layers": 2}),
                ("retract", None)]
    for dump, (mode, r3) in zip(dumps, expected, strict=True):
        summary = (await client.get(f"/v1/sessions/{dump['session_id']}")).json()
        assert summary["pause_generation_mode"] == mode
        assert summary["r3"] == r3
        assert summary["labels"] == {"run_id": "imported"}
        assert summary["num_nodes"] == len(dump["records"])


async def test_bad_records_are_reported_and_stop_their_session(client, db_url, tmp_path):
    good = linear_dump("retract", turns=4, seed=4)
    bad = linear_dump("retract", turns=4, seed=5)
    meta = bad["records"][2]["response"]["choices"][0]["meta_info"]
    meta["completion_tokens"] += 1  # 422: does not match the output
    no_layers = linear_dump("retract", layers_key=None, seed=6)  # R3 without num_layers
    path = write_jsonl(tmp_path / "mixed.jsonl", [good, bad, no_layers],
                       extra_lines=("{not json", '{"records": 3}'))

    code, report, output = await run_cli("import", str(path), "--database-url", db_url,
                                         "--json")
    assert code == 1, output
    assert report["sessions_new"] == 2
    assert report["turns_imported"] == 4 + 2  # the bad session's records before it
    failures = {(f["session_id"], f["index"]): f for f in report["failures"]}
    assert len(report["failures"]) == 4
    record = failures[(bad["session_id"], 2)]
    assert record["type"] == "urn:turnlog:invalid-request"
    assert record["status"] == 422
    assert record["field"].endswith("completion_tokens")
    assert record["source"].endswith("mixed.jsonl:2")
    session = failures[(no_layers["session_id"], None)]
    assert session["field"] == "metadata.num_layers"
    unreadable = [f for f in report["failures"] if f["session_id"] is None]
    assert [f["source"].rsplit(":", 1)[1] for f in unreadable] == ["4", "5"]

    # The records after the bad one continue it: they wait for it (appended without
    # it they would hang off an earlier turn); the bad one left no trace.
    assert record["not_imported"] == 1 and "import the dump again" in record["detail"]
    turns = [e for e in await events_of(client, bad["session_id"])
             if e["type"] == "turn_recorded"]
    assert [e["event_id"] for e in turns] == [event_id(bad["session_id"], i)
                                              for i in (0, 1)]
    assert (await client.get(f"/v1/sessions/{no_layers['session_id']}")).status_code == 404

    # The human summary names the failures too.
    code, _, output = await run_cli("import", str(path), "--database-url", db_url)
    assert code == 1
    assert "completion_tokens" in output and "failures" in output


async def test_export_round_trip(client, db_url, tmp_path):
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    dumps = [linear_dump("in_place", turns=5, seed=7, mismatch=True),
             linear_dump("retract", turns=3, seed=8),
             linear_dump("retract", turns=2, r3=False, layers_key=None, seed=9)]
    gap = linear_dump("in_place", turns=3, seed=10)
    # An addition-mode turn without R3: its sample's tensor is unreadable (r3-gap).
    gap["records"][1]["request"]["return_routed_experts"] = False
    gap["records"][1]["request"].pop("routed_experts_start_len")
    gap["records"][1]["response"]["choices"][0]["meta_info"].pop("routed_experts")
    dumps.append(gap)
    path = write_jsonl(tmp_path / "run.jsonl", dumps)
    code, _, output = await run_cli("import", str(path), "--database-url", db_url, "--close",
                                    "--label", f"run_id={run_id}", "--label", "team=infra")
    assert code == 0, output
    # Another run's session stays out of the export.
    other = write_json(tmp_path / "other.json", linear_dump(seed=11))
    assert (await run_cli("import", str(other), "--database-url", db_url, "--close",
                          "--label", "run_id=other"))[0] == 0

    out = tmp_path / "samples.npz"
    code, report, output = await run_cli("export", "--run-id", run_id, "--label", "team=infra",
                                         "--out", str(out), "--database-url", db_url, "--json")
    assert code == 0, output
    assert report["sessions"] == 4 and report["samples"] == 4
    assert (report["r3_tensors"], report["r3_errors"]) == (2, 1)

    with np.load(out, allow_pickle=False) as npz:
        manifest = json.loads(npz["manifest"].tobytes())
        sessions = json.loads(npz["sessions"].tobytes())
        assert [s["session_id"] for s in sessions] == [d["session_id"] for d in dumps]
        assert [m["session_id"] for m in manifest] == [d["session_id"] for d in dumps]
        for entry in manifest:
            sid, index = entry["session_id"], entry["index"]
            served = (await client.get(f"/v1/sessions/{sid}/samples")).json()
            sample = served["samples"][index]
            tokens = npz[f"{sid}/{index}/tokens"]
            loss_mask = npz[f"{sid}/{index}/loss_mask"]
            log_probs = npz[f"{sid}/{index}/rollout_log_probs"]
            assert (tokens.dtype, loss_mask.dtype, log_probs.dtype) == (
                np.int64, np.uint8, np.float64)
            assert tokens.tolist() == sample["tokens"]
            assert loss_mask.tolist() == sample["loss_mask"]
            assert log_probs.tolist() == sample["rollout_log_probs"]
            for key in ("leaf", "path", "status", "reward", "reward_source", "response_length",
                        "weight_versions", "spec_info", "metadata", "r3"):
                assert entry[key] == sample[key], key
            r = await client.get(f"/v1/sessions/{sid}/samples/{index}/r3")
            if entry["r3"] is None:
                assert r.status_code == 404 and entry["r3_key"] is None
            elif entry["r3_error"] is not None:
                assert r.status_code == 422
                assert entry["r3_error"]["type"] == r.json()["type"] == "urn:turnlog:r3-gap"
                assert f"{sid}/{index}/r3" not in npz.files
            else:
                assert r.status_code == 200
                tensor = npz[entry["r3_key"]]
                assert tensor.dtype == np.dtype("<i4")
                assert tensor.tobytes() == np.load(io.BytesIO(r.content)).tobytes()
        # The leaf's TITO report travels with the dump's last record.
        assert manifest[0]["metadata"] == {"tito_session_mismatch":
                                           dumps[0]["metadata"]["tito_session_mismatch"]}


def test_imported_samples_equal_an_in_memory_fold(tmp_path):
    """The import derives what an API client would send: same open, same bodies."""
    from app.transfer.dump_import import Dump, ImportOptions, open_body, turn_body

    dump_json = linear_dump("in_place", turns=6, seed=12)
    dump = Dump("x", dump_json["session_id"], dump_json["records"], dump_json["metadata"], 0)
    opened = open_body(dump, ImportOptions())
    assert opened["version"] == "v1" and opened["pause_generation_mode"] == "in_place"
    bodies = [turn_body(dump, i) for i in range(len(dump.records))]
    state, _ = fold_in_memory(opened, bodies)
    result = build_samples(state, parse_close({}))
    assert len(result.samples) == 1 and result.samples[0].path == list(range(6))
