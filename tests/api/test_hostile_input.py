"""Text the databases cannot hold, and numbers they cannot bind, answer 4xx — never 500."""

import base64
import json

import pytest

from tests.factory import open_body, turn


async def test_nul_and_lone_surrogate_labels_are_422(client, sid):
    raw = json.dumps({"session_id": sid, "version": "v2", "labels": {"a": "x\x00y"}})
    r = await client.post("/v1/sessions", content=raw.encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "labels.a"
    raw = json.dumps({"session_id": sid, "version": "v2", "labels": {"a": "\ud800"}})
    r = await client.post("/v1/sessions", content=raw.encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404


async def test_nested_label_values_with_nul_are_stored_escaped(client, sid):
    raw = json.dumps({"session_id": sid, "version": "v2", "labels": {"a": ["x\x00y"]}})
    r = await client.post("/v1/sessions", content=raw.encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 201
    assert r.json()["labels"] == {"a": ["x\x00y"]}


async def test_record_strings_keep_nul_and_surrogates(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    body = turn([1, 2], [3])
    text = json.dumps(body).replace('"content": "x"', '"content": "a\\u0000b\\ud800"')
    r = await client.post(f"/v1/sessions/{sid}/turns", content=text.encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert evs[1]["record"] == json.loads(text)["record"]


async def test_a_lone_surrogate_where_a_number_belongs_is_422(client, sid):
    """msgspec's typed checks raise UnicodeEncodeError (not their validation error) while
    wording a refusal that quotes such a string: it was a 500."""
    await client.post("/v1/sessions", json=open_body(sid))
    body = turn(list(range(1, 300)), [3, 4])
    body["record"]["request"]["input_ids"][5] = "@"
    logprobs = body["record"]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
    logprobs[1] = [logprobs[1][0], "@"]
    base = json.dumps(body)
    for where, text in (("record.request.input_ids[5]", base.replace('"@"', '"\\ud800"', 1)),
                        ("output_token_logprobs", base.replace(
                            '"@"', "5", 1).replace('"@"', '"\\udc00"', 1))):
        r = await client.post(f"/v1/sessions/{sid}/turns", content=text.encode(),
                              headers={"content-type": "application/json"})
        assert r.status_code == 422, (where, r.status_code, r.text)
        assert where in r.json()["field"], r.json()
    # Long lists of rows with one odd string (the JSON walk's typed shortcuts) are judged.
    rows = json.dumps({"session_id": sid + "x", "version": "v2",
                       "labels": {"a": [[1.5]] * 300 + [["\ud800"]]}})
    r = await client.post("/v1/sessions", content=rows.encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert [e["type"] for e in evs] == ["session_opened"]


async def test_pages_show_a_lone_surrogate_in_stored_text_as_its_escape(client, sid):
    """A close's metadata is free JSON: a lone surrogate there is stored (the API reads it
    back escaped), and the UI page that shows it answers 200 (encoding it was a 500)."""
    await client.post("/v1/sessions", json=open_body(sid))
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [3]))
            ).status_code == 201
    r = await client.post(f"/v1/sessions/{sid}/close",
                          content=b'{"metadata": {"reward": "\\ud800"}}',
                          headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    page = await client.get(f"/ui/sessions/{sid}")
    assert page.status_code == 200 and "\\ud800" in page.text


async def test_weight_version_and_finish_reason_with_nul_are_422(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2], weight_version="7\x00"))
    assert r.status_code == 422
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2], finish_reason="s\x00"))
    assert r.status_code == 422


async def test_filters_and_cursors_out_of_range_are_422(client):
    assert (await client.get("/v1/sessions", params={"run_id": "a\x00b"})).status_code == 422
    assert (await client.get("/v1/sessions", params={"run_id": "x" * 5000})).status_code == 422
    big = base64.urlsafe_b64encode(b"v1:99999999999999999999").decode().rstrip("=")
    assert (await client.get("/v1/sessions", params={"after": big})).status_code == 422
    big2 = base64.urlsafe_b64encode(b"v1:1:99999999999999999999").decode().rstrip("=")
    assert (await client.get("/v1/events", params={"after": big2})).status_code == 422


async def test_huge_positions_and_leaves_are_422_or_404(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.get(f"/v1/sessions/{sid}/events", params={"after": 2**70})
    assert r.status_code == 422
    r = await client.get(f"/v1/sessions/{sid}/state", params={"leaf": 2**40})
    assert r.status_code == 422
    r = await client.get(f"/v1/sessions/{sid}/state", params={"leaf": 5})
    assert r.status_code == 404
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2], parent=2**70))
    assert r.status_code == 404


async def test_huge_numbers_in_records_round_trip(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    body = turn([1], [2])
    body["record"]["request"]["seed"] = 2**80
    body["record"]["request"]["temperature"] = 1e308
    r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert r.status_code == 201
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert evs[1]["record"]["request"]["seed"] == 2**80
    assert type(evs[1]["record"]["request"]["seed"]) is int


async def test_a_body_with_a_content_coding_is_415_and_stores_nothing(client, sid):
    """Bodies are read as sent: a gzip body was judged as malformed JSON, and a plain
    body labelled gzip was stored as if it were not."""
    import gzip

    plain = json.dumps(open_body(sid)).encode()
    for coding, body in (("gzip", gzip.compress(plain)), ("gzip", plain), ("BR", plain),
                         ("gzip, identity", plain)):
        r = await client.post("/v1/sessions", content=body,
                              headers={"content-type": "application/json",
                                       "content-encoding": coding})
        assert r.status_code == 415, (coding, r.text)
        problem = r.json()
        assert problem["field"] == "content-encoding" and problem["actual"] == coding.lower()
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404
    r = await client.post("/v1/sessions", content=plain,
                          headers={"content-type": "application/json",
                                   "content-encoding": "identity"})
    assert r.status_code == 201, r.text
    # The turn's bare route sits behind the same check.
    r = await client.post(f"/v1/sessions/{sid}/turns", content=json.dumps(turn([1], [2])),
                          headers={"content-type": "application/json",
                                   "content-encoding": "gzip"})
    assert r.status_code == 415 and r.json()["field"] == "content-encoding", r.text
    # A request without a body is not concerned.
    r = await client.get(f"/v1/sessions/{sid}", headers={"content-encoding": "gzip"})
    assert r.status_code == 200 and r.json()["tree"] == []


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
async def test_json_not_in_utf8_is_422_and_stores_nothing(client, sid, encoding):
    # A helper's finding: the standard library's parser (the fallback behind msgspec)
    # guessed UTF-16 and UTF-32 from a body's first bytes and took a byte-order mark,
    # so such an open was stored. JSON is UTF-8 (RFC 8259 §8.1).
    raw = json.dumps(open_body(sid)).encode(encoding)
    r = await client.post("/v1/sessions", content=raw,
                          headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "body"
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404
