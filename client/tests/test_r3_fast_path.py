"""The R3 fast path (a plain socket, the tensor received in place) keeps the client's
promises the httpx path keeps: `timeout` bounds each wait for bytes, not the whole
download; `retry_deadline` bounds the whole call; a proxy named in the environment is
gone through (by the httpx path); a closed client sends nothing. And the samples wire
without its optional dependency says how to install it."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

from turnlog_client import TurnlogClient, TurnlogConnectionError

TENSOR = np.arange(34 * 2 * 2, dtype=np.int32).reshape(34, 2, 2)


def npy_reply() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, TENSOR)
    body = buffer.getvalue()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-npy\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


Reply = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def serving(reply: Reply) -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await reply(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def trickle(writer: asyncio.StreamWriter) -> None:
    """The whole reply in 8 pieces, 0.2 s apart: 1.4 s in all, no wait over 0.2 s."""
    data = npy_reply()
    step = -(-len(data) // 8)
    for start in range(0, len(data), step):
        writer.write(data[start:start + step])
        await writer.drain()
        await asyncio.sleep(0.2)


async def silent(writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


@pytest.fixture
async def trickling() -> AsyncIterator[str]:
    async for url in serving(trickle):
        yield url


@pytest.fixture
async def hanging() -> AsyncIterator[str]:
    async for url in serving(silent):
        yield url


async def test_the_timeout_bounds_each_wait_not_the_download(trickling: str) -> None:
    async with TurnlogClient(trickling, timeout=1.0, retries=0) as tl:
        assert tl._fast is not None  # noqa: SLF001 - the path under test
        assert np.array_equal(await tl.r3("s", 0), TENSOR)


async def test_the_retry_deadline_bounds_the_whole_call(hanging: str) -> None:
    async with TurnlogClient(hanging, timeout=10.0, retry_deadline=0.5) as tl:
        started = asyncio.get_running_loop().time()
        with pytest.raises(TurnlogConnectionError):
            await tl.r3("s", 0)
        assert asyncio.get_running_loop().time() - started < 5  # not the 10 s read


async def test_a_proxy_in_the_environment_turns_the_fast_path_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    async with TurnlogClient("http://turnlog.example:8000") as tl:
        assert tl._fast is None  # noqa: SLF001
    monkeypatch.setenv("NO_PROXY", "turnlog.example")
    async with TurnlogClient("http://turnlog.example:8000") as tl:
        assert tl._fast is not None  # noqa: SLF001


async def test_a_closed_client_sends_nothing(trickling: str) -> None:
    tl = TurnlogClient(trickling)
    await tl.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await tl.r3("s", 0)


async def test_the_samples_wire_without_its_extra_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    async with TurnlogClient("http://127.0.0.1:9") as tl:
        with pytest.raises(ModuleNotFoundError, match=r"turnlog-client\[safetensors\]"):
            await tl.samples("s", format="safetensors")
