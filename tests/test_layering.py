"""Which part of `app` and `turnlog_client` may import which (docs/architecture.md).

Reads every module's imports with `ast` (including imports inside functions)
and checks them against the allowed directions, part by part and then folder
by folder: rules never reach storage or HTTP, storage never reaches HTTP, the
client (its own distribution, in ./client) never reaches the server. Inside
the domain and the store the folders follow an append — a folder imports only
the folders before it — and hand-off and CI stand apart: they may import the
pipeline, the pipeline never imports them. In the API, middleware never
imports a router.
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
                   "app.services", "app.main", "app.served", "app.settings", "app.metrics",
                   "app.logs", "app.sim", "app.gateway", "app.ui"),
    "app.store": ("app.api", "app.cli", "turnlog_client", "app.transfer", "app.services",
                  "app.main", "app.served", "app.sim", "app.gateway", "app.ui"),
    "app.services": ("app.api", "app.cli", "app.transfer", "app.main", "app.served", "app.ui"),
    "app.api": ("app.cli", "app.transfer", "app.main", "app.served", "turnlog_client", "app.sim",
                "app.gateway", "app.ui"),
    # The web UI is a shell beside the API: it reuses the API's guards, dependencies and
    # problem answers and reads through the store; the API never imports it.
    "app.ui": ("app.cli", "app.transfer", "app.main", "app.served", "turnlog_client", "app.sim",
               "app.gateway"),
    "app.transfer": ("app.api", "app.cli", "app.main", "app.served", "turnlog_client", "app.ui"),
    # The client is installed without the server: nothing of `app` at all.
    "turnlog_client": ("app",),
    # The demo driver and test oracle: the domain's rules only, never the server around them.
    "app.sim": ("app.store", "app.api", "app.cli", "app.services", "app.main", "app.served",
                "app.gateway", "app.ui"),
    "app.gateway": ("app.api", "app.cli", "app.transfer", "app.main", "app.served",
                    "turnlog_client", "app.ui"),
}

# Folder by folder. The turn pipeline in the order an append moves; a folder imports only
# the folders before it (and `app.domain.errors`, which every folder raises).
DOMAIN_PIPELINE = ("wire", "body", "log", "projection")
DOMAIN_APART = ("handoff", "ci")  # may import the pipeline; never imported by it
STORE_FOLDERS = ("engine", "fold", "read", "append", "handoff", "ops", "ci")
# store folder → store folders it must never import
STORE_FORBIDDEN: dict[str, tuple[str, ...]] = {
    "engine": ("fold", "read", "append", "handoff", "ops", "ci"),
    "fold": ("read", "append", "handoff", "ops", "ci"),
    "read": ("append", "handoff", "ops", "ci"),
    # The close enqueues the session for the consumer groups in its own transaction,
    # so `append` may call `handoff`; hand-off never calls the append.
    "append": ("read", "ops", "ci"),
    "handoff": ("append", "ops", "ci"),
    # Retention appends its `r3_pruned` event through the append (`writes.append_r3_pruned`).
    "ops": ("ci",),
    # CI reads the analytics views through `read`, and writes only its own tables.
    "ci": ("fold", "append", "handoff", "ops"),
}
API_FORBIDDEN: dict[str, tuple[str, ...]] = {
    "middleware": ("routes",),
    "routes": (),
}
# Known crossings, each with the reason it is allowed (not a folder rule):
EXCEPTIONS: dict[tuple[str, str], str] = {
    # The Swagger UI's assets are public: auth lets their paths through without a token.
    ("app.api.middleware.auth", "app.api.routes.docs_ui"): "public asset paths",
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


def folder_of(name: str, part: str) -> str | None:
    """`app.store.read.reader` → `read` for part `app.store`; None outside any folder."""
    if not within(name, part) or name == part:
        return None
    rest = name[len(part) + 1:].split(".")
    return rest[0] if len(rest) > 1 or (APP / part[4:].replace(".", "/") / rest[0]).is_dir() \
        else None


def folder_rules() -> dict[str, dict[str, tuple[str, ...]]]:
    """part → folder → folders it must never import."""
    domain: dict[str, tuple[str, ...]] = {}
    for i, folder in enumerate(DOMAIN_PIPELINE):
        domain[folder] = (*DOMAIN_PIPELINE[i + 1:], *DOMAIN_APART)
    for folder in DOMAIN_APART:
        domain[folder] = tuple(f for f in DOMAIN_APART if f != folder)
    return {"app.domain": domain, "app.store": STORE_FORBIDDEN, "app.api": API_FORBIDDEN}


FOLDER_RULES = folder_rules()
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


@pytest.mark.parametrize("path", [p for p in MODULES if p.is_relative_to(APP)],
                         ids=lambda p: module_name(p))
def test_folders_follow_the_data(path: Path) -> None:
    name = module_name(path)
    imported = imports_of(path)
    for part, rules in FOLDER_RULES.items():
        folder = folder_of(name, part)
        if folder is None:
            continue
        assert folder in rules, f"{name}: folder {part}.{folder} is not in the layering rules"
        bad = sorted(
            i for i in imported
            if folder_of(i, part) in rules[folder]
            and not any(within(i, target) for (source, target) in EXCEPTIONS
                        if source == name))
        assert not bad, f"{name} ({part}.{folder}) must not import {bad}"


def test_every_module_of_the_domain_store_and_api_has_a_folder() -> None:
    """The flat layout does not creep back: only the shared modules sit beside the folders."""
    shared = {"app.domain.errors", "app.api.deps", "app.api.problems", "app.api.problem_wire",
              "app.api.http_errors"}
    for part in FOLDER_RULES:
        base = APP / part[4:].replace(".", "/")
        for path in sorted(base.glob("*.py")):
            name = module_name(path)
            assert name == part or name in shared, f"{name} belongs in a folder of {part}"


def test_every_part_and_folder_of_the_table_exists() -> None:
    names = {module_name(p) for p in MODULES}
    for part in FORBIDDEN:
        assert any(within(n, part) for n in names), part
    for part, rules in FOLDER_RULES.items():
        for folder in rules:
            assert any(within(n, f"{part}.{folder}") for n in names), f"{part}.{folder}"
    for source, target in EXCEPTIONS:
        assert source in names and target in names, (source, target)


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
