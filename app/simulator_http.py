"""A fake SGLang (router and engine in one) over HTTP, for gateway tests and benchmarks.

Owns the wire shape of an SGLang chat turn as a miles session server sees it:
`POST /v1/chat/completions` answers from `input_ids` with a deterministic
generation (`choices[0].meta_info.output_token_logprobs`, spec counters,
`routed_experts` as base64 int32 rows from the simulator's causal router, in
full mode or from `routed_experts_start_len` in addition mode), a streaming
(SSE) variant, and the router's other routes as small stubs (`/generate`,
`/health`, `/health_generate`, `/workers`, `/add_worker`, `/remove_worker`,
`/get_model_info`, `/metrics`). Every reply is a pure function of the request
and the configuration (no clock, no cache state), so a call repeated with the
same body gets the same bytes: that is what lets a test compare a reply seen
through a proxy with a direct one.

Refuses to own any turnlog rule (it knows nothing about sessions or the
store) and any realism beyond the wire shape: tokens come from a hash, not a
model. Test knobs travel as request headers a real caller never sends:
`X-Fake-Status: <code>` answers that status with an SGLang-like error body,
`X-Fake-Delay: <seconds>` waits before answering.

Run: `python -m app.simulator_http --port 30000 --num-layers 2 --topk 2`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from app.simulator import OUTPUT_BASE, VOCAB, route

JSON = "application/json"
# SGLang's default when a chat request names no model.
MODEL = "default"
EPOCH = 1755800000


@dataclass(frozen=True)
class FakeConfig:
    """What the fake engine is: its MoE shape, router seed and output lengths."""

    num_layers: int | None = 2
    topk: int = 2
    num_experts: int = 16
    router_seed: int = 0
    speculative: bool = False
    # A generation's natural length is 1..max_new_tokens (from the request hash).
    max_new_tokens: int = 6
    weight_version: str = "1"
    # "oracle": R3 rows are the causal router's (a full forward over the tokens);
    # "filler": cheap deterministic rows of the same size (benchmarks of big replies).
    r3: str = "oracle"


@dataclass(frozen=True)
class Generation:
    output: list[int]
    logprobs: list[float]
    finish_reason: str
    digest: bytes
    tool_call: dict[str, Any] | None


def _digest(input_ids: list[int], seed: int, router_seed: int) -> bytes:
    ids = np.asarray(input_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(ids, digest_size=16,
                           person=b"fake-sglang",
                           salt=f"{seed}:{router_seed}".encode()[:16]).digest()


def _text(tokens: list[int]) -> str:
    return " ".join(f"t{token}" for token in tokens)


def generate(config: FakeConfig, input_ids: list[int], params: dict[str, Any],
             tools: list[Any] | None, last_role: str | None) -> Generation:
    """The tokens the fake model samples: a function of the prompt and the seed.

    `params` holds the sampling fields (`seed`, `max_tokens`/`max_new_tokens`,
    `min_tokens`/`min_new_tokens`). With tools offered and the last message
    not a tool result, the turn ends in a tool call, as an agent loop expects.
    """
    digest = _digest(input_ids, int(params.get("seed") or 0), config.router_seed)
    rng = random.Random(digest)
    natural = 1 + rng.randrange(max(config.max_new_tokens, 1))
    minimum = params.get("min_tokens", params.get("min_new_tokens"))
    if isinstance(minimum, int) and minimum > natural:
        natural = minimum
    limit = params.get("max_tokens", params.get("max_new_tokens"))
    finish = "stop"
    length = natural
    if isinstance(limit, int) and 0 <= limit < natural:
        length, finish = limit, "length"
    output = [rng.randrange(OUTPUT_BASE, VOCAB) for _ in range(length)]
    logprobs = [-round(rng.random() * 4, 6) for _ in range(length)]
    tool_call = None
    if finish == "stop" and tools and last_role != "tool":
        function = tools[0].get("function", {}) if isinstance(tools[0], dict) else {}
        tool_call = {"id": f"call_{digest[:6].hex()}", "type": "function", "index": 0,
                     "function": {"name": function.get("name", "tool"),
                                  "arguments": json.dumps({"q": output[0] if output else 0})}}
        finish = "tool_calls"
    return Generation(output, logprobs, finish, digest, tool_call)


def routed_experts(config: FakeConfig, tokens: list[int], start: int) -> str:
    """Base64 of int32 rows [start, len(tokens) - 1): the R3 of one reply."""
    assert config.num_layers is not None
    rows = max(len(tokens) - 1 - start, 0)
    if rows == 0:
        return ""
    if config.r3 == "filler":
        count = rows * config.num_layers * config.topk
        filler = (np.arange(start * config.num_layers * config.topk,
                            start * config.num_layers * config.topk + count,
                            dtype=np.int64) % config.num_experts).astype("<i4")
        return base64.b64encode(filler.tobytes()).decode("ascii")
    forward = route(np.asarray(tokens, dtype=np.int64), config.num_layers, config.topk,
                    config.num_experts, config.router_seed)
    return base64.b64encode(forward[start:].tobytes()).decode("ascii")


def meta_info(config: FakeConfig, body: dict[str, Any], gen: Generation,
              input_ids: list[int]) -> dict[str, Any]:
    """SGLang's `meta_info` for one generation (the keys miles reads)."""
    rng = random.Random(gen.digest[::-1])
    finish: dict[str, Any] = {"type": gen.finish_reason}
    if gen.finish_reason == "length":
        finish["length"] = len(gen.output)
    elif gen.output:
        finish["matched"] = gen.output[-1]
    meta: dict[str, Any] = {
        "id": gen.digest[:8].hex(),
        "finish_reason": finish,
        "prompt_tokens": len(input_ids),
        "completion_tokens": len(gen.output),
        # Stateless on purpose: a radix cache would make replies depend on history.
        "cached_tokens": 0,
        "weight_version": config.weight_version,
        "e2e_latency": 0.0,
    }
    if body.get("logprobs") or body.get("return_logprob"):
        # SGLang appends the token text (null unless asked for) to each entry.
        meta["output_token_logprobs"] = [[lp, tok, None]
                                         for lp, tok in zip(gen.logprobs, gen.output,
                                                            strict=True)]
    if config.speculative:
        verify = rng.randint(1, max(len(gen.output), 1))
        proposed = rng.randint(verify, 3 * verify)
        meta.update({"spec_verify_ct": verify,
                     "spec_num_correct_drafts": rng.randint(0, proposed),
                     "spec_num_proposed_drafts": proposed})
    if body.get("return_routed_experts") and config.num_layers is not None:
        start = body.get("routed_experts_start_len") or 0
        meta["routed_experts"] = routed_experts(config, input_ids + gen.output, int(start))
    return meta


def _problem(status: int, message: str) -> Response:
    # SGLang's error shape (an OpenAI-like error object).
    body = {"object": "error", "message": message, "type": "BadRequestError", "code": status}
    return Response(json.dumps(body), status_code=status, media_type=JSON)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class FakeSGLang:
    """The ASGI app and its little bit of router state (registered workers, counters)."""

    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.workers: list[str] = []
        self.requests = 0
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/workers", self.list_workers, methods=["GET"]),
            Route("/add_worker", self.add_worker, methods=["POST"]),
            Route("/remove_worker", self.remove_worker, methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])

    async def _knobs(self, request: Request) -> Response | None:
        self.requests += 1
        delay = request.headers.get("x-fake-delay")
        if delay:
            await asyncio.sleep(float(delay))
        status = request.headers.get("x-fake-status")
        if status:
            return _problem(int(status), f"fake status {status}")
        return None

    async def chat(self, request: Request) -> Response:
        if (knob := await self._knobs(request)) is not None:
            return knob
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _problem(400, "body is not JSON")
        if not isinstance(body, dict):
            return _problem(400, "body is not a JSON object")
        messages = body.get("messages") or []
        input_ids = body.get("input_ids")
        if input_ids is None:
            # Without TITO ids the fake "tokenizes" the text: one token per character.
            text = "".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
            input_ids = [1 + ord(ch) % (OUTPUT_BASE - 1) for ch in text] or [1]
        if not (isinstance(input_ids, list) and input_ids
                and all(isinstance(t, int) for t in input_ids)):
            return _problem(400, "input_ids must be a non-empty list of integers")
        last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
        gen = generate(self.config, input_ids, body, body.get("tools"), last.get("role"))
        rid = f"chatcmpl-{gen.digest[:8].hex()}"
        created = EPOCH + gen.digest[8] * 256 + gen.digest[9]
        model = body.get("model") or MODEL
        content = _text(gen.output)
        if body.get("stream"):
            return StreamingResponse(self._stream(rid, created, model, gen),
                                     media_type="text/event-stream")
        message: dict[str, Any] = {"role": "assistant", "content": content,
                                   "reasoning_content": None,
                                   "tool_calls": None if gen.tool_call is None
                                   else [gen.tool_call]}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": gen.finish_reason,
                                  "matched_stop": gen.output[-1] if gen.output
                                  and gen.finish_reason == "stop" else None}
        if body.get("return_meta_info"):
            choice["meta_info"] = meta_info(self.config, body, gen, input_ids)
        reply = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                 "choices": [choice],
                 "usage": {"prompt_tokens": len(input_ids),
                           "completion_tokens": len(gen.output),
                           "total_tokens": len(input_ids) + len(gen.output)}}
        return Response(_dumps(reply), media_type=JSON)

    async def _stream(self, rid: str, created: int, model: str,
                      gen: Generation) -> AsyncIterator[bytes]:
        for token in gen.output:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [{"index": 0, "delta": {"content": f"t{token} "},
                                                  "finish_reason": None}]}
            yield b"data: " + _dumps(chunk) + b"\n\n"
            await asyncio.sleep(0)
        final = {"id": rid, "object": "chat.completion.chunk", "created": created,
                 "model": model, "choices": [{"index": 0, "delta": {},
                                              "finish_reason": gen.finish_reason}]}
        yield b"data: " + _dumps(final) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def generate(self, request: Request) -> Response:
        """SGLang's native `/generate` (non-session rollouts): ids in, ids out."""
        if (knob := await self._knobs(request)) is not None:
            return knob
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _problem(400, "body is not JSON")
        input_ids = body.get("input_ids") if isinstance(body, dict) else None
        if not (isinstance(input_ids, list) and input_ids
                and all(isinstance(t, int) for t in input_ids)):
            return _problem(400, "input_ids must be a non-empty list of integers")
        params = body.get("sampling_params") or {}
        gen = generate(self.config, input_ids, params, None, None)
        meta = meta_info(self.config, body, gen, input_ids)
        reply = {"text": _text(gen.output), "output_ids": gen.output, "meta_info": meta}
        return Response(_dumps(reply), media_type=JSON)

    async def health(self, request: Request) -> Response:
        if (knob := await self._knobs(request)) is not None:
            return knob
        return Response(b"", status_code=200)

    async def model_info(self, request: Request) -> Response:
        return Response(_dumps({"model_path": "fake-sglang", "is_generation": True}),
                        media_type=JSON)

    async def list_workers(self, request: Request) -> Response:
        return Response(_dumps({"workers": [{"url": url} for url in self.workers]}),
                        media_type=JSON)

    async def add_worker(self, request: Request) -> Response:
        url = request.query_params.get("url")
        if not url:
            return _problem(400, "url query parameter is required")
        if url not in self.workers:
            self.workers.append(url)
        return Response(_dumps({"status": "success", "url": url}), media_type=JSON)

    async def remove_worker(self, request: Request) -> Response:
        url = request.query_params.get("url")
        if url in self.workers:
            self.workers.remove(url)
        return Response(_dumps({"status": "success", "url": url}), media_type=JSON)

    async def metrics(self, request: Request) -> Response:
        text = ("# HELP fake_sglang_requests_total Requests served.\n"
                "# TYPE fake_sglang_requests_total counter\n"
                f"fake_sglang_requests_total {self.requests}\n")
        return Response(text, media_type="text/plain; version=0.0.4")


def create_app(config: FakeConfig | None = None) -> Starlette:
    return FakeSGLang(config or FakeConfig()).app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.simulator_http",
                                     description="A deterministic fake SGLang over HTTP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--num-layers", type=int, default=2,
                        help="R3 layers; 0 = the engine returns no routed_experts")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=16)
    parser.add_argument("--router-seed", type=int, default=0)
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--weight-version", default="1")
    parser.add_argument("--r3", choices=("oracle", "filler"), default="oracle")
    args = parser.parse_args(argv)
    config = FakeConfig(num_layers=args.num_layers or None, topk=args.topk,
                        num_experts=args.num_experts, router_seed=args.router_seed,
                        speculative=args.speculative, max_new_tokens=args.max_new_tokens,
                        weight_version=args.weight_version, r3=args.r3)
    import uvicorn

    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
