"""The HTTP floor: uvicorn receiving a body and answering 201, nothing else.

A reference for `bench.ingest` (the same server stack as `turnlog serve`:
uvicorn with httptools and uvloop): what receiving the request bodies alone
costs a Python server process, before any parsing or storing. Not a turnlog
component; run by the benchmark as `uvicorn bench.http_floor:app`.
"""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

REPLY = b'{"ok":true}'


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
