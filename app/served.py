"""What `turnlog serve` hands uvicorn, by reference: the app factory and the HTTP protocol.

uvicorn pickles its configuration to each worker process it spawns, and a worker
answers the supervisor's health checks only once that configuration is unpickled.
So the callables in it are these, from a module that imports almost nothing: the
application (`app.main`) and the guarded protocol (`app.api.middleware.serving`) are
imported when uvicorn first calls them, in the worker, while its health-check thread
already answers (as with an import string, which a non-string app cannot be).

Refuses: building anything itself; the settings it is given are the whole configuration.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.settings import ServerSettings, Settings


def served_app(settings: Settings) -> FastAPI:
    """uvicorn's app factory (bound with `functools.partial`): `app.main.create_served_app`,
    in a process whose allocator keeps a turn's large buffers resident (`app.allocator`;
    uvicorn calls the factory once in each worker)."""
    from app.allocator import keep_turn_buffers_resident
    from app.main import create_served_app

    die_with_the_supervisor()
    keep_turn_buffers_resident()

    return create_served_app(settings)


# prctl(2): the signal a process gets when the thread that started it ends.
PR_SET_PDEATHSIG = 1


def die_with_the_supervisor() -> None:
    """In a `serve --workers N` worker: SIGTERM (a graceful stop) when the supervisor
    process ends, also when it is SIGKILLed, which no handler of its own sees. Without
    it the workers outlived a killed supervisor, unsupervised and holding the port, and
    a restarted `turnlog serve` could not bind it (a tester's finding). uvicorn starts
    every worker from its main thread, which ends only with the process. Linux only
    (elsewhere nothing changes); not in a server of one process, whose parent (a shell,
    a supervisor) ending need not stop it."""
    import ctypes
    import multiprocessing
    import os
    import signal
    import sys

    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent.pid:  # it ended before the request above
        os.kill(os.getpid(), signal.SIGTERM)


def guarded_protocol(*args: Any, bounds: ServerSettings, **kwargs: Any) -> asyncio.Protocol:
    """uvicorn's `http` protocol class (bound to `bounds` with `functools.partial`):
    `app.api.middleware.serving.GuardedHttpTools`, one per connection."""
    from app.api.middleware.serving import GuardedHttpTools

    return GuardedHttpTools(*args, bounds=bounds, **kwargs)
