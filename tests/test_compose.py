"""docker-compose.yml: what it promises (read as YAML), and that Compose itself accepts it.

`docker compose config` needs only the client, not an engine; the check skips where
neither the compose plugin nor the standalone `docker-compose` is installed.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is not None and subprocess.run(
            [docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone is not None else None


def test_compose_config_is_accepted_by_compose():
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose plugin and no docker-compose binary")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
    result = subprocess.run([*command, "-f", str(COMPOSE), "config"], capture_output=True,
                            text=True, cwd=ROOT, env=env, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert set(rendered["services"]) == {"postgres", "app"}


def test_app_waits_for_a_healthy_postgres_and_serves_on_loopback_only():
    spec = yaml.safe_load(COMPOSE.read_text())
    postgres, app = spec["services"]["postgres"], spec["services"]["app"]
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert app["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert app["environment"]["TURNLOG_DATABASE_URL"].startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in app["environment"]["TURNLOG_DATABASE_URL"]
    assert all(port.startswith("127.0.0.1:") for port in app["ports"])
    assert app["command"][:2] == ["turnlog", "serve"]
    assert "/readyz" in " ".join(app["healthcheck"]["test"])
    assert "TURNLOG_API_TOKENS" in app["environment"]


def test_postgres_is_durable():
    command = yaml.safe_load(COMPOSE.read_text())["services"]["postgres"]["command"]
    assert {"fsync=on", "full_page_writes=on", "synchronous_commit=on"} <= set(command)
