"""Schemathesis over the app's own OpenAPI document: every operation, on both backends.

Each operation gets bounded positive and negative examples (schema-valid and
schema-violating requests). Every answer must be below 500, and every 4xx/5xx
must be problem+json with `type`, `title`, `status` and `detail` (DESIGN:
nothing ever answers 500 for bad input); and every answer is one the document
declares, of the declared type and schema (`app.api.openapi_problems`: a client
generated from /openapi.json sees the answers the server gives). Requests go through the test's own
httpx client over ASGI, so the app runs on the test's event loop and
database; path `session_id`s are often swapped for sessions that exist, so
the bodies reach the domain validators instead of stopping at a 404.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from app.main import create_app
from app.settings import Settings
from tests.factory import open_body, r3_b64, turn
from tests.fuzz.budget import DERANDOMIZE, examples

# Hundreds of appends per backend: run on SQLite and PostgreSQL, not repeated on Citus.
pytestmark = pytest.mark.not_citus

MAX_EXAMPLES = examples(25)
PROBLEM_KEYS = ("type", "title", "status", "detail")

SCHEMA = schemathesis.openapi.from_dict(create_app(Settings.load(
    database_url="sqlite+aiosqlite:///:memory:", migrate_on_start=False, api_tokens="")
).openapi())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
STRATEGIES = {op.label: st.one_of(op.as_strategy(GenerationMode.POSITIVE),
                                  op.as_strategy(GenerationMode.NEGATIVE))
              for op in OPERATIONS}


def problem_json(_ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """Every 4xx/5xx answer is RFC 9457 problem+json with the four members."""
    if response.status_code < 400:
        return
    content_type = (response.headers.get("content-type") or [""])[0]
    assert content_type == "application/problem+json", (
        f"{case.operation.label} answered {response.status_code} as {content_type!r}")
    body = json.loads(response.content)
    missing = [key for key in PROBLEM_KEYS if key not in body]
    assert not missing, f"problem body lacks {missing}: {body}"
    assert body["status"] == response.status_code
    assert isinstance(body["type"], str) and body["type"].startswith("urn:turnlog:")


@pytest.fixture
async def existing(client) -> list[str]:
    """Sessions in every state a path may name: open, addition-R3 with a turn, closed."""
    base = f"fz-{uuid.uuid4().hex[:12]}"
    plain, addition, closed = f"{base}-open", f"{base}-r3", f"{base}-closed"
    await client.post("/v1/sessions", json=open_body(plain, labels={"run_id": "fuzz"}))
    await client.post("/v1/sessions", json=open_body(
        addition, pause_generation_mode="in_place", r3={"num_layers": 2}))
    await client.post(f"/v1/sessions/{addition}/turns",
                      json=turn([1, 2, 3], [4, 5], r3=r3_b64(4, 2, 2), start=0))
    await client.post("/v1/sessions", json=open_body(closed, spec=True))
    await client.post(f"/v1/sessions/{closed}/turns", json=turn([1, 2], [3], spec=(2, 1, 3)))
    await client.post(f"/v1/sessions/{closed}/close", json={"metadata": {"reward": 1.0}})
    return [plain, addition, closed]


def prepared(case: schemathesis.Case, data: st.DataObject, existing: list[str]
             ) -> requests.PreparedRequest:
    if "session_id" in (case.path_parameters or {}) and data.draw(st.booleans()):
        case.path_parameters["session_id"] = data.draw(st.sampled_from(existing))
    wait = (case.query or {}).get("wait")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and wait > 0.05:
        case.query["wait"] = 0.05  # a long poll only costs time here
    kwargs = case.as_transport_kwargs(base_url="http://turnlog")
    try:
        return requests.Request(**kwargs).prepare()
    except (requests.exceptions.InvalidJSONError, UnicodeError):
        assume(False)  # not expressible as an HTTP request: nothing to send
        raise


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=DERANDOMIZE,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
async def test_operation_never_answers_500_and_errors_are_problems(
        client, existing, operation, data):
    case = data.draw(STRATEGIES[operation.label])
    request = prepared(case, data, existing)
    response = await client.request(request.method or "GET", request.url or "/",
                                    headers=dict(request.headers), content=request.body)
    case.validate_response(response, checks=[
        not_a_server_error, problem_json, status_code_conformance, content_type_conformance,
        response_schema_conformance])
