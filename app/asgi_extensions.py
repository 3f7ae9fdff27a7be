"""The ASGI scope extensions turnlog's own HTTP protocol offers the apps it serves.

`turnlog serve` and `turnlog gateway` both run on `GuardedHttpTools`
(`app.api.middleware.serving`), which puts these in `scope["extensions"]`; an app
run by another server finds none and does without. Owns only their names, so the
protocol and the apps (the API's hot route, the gateway) agree on them without
importing each other.
"""

from __future__ import annotations

# A POST's `DirectBody`: the rest of its body read straight into the route's buffer.
DIRECT_BODY = "turnlog.direct_body"
# `cut(scope)`: end this request's connection now, its answer left incomplete on purpose
# (a relayed reply whose upstream broke off): the caller sees the cut, and the server
# logs nothing of its own about an unfinished answer.
CUT_CONNECTION = "turnlog.cut_connection"
# An `asyncio.Event` set when the server begins its graceful shutdown (SIGTERM): a
# request that only waits (the feed's long poll) answers at once instead of holding the
# shutdown for the rest of its wait.
SERVER_CLOSING = "turnlog.server_closing"
