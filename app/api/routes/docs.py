"""OpenAPI request-body schemas for the routes that parse their JSON in the domain.

The domain (`app/domain/body/session.py`, `turn.py`) is the validator; these
schemas only document the shapes for `/openapi.json` and `/docs`.
"""

from __future__ import annotations

from typing import Any


def _body(schema: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": schema, "example": example}}}}


_ID = {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}

OPEN_BODY = _body({
    "type": "object",
    "required": ["version"],
    "additionalProperties": False,
    "properties": {
        "session_id": {**_ID, "type": ["string", "null"]},  # null or absent: one is made
        "version": {"enum": ["v1", "v2", True]},
        "pause_generation_mode": {"enum": ["retract", "in_place"]},
        "r3": {"type": ["object", "null"], "required": ["num_layers"],
               "additionalProperties": False,
               "properties": {"num_layers": {"type": "integer", "minimum": 1,
                                             "maximum": 4096}}},
        "spec": {"type": "boolean"},
        "max_trim_tokens": {"type": "integer", "minimum": 0},
        "labels": {"type": "object"},
        "opened_by": {"type": ["string", "null"], "pattern": "^[A-Za-z0-9._:-]{1,64}$"},
    },
}, {"session_id": "run7-r12-s0031", "version": "v2", "pause_generation_mode": "in_place",
    "r3": {"num_layers": 48}, "spec": True, "max_trim_tokens": 1,
    "labels": {"run_id": "run7", "rollout_id": 12}})

TURN_BODY = _body({
    "type": "object",
    "required": ["event_id", "record"],
    "additionalProperties": False,
    "properties": {
        "event_id": {"type": "string", "minLength": 1, "maxLength": 128},
        "parent": {"type": ["integer", "null"], "minimum": 0},
        "record": {
            "type": "object",
            "required": ["request", "response"],
            "properties": {
                "timestamp": {"type": "number"},
                "request": {"type": "object", "required": ["input_ids"], "properties": {
                    "input_ids": {"type": "array", "minItems": 1,
                                  "items": {"type": "integer", "minimum": 0}},
                    "return_routed_experts": {"type": "boolean"},
                    "routed_experts_start_len": {"type": "integer", "minimum": 0},
                }},
                "response": {"type": "object", "required": ["choices"], "properties": {
                    "choices": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "required": ["meta_info"], "properties": {
                            "finish_reason": {"type": ["string", "null"]},
                            "meta_info": {"type": "object",
                                          "required": ["output_token_logprobs"]},
                        }}},
                }},
            },
        },
        "metadata": {"type": ["object", "null"]},
    },
}, {"event_id": "4f0c9a", "record": {
    "request": {"input_ids": [1, 2, 3]},
    "response": {"choices": [{"finish_reason": "stop", "meta_info": {
        "output_token_logprobs": [[-0.1, 7]], "completion_tokens": 1}}]}}})

CLOSE_BODY = _body({
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "max_seq_len": {"type": ["integer", "null"], "minimum": 1},
        "metadata": {"type": ["object", "null"]},
    },
}, {"max_seq_len": 32768, "metadata": {"reward": 1.0}})

REWARD_BODY = _body({
    "type": "object",
    "additionalProperties": False,
    "required": ["event_id", "reward"],
    "properties": {
        "event_id": {"type": "string", "minLength": 1, "maxLength": 128},
        "reward": {"type": "number"},
        "sample": {"type": ["integer", "null"], "minimum": 0},
        "response_id": {"type": ["string", "null"]},
        "source": {"type": ["string", "null"], "maxLength": 128},
    },
}, {"event_id": "rm-7f3a", "reward": 0.75, "sample": None, "response_id": None,
    "source": "rm:qwen3-rm-v2"})
