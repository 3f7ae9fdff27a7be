"""The fake SGLang's fast reply: the same bytes as encoding its reply as a whole.

The benchmark's fake must cost little beside the gateway it measures, so it
splices its base64 R3 into the encoded reply and builds filler R3 from one
period. The oracle here is the plain way: `json.dumps` of `completion()` and
base64 of `filler_rows`.
"""

from __future__ import annotations

import base64
import json

import pytest

from app.sim.sglang_http import FakeSGLang, filler_base64, filler_rows


@pytest.mark.parametrize(("start", "end", "layers", "topk", "experts"), [
    (0, 0, 2, 2, 16), (0, 1, 2, 2, 16), (3, 10, 2, 2, 16), (0, 7, 3, 1, 5),
    (5, 2053, 48, 8, 128), (11, 400, 5, 3, 9), (1, 2, 1, 1, 1), (7, 9, 4, 2, 6)])
def test_filler_base64_is_base64_of_the_filler_rows(start: int, end: int, layers: int,
                                                    topk: int, experts: int) -> None:
    expected = base64.b64encode(filler_rows(start, end, layers, topk, experts).tobytes())
    assert filler_base64(start, end, layers, topk, experts) == expected


@pytest.mark.parametrize("r3", ["oracle", "filler"])
@pytest.mark.parametrize("extra", [
    {}, {"return_routed_experts": True},
    {"return_routed_experts": True, "routed_experts_start_len": 3, "seed": 7},
    {"return_routed_experts": True, "tools": [{"function": {"name": "search"}}]},
    {"messages": [{"role": "tool", "content": "x"}], "tools": [{"function": {}}]}])
@pytest.mark.parametrize("logprobs", [True, False])
def test_reply_bytes_are_the_reply_encoded(r3: str, extra: dict[str, object],
                                           logprobs: bool) -> None:
    fake = FakeSGLang(num_layers=3, topk=2, num_experts=7, speculative=True, r3=r3)
    request = {"input_ids": [5, 6, 7, 8, 9], "max_tokens": 6,
               "messages": [{"role": "user", "content": "hi"}], **extra}
    reply = fake.completion(request, pad=4)
    if not logprobs:
        del reply["choices"][0]["meta_info"]["output_token_logprobs"]
    assert fake.reply_bytes(request, pad=4, logprobs=logprobs) == json.dumps(reply).encode()


@pytest.mark.parametrize("request_body", [
    {"input_ids": ["a"]}, {"input_ids": [[1]]}, {"input_ids": 5},
    {"input_ids": [1, 2], "max_tokens": "many"}, {"input_ids": [1], "messages": 3},
    {"input_ids": [1], "stream": True, "max_tokens": {"a": 1}},
    {"input_ids": [1, 99999999999999999999999, 3]}])
async def test_a_request_it_cannot_serve_is_a_400_not_a_500(request_body) -> None:
    # A tester's finding: `input_ids` of strings or lists raised, a plain-text 500.
    import httpx

    fake = FakeSGLang()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fake),
                                 base_url="http://sglang") as http:
        reply = await http.post("/v1/chat/completions", json=request_body)
    assert reply.status_code == 400, reply.text
    assert "cannot serve this request" in reply.json()["error"]


async def test_json_nested_too_deep_is_a_400_not_a_500() -> None:
    import httpx

    body = b'{"input_ids": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=FakeSGLang()),
                                 base_url="http://sglang") as http:
        reply = await http.post("/v1/chat/completions", content=body,
                                headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
