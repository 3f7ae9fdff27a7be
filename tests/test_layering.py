"""Which part of `app` and `turnlog_client` may import which (docs/architecture.md).

Reads every module's imports with `ast` (including imports inside functions)
and checks them against the allowed directions: rules never reach storage or
HTTP, storage never reaches HTTP, the client (its own distribution, in
./client) never reaches the server.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app"
CLIENT = ROOT / "client" / "turnlog_client"

# part → turnlog modules it must never import (prefix match on dotted names)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "app.domain": ("app.store", "app.api", "app.cli", "turnlog_client", "app.transfer",
                   "app.services", "app.main", "app.settings", "app.metrics", "app.logs",
                   "app.sim.simulator", "app.gateway"),
    "app.store": ("app.api", "app.cli", "turnlog_client", "app.transfer", "app.services",
                  "app.main", "app.sim.simulator", "app.gateway"),
    "app.services": ("app.api", "app.cli", "app.transfer", "app.main"),
    "app.api": ("app.cli", "app.transfer", "app.main", "turnlog_client"),
    "app.transfer": ("app.api", "app.cli", "app.main", "turnlog_client"),
    # The client is installed without the server: nothing of `app` at all.
    "turnlog_client": ("app",),
    "app.sim.simulator": ("app.store", "app.api", "app.cli", "app.services", "app.main"),
    "app.sim.sglang_http": ("app.store", "app.api", "app.cli", "app.services", "app.main",
                           "app.gateway"),
    "app.gateway": ("app.api", "app.cli", "app.transfer", "app.main", "turnlog_client",
                    "app.ui"),
}
# Third-party packages the pure domain must not touch.
DOMAIN_IO = ("sqlalchemy", "fastapi", "starlette", "httpx", "alembic", "asyncpg",
             "aiosqlite", "uvicorn")


def module_name(path: Path) -> str:
    base = CLIENT.parent if path.is_relative_to(CLIENT) else APP.parent
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = sorted(p for p in [*APP.rglob("*.py"), *CLIENT.rglob("*.py")]
                 if "migrations" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_inward(path: Path) -> None:
    name = module_name(path)
    imported = imports_of(path)
    for part, forbidden in FORBIDDEN.items():
        if not within(name, part):
            continue
        bad = sorted(i for i in imported if any(within(i, f) for f in forbidden))
        assert not bad, f"{name} ({part}) must not import {bad}"
    if within(name, "app.domain"):
        bad = sorted(i for i in imported if any(within(i, lib) for lib in DOMAIN_IO))
        assert not bad, f"{name} is pure domain code and must not import {bad}"


def test_every_part_of_the_table_exists() -> None:
    names = {module_name(p) for p in MODULES}
    for part in FORBIDDEN:
        assert any(within(n, part) for n in names), part


def test_the_client_imports_only_its_own_dependencies() -> None:
    """What `client/pyproject.toml` lists (plus the standard library and the
    `safetensors` extra, imported lazily): no server library sneaks in."""
    allowed = {"turnlog_client", "httpx", "numpy", "msgspec", "pybase64", "tenacity",
               "safetensors"}
    for path in sorted(CLIENT.rglob("*.py")):
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top in allowed or top in sys.stdlib_module_names, \
                f"{module_name(path)} imports {name}"
