"""Exporting closed sessions' samples as one `.npz` (numpy's zip of `.npy` files).

Owns the file layout trainers load with `np.load(path)` (no pickle):

- `{session_id}/{index}/tokens`             int64   `[len(tokens)]`
- `{session_id}/{index}/loss_mask`          uint8   `[response_length]`
- `{session_id}/{index}/rollout_log_probs`  float64 `[response_length]`
- `{session_id}/{index}/r3`                 int32   `[len(tokens) - 1, num_layers, topk]`,
  only when the sample has a readable R3 tensor
- `manifest`  uint8: JSON text (ASCII) of an array, one object per sample (see `sample_entry`)
- `sessions`  uint8: JSON text of an array, one object per exported session
  (`empty_reason`, assembly `errors`, the spec-decoding `session_metrics` carrier)

Refuses to own what a sample is: arrays come from the same samples projection
the API serves, and R3 tensors are the exact bytes `GET …/samples/{i}/r3`
streams. Entries are written one at a time into a temporary file that
replaces `out` only when complete; an R3 tensor goes in block by block.
"""

from __future__ import annotations

import contextlib
import json
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from app.domain.body.labels import parse_label_filters
from app.domain.body.queries import SESSIONS_PAGE
from app.domain.errors import DomainError
from app.domain.projection.samples import Sample, SamplesResult
from app.services import Services

Progress = Callable[[int, int], None]


@dataclass
class ExportReport:
    out: Path
    sessions: int = 0
    samples: int = 0
    r3_tensors: int = 0
    r3_errors: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "sessions": self.sessions, "samples": self.samples,
                "r3_tensors": self.r3_tensors, "r3_errors": self.r3_errors,
                "bytes": self.bytes}


def _json_bytes(value: Any) -> np.ndarray:
    # ASCII-escaped, so any stored string (even a lone surrogate) round-trips.
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8)


class NpzWriter:
    """`np.savez`'s format, one entry at a time (zip64, so any size works)."""

    def __init__(self, path: Path, compress: bool) -> None:
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress
                                   else zipfile.ZIP_STORED, allowZip64=True)

    def array(self, key: str, value: np.ndarray) -> None:
        with self.zip.open(f"{key}.npy", "w", force_zip64=True) as entry:
            np.lib.format.write_array(entry, np.ascontiguousarray(value), allow_pickle=False)

    def entry(self, key: str) -> IO[bytes]:
        """A writable entry for bytes already in `.npy` format."""
        return self.zip.open(f"{key}.npy", "w", force_zip64=True)

    def close(self) -> None:
        self.zip.close()


async def _write_r3(svc: Services, npz: NpzWriter, key: str, session_id: str,
                    sample: Sample) -> None:
    """The bytes `GET …/r3` streams. Every patch is read and checked first, so a
    broken log raises before the entry exists."""
    plan = sample.read_plan()
    patches = await svc.samples.read_patches(session_id, plan)
    with npz.entry(key) as entry:
        async for chunk in svc.samples.stream(plan, patches):
            entry.write(chunk)


def sample_entry(summary: dict[str, Any], sample: Sample, prefix: str) -> dict[str, Any]:
    """A manifest object: where the sample's arrays are and what they mean."""
    return {
        "session_id": summary["session_id"],
        "index": sample.index,
        "leaf": sample.leaf,
        "path": sample.path,
        "version": summary["version"],
        "labels": summary["labels"],
        "status": sample.status,
        "reward": sample.reward,
        "reward_source": sample.reward_source,
        "response_length": sample.response_length,
        "num_tokens": len(sample.tokens),
        "weight_versions": sample.weight_versions,
        "spec_info": sample.spec_info,
        "metadata": sample.metadata,
        "keys": {name: f"{prefix}/{name}"
                 for name in ("tokens", "loss_mask", "rollout_log_probs")},
        "r3": sample.r3,
        "r3_key": None,
        "r3_error": None,
    }


async def _session(svc: Services, npz: NpzWriter, summary: dict[str, Any],
                   result: SamplesResult, manifest: list[dict[str, Any]],
                   report: ExportReport) -> None:
    sid = summary["session_id"]
    for sample in result.samples:
        prefix = f"{sid}/{sample.index}"
        npz.array(f"{prefix}/tokens", np.asarray(sample.tokens, dtype=np.int64))
        npz.array(f"{prefix}/loss_mask", np.asarray(sample.loss_mask, dtype=np.uint8))
        npz.array(f"{prefix}/rollout_log_probs",
                  np.asarray(sample.rollout_log_probs, dtype=np.float64))
        entry = sample_entry(summary, sample, prefix)
        if sample.r3 is not None:
            try:
                await _write_r3(svc, npz, f"{prefix}/r3", sid, sample)
            except DomainError as exc:
                entry["r3_error"] = exc.problem()
                report.r3_errors += 1
            else:
                entry["r3_key"] = f"{prefix}/r3"
                report.r3_tensors += 1
        manifest.append(entry)
        report.samples += 1


async def closed_sessions(svc: Services, filters: dict[str, str]) -> list[dict[str, Any]]:
    """Summaries of every closed session matching the label filters, in open order."""
    out: list[dict[str, Any]] = []
    after: str | None = None
    labels = parse_label_filters(filters)
    limit = SESSIONS_PAGE.maximum
    while True:
        page = await svc.reader.list_sessions("closed", after, limit, labels)
        out.extend(page["sessions"])
        if len(page["sessions"]) < limit:
            return out
        after = page["next"]


def partial_path(out: Path) -> Path:
    """The file an export writes before it becomes `out`: beside it (one rename, on one
    file system), named for this process, so two exports to one `--out` never write
    into the same file (the second would replace the first's half-written one)."""
    return out.with_name(f"{out.name}.{os.getpid()}.partial")


def finish(partial: Path, out: Path) -> int:
    """Move the finished `partial` onto `out`; its size (read before the move, so an
    export racing to the same name cannot change what this one reports)."""
    size = partial.stat().st_size
    try:
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return size


def abandon(close: Callable[[], object], partial: Path) -> None:
    """An export that failed: its writer closed (a full disk fails that too, and must
    not keep the half-written file from being removed) and its file removed."""
    with contextlib.suppress(Exception):
        close()
    partial.unlink(missing_ok=True)


async def export_samples(svc: Services, filters: dict[str, str], out: Path, *,
                         compress: bool = False, progress: Progress | None = None
                         ) -> ExportReport:
    """Write every matching closed session's samples to `out` (replaced atomically)."""
    summaries = await closed_sessions(svc, filters)
    report = ExportReport(out=out, sessions=len(summaries))
    partial = partial_path(out)
    npz = NpzWriter(partial, compress)
    manifest: list[dict[str, Any]] = []
    sessions: list[dict[str, Any]] = []
    try:
        for done, summary in enumerate(summaries):
            result = await svc.samples.result(summary["session_id"])
            await _session(svc, npz, summary, result, manifest, report)
            sessions.append({"session_id": summary["session_id"],
                             "version": summary["version"], "labels": summary["labels"],
                             "num_samples": len(result.samples),
                             "empty_reason": result.empty_reason, "errors": result.errors,
                             "session_metrics": result.session_metrics})
            if progress is not None:
                progress(done + 1, len(summaries))
        npz.array("manifest", _json_bytes(manifest))
        npz.array("sessions", _json_bytes(sessions))
        npz.close()
    except BaseException:
        abandon(npz.close, partial)
        raise
    report.bytes = finish(partial, out)
    return report
