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

    keep_turn_buffers_resident()

    return create_served_app(settings)


def guarded_protocol(*args: Any, bounds: ServerSettings, **kwargs: Any) -> asyncio.Protocol:
    """uvicorn's `http` protocol class (bound to `bounds` with `functools.partial`):
    `app.api.middleware.serving.GuardedHttpTools`, one per connection."""
    from app.api.middleware.serving import GuardedHttpTools

    return GuardedHttpTools(*args, bounds=bounds, **kwargs)
