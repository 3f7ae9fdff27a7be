"""The HTTP floor: uvicorn receiving a body and answering 201, nothing else.

A reference for `bench.ingest` (the same server stack as `turnlog serve`:
uvicorn with httptools and uvloop, and the same allocator settings): what
receiving the request bodies alone costs a Python server process, before any
parsing or storing. Not a turnlog component; run by the benchmark as
`uvicorn bench.http_floor:app`.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from app.allocator import keep_turn_buffers_resident

REPLY = b'{"ok":true}'

# As each `turnlog serve` worker does (app.served): without it glibc unmaps a large
# body's heap after each request and faults it back in on the next (~30 brk calls
# and ~3 ms of system CPU per 3 MB body here), a cost the server does not pay.
keep_turn_buffers_resident()


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    status = 200 if scope["path"] == "/readyz" else 201
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(REPLY)).encode())]})
    await send({"type": "http.response.body", "body": REPLY})
