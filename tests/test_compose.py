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


CITUS = ("citus-coordinator", "citus-worker1", "citus-worker2", "citus-register", "app-citus")


def test_citus_profile_starts_a_coordinator_two_workers_and_registers_them():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in CITUS:
        assert services[name]["profiles"] == ["citus"], name
    for name in ("postgres", "app"):
        assert "profiles" not in services[name]  # the default stack is unchanged
    for name in CITUS[:4]:
        assert services[name]["image"].startswith("citusdata/citus:")
    register = services["citus-register"]
    assert all(register["depends_on"][node]["condition"] == "service_healthy"
               for node in CITUS[:3])
    sql = " ".join(register["entrypoint"])
    assert "citus_set_coordinator_host('citus-coordinator', 5432)" in sql
    assert "citus_add_node('citus-worker1', 5432)" in sql
    assert "citus_add_node('citus-worker2', 5432)" in sql
    app = services["app-citus"]
    assert app["depends_on"]["citus-register"]["condition"] == "service_completed_successfully"
    assert "@citus-coordinator:5432/turnlog" in app["environment"]["TURNLOG_DATABASE_URL"]
    assert all(port.startswith("127.0.0.1:") for port in app["ports"])
    assert not any("ports" in services[node] for node in CITUS[:3])  # internal only
    assert {"citus-coordinator", "citus-worker1", "citus-worker2"} <= set(
        yaml.safe_load(COMPOSE.read_text())["volumes"])


def test_citus_profile_is_accepted_by_compose():
    command = compose_command()
    if command is None:
        pytest.skip("no docker compose plugin and no docker-compose binary")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
    result = subprocess.run([*command, "-f", str(COMPOSE), "--profile", "citus", "config"],
                            capture_output=True, text=True, cwd=ROOT, env=env, check=False,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert set(CITUS) <= set(yaml.safe_load(result.stdout)["services"])
