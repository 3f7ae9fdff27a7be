"""The OpenAPI document's error answers: what `problems` sends, said once for every route.

FastAPI documents a 422 of its own validation shape (`HTTPValidationError`,
`application/json`), which this server never sends: every error is an RFC 9457
problem (`application/problem+json`, `app.api.problems`). This module rewrites
the generated document so that a client generated from it, or a checker such as
schemathesis, sees the answers the server gives:
- each operation's error statuses with the problem schema: the ones every route
  of its kind can answer (a body: 408, 413, 415, 422; a session in the path:
  404), those the interface names for it (`EXTRA`), and `default` for the
  service-wide ones (401, 403, 421, 431, 503: docs/api.md §0.3);
- a `201` write also answers `200` for an identical repeat (the same body).

Owns no rule: the statuses are the ones docs/api.md gives each route.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI

from app.api.problems import PROBLEM

PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "Problem",
    "description": "An RFC 9457 problem (docs/api.md §0.3).",
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "description": "urn:turnlog:<slug>"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "field": {"type": "string", "description": "the offending input"},
        "expected": {"description": "what would have been accepted"},
        "actual": {"description": "what was sent"},
    },
    "additionalProperties": True,
}
_REF = {"$ref": "#/components/schemas/Problem"}
_BODY_ERRORS = {
    "408": "the body stopped arriving, or arrived below the minimum pace",
    "413": "the body is larger than the server takes",
    "415": "a content type this route does not read",
    "422": "a body or parameter is missing, ill-typed or out of range",
}
_QUERY_ERRORS = {"422": "a parameter is missing, ill-typed or out of range"}
_SESSION_ERRORS = {"404": "no session with this id"}
# What docs/api.md gives a route beyond its kind's statuses.
EXTRA: dict[tuple[str, str], dict[str, str]] = {
    ("post", "/v1/sessions"): {"409": "the id exists with another definition"},
    ("post", "/v1/sessions/{session_id}/turns"): {
        "404": "no such session, or no such parent",
        "409": "the session is closed, the event id was used with other content, or "
               "the turn breaks a rule of the session's tree (an R3 gap, a truncated "
               "parent, an unstable prefix, the node cap)",
        "503": "a write whose X-Turnlog-Timeout ran out (rolled back)"},
    ("post", "/v1/sessions/{session_id}/close"): {
        "409": "closed already with another body"},
    ("post", "/v1/sessions/{session_id}/rewards"): {
        "404": "no such session or sample, or no leaf with this response_id",
        "409": "the session is open, or the event id was used with another body"},
    ("get", "/v1/sessions/{session_id}/state"): {"404": "no such session or leaf"},
    ("get", "/v1/sessions/{session_id}/samples"): {"409": "the session is still open"},
    ("get", "/v1/sessions/{session_id}/samples/{index}/r3"): {
        "404": "no such session, or no such sample (or it has no R3)",
        "409": "the session is still open",
        "410": "the session's R3 was freed by retention",
        "422": "the stored path cannot yield the tensor (an R3 gap), or a bad parameter"},
    ("get", "/v1/metrics/rollout"): {"409": "strict=true found a non-zero strict rate"},
    ("put", "/v1/consumers/{group}"): {"409": "the group exists with another definition"},
    ("get", "/v1/consumers/{group}"): {"404": "no such group"},
    ("post", "/v1/consumers/{group}/claims"): {"404": "no such group"},
    ("post", "/v1/consumers/{group}/claims/{claim_id}/ack"): {
        "404": "no such group or claim", "409": "lease-lost: a session's lease was lost"},
    ("post", "/v1/consumers/{group}/claims/{claim_id}/release"): {
        "404": "no such group or claim", "409": "lease-lost: a session's lease was lost"},
    ("get", "/v1/consumers/{group}/acks"): {"404": "no such group"},
    ("post", "/v1/metric-history"): {"409": "the run's entry exists with other values"},
    ("post", "/v1/metric-history/rollout"): {
        "409": "the run's entry exists with other values"},
}
_DEFAULT = ("a problem any route may answer: 401 no or an unknown token, 403 a read "
            "token on a write, 421 a host the server does not serve, 431 headers too "
            "large, 503 the database unavailable or the server overloaded")


def _problem(description: str) -> dict[str, Any]:
    return {"description": description, "content": {PROBLEM: {"schema": _REF}}}


def describe_problems(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (a generated OpenAPI document) with the error answers as sent."""
    schema = copy.deepcopy(schema)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            errors: dict[str, str] = {}
            if method in ("post", "put", "patch"):
                errors |= _BODY_ERRORS
            elif operation.get("parameters"):
                errors |= _QUERY_ERRORS
            if "{session_id}" in path:
                errors |= _SESSION_ERRORS
            errors |= EXTRA.get((method, path), {})
            for status, description in errors.items():
                responses[status] = _problem(description)
            if "201" in responses and "200" not in responses:
                responses["200"] = {**responses["201"],
                                    "description": "an identical repeat: nothing new stored"}
            responses["default"] = _problem(_DEFAULT)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    components["Problem"] = PROBLEM_SCHEMA
    return schema


def install(app: FastAPI) -> None:
    """Serve `describe_problems` of the generated document at /openapi.json (built once)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe_problems(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
