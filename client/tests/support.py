"""What the client's tests build: turns as a session server sends them, a miles-like
`Sample`, the fake agent and reward function the miles hooks wrap, and a loopback
proxy that loses one reply (to watch a retry).

The fake agent plays miles' user agent and the gateway at once: it appends its
turns to the session in `base_url` (as the gateway would record them) and
answers what `metadata["behaviour"]` asks. Nothing here imports the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httpx

from turnlog_client import TurnlogClient
from turnlog_client.miles import session_id_of


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What a `fake_http` server answers one request with: (status line, extra header lines,
# body), from the request's target and its headers (names in lower case).
Answer = Callable[[str, dict[str, str]], tuple[bytes, bytes, bytes]]
BodyAnswer = Callable[[str, dict[str, str], bytes], tuple[bytes, bytes, bytes]]


@contextlib.asynccontextmanager
async def fake_http(answer: Answer | BodyAnswer, with_body: bool = False,
                    port: int = 0) -> AsyncIterator[str]:
    """A loopback HTTP/1.1 server (keep-alive) answering each request with `answer`
    (an `Answer`; with `with_body`, called with the request body too); yields its base
    URL (on `port` if given). For a store or a gateway that answers what a test
    needs."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                lines = head.split("\r\n")
                fields = {k.strip().lower(): v.strip() for k, _, v in
                          (line.partition(":") for line in lines[1:] if line)}
                sent = await reader.readexactly(int(fields.get("content-length", "0")))
                target = lines[0].split()[1]
                status, headers, body = (
                    cast(BodyAnswer, answer)(target, fields, sent) if with_body
                    else cast(Answer, answer)(target, fields))
                writer.write(b"HTTP/1.1 %s\r\n%sContent-Length: %d\r\n\r\n%s"
                             % (status, headers, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def new_sid() -> str:
    return f"client-{uuid.uuid4().hex[:12]}"


def turn(prompt: list[int], output: list[int], *, response_id: str | None = None,
         finish_reason: str = "stop") -> dict[str, Any]:
    """A turn body as a session server (or the gateway) appends it: one SGLang chat turn."""
    meta = {"output_token_logprobs": [[-0.5 - i / 100, tok] for i, tok in enumerate(output)],
            "completion_tokens": len(output), "weight_version": "1"}
    return {
        "event_id": uuid.uuid4().hex,
        "record": {
            "timestamp": 1755800000.0, "request_timestamp": 1755799999.5,
            "method": "POST", "path": "/v1/chat/completions", "status_code": 200,
            "request": {"model": "default", "input_ids": list(prompt)},
            "response": {"id": response_id or uuid.uuid4().hex,
                         "choices": [{"index": 0, "finish_reason": finish_reason,
                                      "message": {"role": "assistant", "content": "x"},
                                      "meta_info": meta}]},
        },
    }


@dataclass
class Sample:
    """What the hooks read of miles' `Sample`: an object with a `.metadata` dict."""

    prompt: str = ""
    reward: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


AGENT_CALLS: list[dict[str, Any]] = []
RM_CALLS: list[tuple[Any, Any, dict[str, Any]]] = []


async def fake_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                     metadata: dict[str, Any], **kwargs: Any) -> Any:
    """miles' user agent: two turns through "the gateway", then what `behaviour` asks."""
    AGENT_CALLS.append({"base_url": base_url, "prompt": prompt,
                        "request_kwargs": request_kwargs, "metadata": metadata, **kwargs})
    sid = session_id_of(base_url)
    behaviour = metadata.get("behaviour", "dict")
    async with TurnlogClient(os.environ["TURNLOG_URL"]) as tl:
        if behaviour != "no-turns":
            await tl.append_body(sid, turn([1, 2, 3], [4], response_id=f"{sid}-r0"))
            await tl.append_body(sid, turn([1, 2, 3, 4, 5], [6], response_id=f"{sid}-r1"))
        if behaviour == "idle-closed":
            # The gateway's idle close came first.
            await tl.close(sid, metadata={"closed_by": "gateway-idle"})
    if behaviour == "raise":
        raise ValueError("the environment broke")
    if behaviour == "none":
        return None
    if behaviour == "branch-rewards":  # miles v2: per-branch rewards by response id
        return {"reward": 0.5, "rewards": {f"{sid}-r1": 0.9, "no-such-leaf": 0.1,
                                           f"{sid}-r0": "not a number"}}
    return {"reward": metadata.get("reward", 1.0), "turns": 2, "note": ("a", float("nan"))}


async def fail_closed_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                            metadata: dict[str, Any], **kwargs: Any) -> Any:
    """`fake_agent` marked fail-closed, as miles' sandboxed adapters mark theirs: its None
    means "no trustworthy outcome", and miles aborts the sample."""
    return await fake_agent(base_url, prompt, request_kwargs, metadata, **kwargs)


fail_closed_agent._miles_fail_closed_result = True  # type: ignore[attr-defined]


async def returning_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                          metadata: dict[str, Any], **kwargs: Any) -> Any:
    """An agent that records nothing and returns `metadata["returns"]`."""
    return metadata.get("returns")


async def fail_closed_returning_agent(base_url: str, prompt: Any,
                                      request_kwargs: dict[str, Any],
                                      metadata: dict[str, Any], **kwargs: Any) -> Any:
    """`returning_agent`, marked fail-closed."""
    return metadata.get("returns")


fail_closed_returning_agent._miles_fail_closed_result = True  # type: ignore[attr-defined]


def _score(sample: Any) -> Any:
    metadata = sample["metadata"] if isinstance(sample, dict) else sample.metadata
    return metadata.get("score", 0.5)


async def fake_rm(args: Any, samples: Any, **kwargs: Any) -> Any:
    """miles' reward function, single (`rm(args, sample)`) or batched (`rm(args, samples)`)."""
    RM_CALLS.append((args, samples, kwargs))
    if isinstance(samples, list):
        return [_score(s) for s in samples]
    return _score(samples)


class LossyProxy:
    """A loopback HTTP proxy in front of the real server that forwards everything,
    but answers the first request whose path ends with `lose` with a 503 *after*
    the server handled it — a reply lost on the way back. `bodies` keeps the bodies
    of the requests to that path, in order."""

    def __init__(self, upstream: str, lose: str) -> None:
        self.upstream = upstream
        self.lose = lose
        self.bodies: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def __aenter__(self) -> LossyProxy:
        self.http = httpx.AsyncClient(base_url=self.upstream, timeout=30)
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()
        await self.http.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            line, *header_lines = head.split("\r\n")
            method, target, _ = line.split(" ", 2)
            headers = dict(h.split(":", 1) for h in header_lines if ":" in h)
            headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            forward = {k: v for k, v in headers.items()
                       if k not in ("host", "content-length", "connection")}
            reply = await self.http.request(method, target, content=body, headers=forward)
            status, content = reply.status_code, reply.content
            kind = reply.headers.get("content-type", "application/json")
            if target.split("?")[0].endswith(self.lose):
                self.bodies.append(body)
                if len(self.bodies) == 1:
                    status, kind = 503, "application/problem+json"
                    content = b'{"type":"about:blank","title":"lost","status":503}'
            writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: {kind}\r\n"
                         f"content-length: {len(content)}\r\nconnection: close\r\n\r\n"
                         .encode("latin-1") + content)
            await writer.drain()
        finally:
            writer.close()
