"""Exporting closed sessions' samples as one Parquet dataset (pyarrow), one row per sample.

Owns the table layout that pyarrow, polars and Hugging Face `datasets` load
as-is (`SCHEMA`), in native Arrow types and with the fields of the samples
wire's `_samples_meta` (docs/trainers.md): identifiers, `labels`
(map<string, string>, each value in its text form as label filters see it),
`response` (string), `tokens` (list<int64>), `loss_mask` (list<uint8>),
`rollout_log_probs` (list<float64>), `status`, `weight_versions`
(list<string>, text form, null for a turn that sent null), `prefix_cache_info`
(struct), `reward` (float64; the exact JSON value in `reward_json`),
`reward_source` (string, null when the sample names none), the SpecInfo
struct, `metadata` (JSON text: free JSON has no fixed Arrow type), and R3 in
its own column: `r3` holds the int32 tensor's raw
little-endian C-order bytes and `r3_shape` its `[rows, num_layers, topk]`
(`np.frombuffer(row["r3"], "<i4").reshape(row["r3_shape"])`); an unreadable
tensor leaves `r3` null and says why in `r3_error`.

Rows are written in row groups of bounded size as sessions are read, so the
export never holds more than one row group; the file replaces `out` only
when complete. Refuses to own what a sample is: everything comes from the
samples projection the API serves, R3 bytes from the same stream as `…/r3`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from app.domain.body.labels import label_text
from app.domain.errors import DomainError
from app.domain.projection.overview import reward_number
from app.domain.projection.rows import weight_version_text
from app.domain.projection.samples import Sample
from app.services import Services
from app.transfer.npz import abandon, closed_sessions, finish, partial_path

Progress = Callable[[int, int, int], None]  # sessions done, sessions total, samples written
ROW_GROUP_ROWS = 1024
ROW_GROUP_BYTES = 128 << 20

SPEC_INFO = pa.struct([(name, pa.int64()) for name in (
    "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct",
    "completion_tokens")])
PREFIX_CACHE_INFO = pa.struct([("cached_tokens", pa.int64()),
                               ("total_prompt_tokens", pa.int64())])
SCHEMA = pa.schema([
    ("session_id", pa.string()),
    ("index", pa.int32()),
    ("leaf", pa.int32()),
    ("path", pa.list_(pa.int32())),
    ("version", pa.string()),
    ("labels", pa.map_(pa.string(), pa.string())),
    ("status", pa.string()),
    ("reward", pa.float64()),
    ("reward_json", pa.string()),
    ("reward_source", pa.string()),
    ("response", pa.string()),
    ("response_length", pa.int32()),
    ("tokens", pa.list_(pa.int64())),
    ("loss_mask", pa.list_(pa.uint8())),
    ("rollout_log_probs", pa.list_(pa.float64())),
    ("weight_versions", pa.list_(pa.string())),
    ("prefix_cache_info", PREFIX_CACHE_INFO),
    ("spec_info", SPEC_INFO),
    ("metadata", pa.string()),  # JSON text
    ("r3_shape", pa.list_(pa.int32())),
    ("r3", pa.large_binary()),
    ("r3_error", pa.string()),  # problem+json text when the tensor is unreadable
])


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


@dataclass
class ParquetReport:
    out: Path
    sessions: int = 0
    samples: int = 0
    r3_tensors: int = 0
    r3_errors: int = 0
    row_groups: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "format": "parquet", "sessions": self.sessions,
                "samples": self.samples, "r3_tensors": self.r3_tensors,
                "r3_errors": self.r3_errors, "row_groups": self.row_groups,
                "bytes": self.bytes}


@dataclass
class _RowGroup:
    rows: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0


async def _r3_bytes(svc: Services, session_id: str, sample: Sample) -> bytes:
    plan = sample.read_plan()
    patches = await svc.samples.read_patches(session_id, plan)
    return b"".join([bytes(chunk) async for chunk in svc.samples.stream(plan, patches)][1:])


async def _row(svc: Services, summary: dict[str, Any], sample: Sample,
               report: ParquetReport) -> dict[str, Any]:
    sid = summary["session_id"]
    row: dict[str, Any] = {
        "session_id": sid, "index": sample.index, "leaf": sample.leaf, "path": sample.path,
        "version": summary["version"],
        "labels": [(key, label_text(value)) for key, value in summary["labels"].items()],
        "status": sample.status, "reward": reward_number(sample.reward),
        "reward_json": _json(sample.reward), "reward_source": sample.reward_source,
        "response": sample.response, "response_length": sample.response_length,
        "tokens": sample.tokens, "loss_mask": sample.loss_mask,
        "rollout_log_probs": sample.rollout_log_probs,
        "weight_versions": [weight_version_text(v) for v in sample.weight_versions],
        "prefix_cache_info": sample.prefix_cache_info, "spec_info": sample.spec_info,
        "metadata": _json(sample.metadata),
        "r3_shape": None if sample.r3 is None else sample.r3["shape"],
        "r3": None, "r3_error": None,
    }
    if sample.r3 is not None:
        try:
            row["r3"] = await _r3_bytes(svc, sid, sample)
        except DomainError as exc:
            row["r3_error"] = _json(exc.problem())
            report.r3_errors += 1
        else:
            report.r3_tensors += 1
    return row


def _flush(writer: pq.ParquetWriter, group: _RowGroup, report: ParquetReport) -> None:
    if not group.rows:
        return
    writer.write_table(pa.Table.from_pylist(group.rows, schema=SCHEMA),
                       row_group_size=len(group.rows))
    report.row_groups += 1
    group.rows.clear()
    group.nbytes = 0


async def export_parquet(svc: Services, filters: dict[str, str], out: Path, *,
                         progress: Progress | None = None, row_group_rows: int = ROW_GROUP_ROWS,
                         row_group_bytes: int = ROW_GROUP_BYTES) -> ParquetReport:
    """Write every matching closed session's samples to `out` (replaced atomically)."""
    summaries = await closed_sessions(svc, filters)
    report = ParquetReport(out=out, sessions=len(summaries))
    partial = partial_path(out)
    writer = pq.ParquetWriter(partial, SCHEMA, compression="zstd")
    group = _RowGroup()
    try:
        for done, summary in enumerate(summaries):
            result = await svc.samples.result(summary["session_id"])
            for sample in result.samples:
                row = await _row(svc, summary, sample, report)
                group.rows.append(row)
                group.nbytes += len(row["r3"] or b"") + 13 * len(sample.tokens)
                report.samples += 1
                if len(group.rows) >= row_group_rows or group.nbytes >= row_group_bytes:
                    _flush(writer, group, report)
            if progress is not None:
                progress(done + 1, len(summaries), report.samples)
        _flush(writer, group, report)
        writer.close()
    except BaseException:
        abandon(writer.close, partial)
        raise
    report.bytes = finish(partial, out)
    return report
