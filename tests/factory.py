"""Small builders for open bodies and turn records in the session server's wire shape."""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np


def r3_b64(rows: int, num_layers: int, topk: int, seed: int = 0, high: int = 128) -> str:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, high, size=(rows, num_layers, topk), dtype=np.int32)
    return base64.b64encode(values.astype("<i4").tobytes()).decode("ascii")


def open_body(sid: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"session_id": sid, "version": "v2"}
    body.update(over)
    return body


def turn(
    prompt: list[int],
    output: list[int],
    *,
    event_id: str | None = None,
    finish_reason: str | None = "stop",
    r3: str | None = None,
    start: int | None = None,
    return_r3: bool | None = None,
    spec: tuple[int, int, int] | None = None,
    weight_version: Any = "1",
    parent: Any = ...,
    metadata: dict[str, Any] | None = None,
    timestamp: float = 1755800000.0,
) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "default", "input_ids": list(prompt)}
    if return_r3 or (return_r3 is None and r3 is not None):
        request["return_routed_experts"] = True
    if start is not None:
        request["routed_experts_start_len"] = start
    meta: dict[str, Any] = {
        "output_token_logprobs": [[-0.5 - i / 100, tok] for i, tok in enumerate(output)],
        "completion_tokens": len(output),
        "weight_version": weight_version,
    }
    if r3 is not None:
        meta["routed_experts"] = r3
    if spec is not None:
        meta["spec_verify_ct"], meta["spec_num_correct_drafts"], \
            meta["spec_num_proposed_drafts"] = spec
    body: dict[str, Any] = {
        "event_id": event_id or uuid.uuid4().hex,
        "record": {
            "timestamp": timestamp,
            "request_timestamp": timestamp - 0.5,
            "method": "POST",
            "path": "/v1/chat/completions",
            "status_code": 200,
            "request": request,
            "response": {"choices": [{"index": 0, "finish_reason": finish_reason,
                                      "message": {"role": "assistant", "content": "x"},
                                      "meta_info": meta}]},
        },
    }
    if parent is not ...:
        body["parent"] = parent
    if metadata is not None:
        body["metadata"] = metadata
    return body
