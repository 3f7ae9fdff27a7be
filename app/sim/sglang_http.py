"""A fake SGLang over HTTP: the simulator's causal router behind the routes a router serves.

For tests, demos and benchmarks of `turnlog gateway` (and anything else that
talks to SGLang) without a GPU. Serve it with `python -m app.sim.sglang_http
--port P [--num-layers N --topk K --num-experts E]`, or mount `FakeSGLang()`
in any ASGI server.

Routes:
- `POST /v1/chat/completions`: a TITO chat turn. The output tokens are a hash
  of `input_ids` and the sampling `seed` (`max_tokens` of them, default 4, at
  most 4096) with made-up log-probs; with `return_routed_experts` the reply's
  `meta_info.routed_experts` is base64 int32 of `route(prompt + output)` rows
  `[start, len - 1)` where `start = routed_experts_start_len` (0 when absent) —
  a full forward's rows, so stored R3 can be checked against
  `app.sim.simulator.route` (`r3="filler"`: cheap rows of the same size, for
  benchmarks of big replies). With `tools` offered and the last message not a
  tool result, the turn ends in a tool call (`finish_reason` "tool_calls"), as
  an agent loop expects. With `speculative` the meta_info carries SGLang's spec
  counters. With `"stream": true` the reply is a server-sent event stream
  (chunked). A reply is a pure function of the request (no clock, no cache
  state): the same body gives the same bytes, directly or through a proxy.
  Test knobs (request headers): `X-Sim-Status: N` answers N with a JSON error;
  `X-Sim-Reply: not-json | no-logprobs` answers text / JSON without the log-prob
  list; `X-Sim-Delay: S` waits S seconds first; `X-Sim-Pad: N` adds an N-byte
  `sim_padding` string to the reply (big replies); `X-Sim-Chunks: N` streams N
  chunks 0.3 s apart (status `X-Sim-Status`, type `X-Sim-Content-Type`);
  `X-Sim-Encoding: gzip | deflate | br | zstd` compresses a turn's reply with that
  `Content-Encoding` (as a router may for a caller that accepts it).
- `GET /health` (200 "OK"), `GET /metrics` (Prometheus text), `GET /workers`.
- `GET /stream?chunks=N&size=B&delay=S`: N chunks of B bytes, chunked, spaced S s;
  a caller that hangs up stops it (counted: `sim_streams_abandoned_total` in `/metrics`).
- Everything else (`/generate`, `/add_worker`, …): an echo — JSON of the method,
  raw path, query, headers and body as received.

Refuses: any rule of turnlog (it is the upstream; it knows nothing of sessions).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gzip
import hashlib
import json
import math
import zlib
from typing import Any
from urllib.parse import parse_qs

import brotli
import msgspec
import numpy as np
import zstandard

from app.domain.wire.r3 import WIRE_DTYPE
from app.sim.simulator import OUTPUT_BASE, VOCAB, route

MAX_TOKENS = 4096
_R3_MARK = "\u0000sim-r3\u0000"  # a string no reply holds otherwise


def output_for(prompt: list[int] | np.ndarray, count: int,
               sampling_seed: int = 0) -> list[int]:
    """Deterministic output tokens for a prompt and sampling seed (the same pair
    gives the same output; another seed is another sample, as a retry gets)."""
    data = np.asarray(prompt, dtype=np.int64).tobytes()
    if sampling_seed:
        data += b"seed:%d" % sampling_seed
    seed = hashlib.sha256(data).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    return [int(t) for t in rng.integers(OUTPUT_BASE, VOCAB, size=count)]


def _loads(body: bytes) -> Any:
    """`json.loads(body)`, by msgspec where it can (a 60k-token prompt costs `json`
    ~8 ms): what msgspec refuses (NaN, 1e400) goes to `json`, which decides as before."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        return json.loads(body)


def _token_ids(values: Any) -> np.ndarray:
    """`[int(t) for t in values]` as int64, converted at C speed when it can be."""
    try:
        ids = np.asarray(values, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):
        ids = None
    if ids is None or ids.ndim != 1:  # what `int(t)` says of it, as before
        return np.asarray([int(t) for t in values], dtype=np.int64)
    return ids


def filler_rows(start: int, end: int, num_layers: int, topk: int,
                num_experts: int) -> np.ndarray:
    """Cheap deterministic rows [start, end) with R3's shape (not a forward)."""
    per_row = num_layers * topk
    values = np.arange(start * per_row, end * per_row, dtype=np.int64) % num_experts
    return values.astype(WIRE_DTYPE).reshape(end - start, num_layers, topk)


def filler_base64(start: int, end: int, num_layers: int, topk: int,
                  num_experts: int) -> bytes:
    """`base64(filler_rows(...).tobytes())`, built from one period: the rows are the
    sequence 0..num_experts-1 repeated, so the bytes repeat every `4 * num_experts`
    and their base64 every `lcm(4 * num_experts, 3)` bytes. A benchmark's fake must
    cost little beside the gateway it measures (base64 of 3 MB alone is ~5 ms)."""
    per_row = num_layers * topk
    first, count = start * per_row, max(end - start, 0) * per_row
    period = num_experts * 3 // math.gcd(num_experts, 3)  # values in lcm(4E, 3) bytes
    block = ((np.arange(period, dtype=np.int64) + first) % num_experts).astype(WIRE_DTYPE)
    whole, rest = divmod(count, period)
    tail = block[:rest].tobytes()
    return base64.b64encode(block.tobytes()) * whole + base64.b64encode(tail)


class FakeSGLang:
    def __init__(self, num_layers: int = 2, topk: int = 2, num_experts: int = 16,
                 router_seed: int = 0, speculative: bool = False,
                 r3: str = "oracle") -> None:
        if r3 not in ("oracle", "filler"):
            raise ValueError(f"r3 must be 'oracle' or 'filler', not {r3!r}")
        self.num_layers = num_layers
        self.topk = topk
        self.num_experts = num_experts
        self.router_seed = router_seed
        self.speculative = speculative
        self.r3 = r3
        self.requests = 0
        self.abandoned = 0  # `/stream` replies whose caller hung up before the end

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"{message['type']}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        self.requests += 1
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(parts)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        # Routed by the path as sent, as a router matches it (`%2F` is not a `/`).
        path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        method = scope["method"]
        if path == "/v1/chat/completions" and method == "POST":
            await self._chat(headers, body, send)
        elif path == "/health":
            await _reply(send, 200, b"OK", b"text/plain")
        elif path == "/metrics":
            text = (f"sglang_num_requests_total {self.requests}\n"
                    f"sim_streams_abandoned_total {self.abandoned}\n").encode()
            await _reply(send, 200, text, b"text/plain; version=0.0.4")
        elif path == "/workers":
            await _reply(send, 200, b'{"workers":[]}')
        elif path == "/stream":
            await self._stream(scope, receive, send)
        else:
            await _reply(send, 200, json.dumps({
                "method": method,
                "path": path,
                "query": scope.get("query_string", b"").decode("latin-1"),
                "headers": [[k.decode("latin-1"), v.decode("latin-1")]
                            for k, v in scope["headers"]],
                "body": body.decode("latin-1"),
            }).encode())

    async def _stream(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """`chunks` pieces of `size` bytes, `delay` s apart; stops (and counts it) when
        the caller hangs up, as SGLang aborts a request whose client went away."""
        query = parse_qs(scope.get("query_string", b"").decode())
        chunks = int(query.get("chunks", ["3"])[0])
        size = int(query.get("size", ["16"])[0])
        delay = float(query.get("delay", ["0"])[0])
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream")]})
            for i in range(chunks):
                if delay:
                    await asyncio.wait({gone}, timeout=delay)
                if gone.done():
                    self.abandoned += 1
                    return
                piece = bytes([65 + i % 26]) * size
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            gone.cancel()

    def completion(self, request: dict[str, Any], pad: int = 0) -> dict[str, Any]:
        """The reply SGLang would give this request (what the gateway must record)."""
        reply, routed = self._completion(request, pad)
        if routed is not None:
            reply["choices"][0]["meta_info"]["routed_experts"] = routed.decode("ascii")
        return reply

    def reply_bytes(self, request: dict[str, Any], pad: int = 0,
                    logprobs: bool = True) -> bytes:
        """`json.dumps(self.completion(request, pad)).encode()`, the same bytes, with the
        base64 R3 spliced in rather than scanned by the JSON encoder (base64 needs no
        escaping; a 4 MB string costs `json.dumps` ~10 ms)."""
        reply, routed = self._completion(request, pad)
        meta = reply["choices"][0]["meta_info"]
        if not logprobs:
            del meta["output_token_logprobs"]
        if routed is None:
            return json.dumps(reply).encode()
        meta["routed_experts"] = _R3_MARK
        head, mark, tail = json.dumps(reply).encode().partition(json.dumps(_R3_MARK).encode())
        assert mark, "the R3 mark is in the encoded reply"
        return b"".join((head, b'"', routed, b'"', tail))

    def _completion(self, request: dict[str, Any],
                    pad: int) -> tuple[dict[str, Any], bytes | None]:
        """The reply without its base64 R3, and that R3 (None when not asked for)."""
        prompt = _token_ids(request["input_ids"])
        count = max(0, min(int(request.get("max_tokens") or 4), MAX_TOKENS))
        sampling_seed = int(request.get("seed") or request.get("sampling_seed") or 0)
        out = output_for(prompt, count, sampling_seed)
        tokens = np.concatenate((prompt, np.asarray(out, dtype=np.int64)))
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()
        finish = "stop"
        message: dict[str, Any] = {"role": "assistant",
                                   "content": " ".join(f"t{t}" for t in out)}
        messages = request.get("messages") or [{}]
        last_role = messages[-1].get("role") if isinstance(messages[-1], dict) else None
        tools = request.get("tools")
        if tools and isinstance(tools, list) and last_role != "tool":
            function = tools[0].get("function", {}) if isinstance(tools[0], dict) else {}
            finish = "tool_calls"
            message["tool_calls"] = [{
                "id": "call_" + digest[:12],
                "type": "function", "index": 0,
                "function": {"name": function.get("name", "tool"),
                             "arguments": json.dumps({"q": out[0] if out else 0})}}]
        meta: dict[str, Any] = {
            "output_token_logprobs": [[-((t % 97) / 97.0), t] for t in out],
            "completion_tokens": len(out),
            "prompt_tokens": len(prompt),
            "cached_tokens": 0,
            "weight_version": "1",
            "finish_reason": {"type": finish},
        }
        if self.speculative:
            # SGLang's names (miles reads these since PR #2028); verify >= 1 per turn.
            verify = 1 + len(out) // 2
            proposed = 3 * verify
            meta.update({"spec_verify_ct": verify,
                         "spec_num_correct_drafts": sum(t % 3 == 0 for t in out) % (proposed + 1),
                         "spec_num_proposed_drafts": proposed})
        routed = None
        if request.get("return_routed_experts"):
            start = int(request.get("routed_experts_start_len") or 0)
            if self.r3 == "filler":
                routed = filler_base64(start, max(len(tokens) - 1, start), self.num_layers,
                                       self.topk, self.num_experts)
            else:
                rows = route(tokens, self.num_layers, self.topk,
                             self.num_experts, self.router_seed)[start:]
                routed = base64.b64encode(rows.astype(WIRE_DTYPE).tobytes())
            meta["routed_experts"] = None  # its place in the reply's key order
        reply: dict[str, Any] = {
            "id": "chatcmpl-" + digest[:16],
            "object": "chat.completion",
            "model": request.get("model", "default"),
            "choices": [{"index": 0, "finish_reason": finish, "message": message,
                         "meta_info": meta}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out)},
        }
        if pad:
            reply["sim_padding"] = "x" * pad
        return reply, routed

    async def _chat(self, headers: dict[str, str], body: bytes, send: Any) -> None:
        if "x-sim-delay" in headers:
            await asyncio.sleep(float(headers["x-sim-delay"]))
        if "x-sim-chunks" in headers:
            # A reply streamed in N chunks 0.3 s apart, whatever the request: status and
            # content type from x-sim-status / x-sim-content-type.
            await send({"type": "http.response.start",
                        "status": int(headers.get("x-sim-status", "200")),
                        "headers": [(b"content-type", headers.get(
                            "x-sim-content-type", "application/json").encode("latin-1"))]})
            for i in range(int(headers["x-sim-chunks"])):
                await asyncio.sleep(0.3)
                await send({"type": "http.response.body", "more_body": True,
                            "body": f"chunk {i}\n".encode()})
            await send({"type": "http.response.body", "body": b""})
            return
        if "x-sim-status" in headers:
            status = int(headers["x-sim-status"])
            await _reply(send, status, json.dumps({"error": f"simulated {status}"}).encode())
            return
        if headers.get("x-sim-reply") == "not-json":
            await _reply(send, 200, b"this is not JSON", b"text/plain")
            return
        try:
            request = _loads(body)
            request["input_ids"]  # noqa: B018 (a KeyError is the 400 below)
        except (ValueError, KeyError, TypeError, RecursionError):
            await _reply(send, 400, b'{"error":"expected a JSON body with input_ids"}')
            return
        pad = int(headers.get("x-sim-pad", "0"))
        logprobs = headers.get("x-sim-reply") != "no-logprobs"
        try:  # a request it cannot serve is a 400, as SGLang answers one
            reply = self.completion(request, pad) if request.get("stream") is True else None
            text = self.reply_bytes(request, pad, logprobs) if reply is None else b""
        except (ValueError, TypeError, OverflowError, AttributeError, IndexError,
                KeyError) as exc:
            await _reply(send, 400, json.dumps({
                "error": f"cannot serve this request: {type(exc).__name__}: {exc}"}).encode())
            return
        if reply is not None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for piece in (reply["choices"][0]["message"]["content"], ""):
                event = {"id": reply["id"], "choices": [{"delta": {"content": piece}}]}
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps(event).encode() + b"\n\n"})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        coding = headers.get("x-sim-encoding")
        if coding is None:
            await _reply(send, 200, text)
            return
        packed = _COMPRESS[coding](text)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-encoding", coding.encode()),
                                (b"content-length", str(len(packed)).encode())]})
        await send({"type": "http.response.body", "body": packed})


_COMPRESS = {
    # No timestamp in the header: the same reply twice is the same bytes, a second apart.
    "gzip": lambda data: gzip.compress(data, mtime=0),
    "deflate": zlib.compress,
    "br": brotli.compress,
    # A streamed frame, without its size, as a server compressing on the fly sends.
    "zstd": lambda data: zstandard.ZstdCompressor(write_content_size=False).compress(data),
}


async def _disconnected(receive: Any) -> None:
    """Returns once the caller has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(send: Any, status: int, body: bytes,
                 content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m app.sim.sglang_http",
        description="A fake SGLang (the simulator's router). Give it the same --num-layers "
                    "as the gateway in front of it: R3 rows of another geometry are refused.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30001, help="port to listen on")
    parser.add_argument("--num-layers", type=int, default=2, help="MoE layers of the R3 rows")
    parser.add_argument("--topk", type=int, default=2, help="experts per token and layer")
    parser.add_argument("--num-experts", type=int, default=16, help="experts per layer")
    parser.add_argument("--router-seed", type=int, default=0,
                        help="seed of the simulated router's weights")
    parser.add_argument("--speculative", action="store_true",
                        help="add SGLang's speculative-decoding counters to meta_info")
    parser.add_argument("--r3", choices=("oracle", "filler"), default="oracle",
                        help="oracle: a full forward's rows; filler: cheap rows (benchmarks)")
    args = parser.parse_args(argv)
    from app.allocator import keep_turn_buffers_resident

    keep_turn_buffers_resident()  # as the gateway does: a reply's buffers stay mapped
    app = FakeSGLang(args.num_layers, args.topk, args.num_experts, args.router_seed,
                     args.speculative, args.r3)
    uvicorn.run(app, host=args.host,
                port=args.port, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
