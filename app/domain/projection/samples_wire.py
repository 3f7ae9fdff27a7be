"""The miles samples wire: a closed session's samples as one safetensors file.

Owns the layout a miles rollout driver decodes: the tensor names
(`tokens.<i>`, `loss_mask.<i>`, `rollout_log_probs.<i>`,
`rollout_routed_experts.<i>`, `_samples_meta`), their pinned dtypes, the
`_samples_meta` JSON, and the safetensors framing (8-byte little-endian
header length, compact JSON header padded with spaces to 8 bytes, raw
little-endian data). The tensors are placed exactly as
`safetensors.numpy.save` places them (dtype alignment descending, then name),
so the bytes equal that library's own file for the same dict.

Everything but R3 is small and laid out here as bytes; an R3 tensor is only
described (its plan), so the store can stream it one widened block at a time
after this header. Refuses to own reading patches or streaming (the store)
and which samples exist (`app/domain/projection/samples.py`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.domain.projection.assembly import R3Plan, plan_shape
from app.domain.projection.samples import Sample, SamplesResult
from app.domain.wire import jsonio

MEDIA_TYPE = "application/x-safetensors"
META_TENSOR = "_samples_meta"
R3_FIELD = "rollout_routed_experts"
INDEXER_FIELD = "rollout_indexer_topk"
# safetensors writes tensors by descending dtype (its enum order), then name.
DTYPE_RANK = {"I64": 3, "F64": 2, "I32": 1, "U8": 0}
NUMPY_DTYPE: dict[str, np.dtype[Any]] = {
    "I64": np.dtype("<i8"), "F64": np.dtype("<f8"), "I32": np.dtype("<i4"), "U8": np.dtype("u1")}


@dataclass(frozen=True)
class WireTensor:
    """One tensor of the file: inline `data`, or the R3 plan of sample `r3_index`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | None = None
    r3_index: int | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * NUMPY_DTYPE[self.dtype].itemsize


@dataclass(frozen=True)
class WireLayout:
    header: bytes  # the 8-byte length and the padded JSON header
    tensors: tuple[WireTensor, ...]  # in file order
    plans: dict[int, R3Plan] = field(default_factory=dict)

    @property
    def content_length(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def _array(name: str, dtype: str, values: Any) -> WireTensor:
    array = np.ascontiguousarray(np.asarray(values, dtype=NUMPY_DTYPE[dtype]))
    return WireTensor(name, dtype, tuple(array.shape), data=array.tobytes())


def sample_meta(result: SamplesResult, sample: Sample) -> dict[str, Any]:
    """One sample's JSON entry of `_samples_meta`."""
    nulls = [INDEXER_FIELD] if sample.r3_plan is not None else [R3_FIELD, INDEXER_FIELD]
    return {
        "response": sample.response,
        "response_length": sample.response_length,
        "status": sample.status,
        "weight_versions": sample.weight_versions,
        "prefix_cache_info": sample.prefix_cache_info,
        "metadata": {**sample.metadata, "turnlog": {
            "session_id": result.session_id, "index": sample.index, "leaf": sample.leaf,
            "path": sample.path}},
        "reward": sample.reward,
        "reward_source": sample.reward_source,
        "spec_info": sample.spec_info,
        "nulls": nulls,
    }


def samples_meta(result: SamplesResult) -> dict[str, Any]:
    return {
        "samples": [sample_meta(result, sample) for sample in result.samples],
        "session_metadata": {
            "session_id": result.session_id,
            "version": result.version,
            "labels": result.labels,
            "session_metrics": result.session_metrics,
            "errors": result.errors,
        },
        "empty_reason": result.empty_reason,
    }


def header(tensors: list[WireTensor]) -> bytes:
    """The safetensors header for tensors already in file order."""
    entries: dict[str, Any] = {}
    offset = 0
    for tensor in tensors:
        end = offset + tensor.nbytes
        entries[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                                "data_offsets": [offset, end]}
        offset = end
    text = jsonio.dumps(entries).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def wire_layout(result: SamplesResult) -> WireLayout:
    """The file for `result`'s samples; raises the first sample's `R3Gap` (422) if the
    log cannot yield some sample's R3, so a trainer never gets a sample without it."""
    tensors: list[WireTensor] = []
    plans: dict[int, R3Plan] = {}
    for sample in result.samples:
        if sample.r3_error is not None:
            raise sample.r3_error
        i = sample.index
        tensors.append(_array(f"tokens.{i}", "I64", sample.tokens))
        tensors.append(_array(f"loss_mask.{i}", "U8", sample.loss_mask))
        tensors.append(_array(f"rollout_log_probs.{i}", "F64", sample.rollout_log_probs))
        if sample.r3_plan is not None:
            plans[i] = sample.r3_plan
            tensors.append(WireTensor(f"{R3_FIELD}.{i}", "I32", plan_shape(sample.r3_plan),
                                      r3_index=i))
    tensors.append(_array(META_TENSOR, "U8",
                          np.frombuffer(jsonio.dumps_bytes(samples_meta(result)), np.uint8)))
    tensors.sort(key=lambda t: (-DTYPE_RANK[t.dtype], t.name.encode("utf-8")))
    return WireLayout(header(tensors), tuple(tensors), plans)
