"""The OpenAPI document says `null` where the server takes it (as the field absent).

A tester's finding (schemathesis, "schema-violating request accepted"): the open's
`session_id`, an ack's and a release's `sessions`, a gate's `specs` and a rollout
record's `step` were typed non-null, while the server takes null for each as the
contract's default. A client generated from /openapi.json would refuse to send
what the server accepts. The oracle is the server's own answer to a body with null.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.factory import open_body


def _property(document: dict[str, Any], method: str, path: str, name: str) -> dict[str, Any]:
    body = document["paths"][path][method]["requestBody"]["content"]["application/json"]
    return body["schema"]["properties"][name]


@pytest.mark.parametrize(("method", "path", "name"), [
    ("post", "/v1/sessions", "session_id"),
    ("post", "/v1/consumers/{group}/claims/{claim_id}/ack", "sessions"),
    ("post", "/v1/consumers/{group}/claims/{claim_id}/release", "sessions"),
    ("post", "/v1/gates/evaluate", "specs"),
    ("post", "/v1/metric-history/rollout", "step"),
])
async def test_a_field_the_server_takes_as_null_is_nullable_in_the_document(
        client, method, path, name):
    document = (await client.get("/openapi.json")).json()
    kind = _property(document, method, path, name)["type"]
    assert isinstance(kind, list) and "null" in kind, (path, name, kind)


async def test_the_server_takes_null_for_them(client):
    # The group matches this test's session only (by a label of its own), and acks it:
    # a group left matching the shared database's sessions unacknowledged would hold
    # them from retention in every later test.
    mark = {"suite": f"nullable-{uuid.uuid4().hex[:12]}"}
    opened = await client.post("/v1/sessions", json={**open_body(None), "session_id": None,
                                                      "labels": mark})
    assert opened.status_code == 201, opened.text
    sid = opened.json()["session_id"]
    assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200
    group = mark["suite"]
    assert (await client.put(f"/v1/consumers/{group}", json={"labels": mark})).status_code \
        in (200, 201)
    for claim, route in (("c-ack", "ack"), ("c-release", "release")):
        claimed = await client.post(f"/v1/consumers/{group}/claims",
                                    json={"claim_id": claim, "limit": 1})
        assert claimed.status_code == 201, claimed.text
        done = await client.post(f"/v1/consumers/{group}/claims/{claim}/{route}",
                                 json={"sessions": None})
        assert done.status_code == 200, done.text
    acks = await client.get(f"/v1/consumers/{group}/acks")
    assert [row["session_id"] for row in acks.json()["acks"]] == [sid], acks.text
