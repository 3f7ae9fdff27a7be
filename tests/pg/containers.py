"""Strategy b: a ``postgres:16`` container through testcontainers, if Docker answers."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
from typing import Any

from sqlalchemy.engine import URL

from tests.pg.common import MAINTENANCE_DB, PostgresServer, Unavailable

CONTAINER_IMAGE = "postgres:16"


def docker_unavailable_reason() -> str | None:
    """``None`` if a Docker engine answers a ping, else a short reason."""
    try:
        docker: Any = importlib.import_module("docker")
    except ImportError:
        return "python package 'docker' is not installed"
    try:
        client = docker.from_env(timeout=3)
    except Exception as exc:
        return f"no Docker engine ({type(exc).__name__})"
    try:
        client.ping()
    except Exception as exc:
        return f"no Docker engine answering ({type(exc).__name__})"
    finally:
        with contextlib.suppress(Exception):
            client.close()
    return None


def _postgres_container_class() -> Any:
    for module_name in ("testcontainers.community.postgres", "testcontainers.postgres"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, "PostgresContainer", None)
        if cls is not None:
            return cls
    raise Unavailable("testcontainers with the postgres module is not installed")


def from_testcontainers() -> PostgresServer:
    cls = _postgres_container_class()
    container: Any = cls(CONTAINER_IMAGE)
    container.start()
    atexit.register(_stop_container, container, os.getpid())
    url = URL.create(
        "postgresql+asyncpg",
        username=str(container.username),
        password=str(container.password),
        host=str(container.get_container_host_ip()),
        port=int(container.get_exposed_port(5432)),
        # POSTGRES_USER is a superuser in the official image, so the maintenance DB works.
        database=MAINTENANCE_DB,
    )
    return PostgresServer(url=url.render_as_string(hide_password=False), source="testcontainers")


def _stop_container(container: Any, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # forked child: not ours to stop
        return
    with contextlib.suppress(Exception):
        container.stop()
