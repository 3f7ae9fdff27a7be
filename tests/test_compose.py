"""docker-compose.yml: what it promises (read as YAML), and that Compose itself accepts it.

`docker compose config` needs only the client, not an engine; the check skips where
neither the compose plugin nor the standalone `docker-compose` is installed.
"""

import os
import shutil
import subprocess
import sys
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
    # Retired WAL segments kept for reuse: no turn waits on a zero-filled new one.
    assert "min_wal_size=1GB" in command


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


def test_a_neighbour_container_may_call_the_app_by_its_service_name():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("app", "app-citus"):
        allowed = services[name]["environment"]["TURNLOG_ALLOWED_HOSTS"]
        assert allowed.startswith("${TURNLOG_ALLOWED_HOSTS:-") and name in allowed, allowed


async def test_the_service_name_is_answered_by_the_loopback_guard(tmp_path):
    import httpx

    from app.main import create_app
    from app.settings import Settings

    url = f"sqlite+aiosqlite:///{tmp_path / 'c.db'}"
    app = create_app(Settings.load(database_url=url, host="0.0.0.0", allowed_hosts="app"))
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://app:8000") as http:
            assert (await http.get("/healthz")).status_code == 200
        async with httpx.AsyncClient(transport=transport, base_url="http://db:8000") as http:
            assert (await http.get("/healthz")).status_code == 421
    finally:
        await app.state.services.db.dispose()


def test_compose_runs_the_tested_citus_version():
    tested = next((ROOT / "tests" / "citus").glob("citus-*.tar.gz")).name.split("-")[1]
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    images = {services[name]["image"] for name in CITUS[:4]}
    major_minor = ".".join(tested.split(".")[:2])
    assert images == {f"citusdata/citus:{major_minor}"}, (images, tested)


DOCKERFILE = ROOT / "Dockerfile"


def dockerfile_instructions() -> list[tuple[str, str]]:
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            lines.append((word.upper(), rest))
            current = ""
    return lines


def image_env() -> dict[str, str]:
    import shlex

    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            env.update(part.split("=", 1) for part in shlex.split(rest))
    return env


def test_the_image_installs_turnlog_as_a_package_not_editable():
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert installs and not any(" -e " in r or "--editable" in r for r in installs), installs


def _image_command() -> list[str]:
    import json

    (cmd,) = [rest for word, rest in dockerfile_instructions() if word == "CMD"]
    argv = json.loads(cmd)  # exec form: no shell between docker and turnlog
    assert argv[0] == "turnlog"
    return [str(Path(sys.executable).with_name("turnlog")), *argv[1:]]


def test_the_image_command_without_tokens_prints_one_line_saying_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
    env.update(image_env(), TURNLOG_DATABASE_URL=f"sqlite:///{tmp_path / 't.db'}")
    result = subprocess.run(_image_command(), capture_output=True, text=True, env=env,
                            cwd=tmp_path, check=False, timeout=60)
    assert result.returncode == 2, result
    (line,) = result.stderr.strip().splitlines()
    assert "TURNLOG_API_TOKENS" in line and "0.0.0.0" in line, line


def test_the_image_command_serves_when_tokens_are_set(tmp_path):
    from tests.serverproc import ServerProcess, any_answer, free_port

    port = free_port()
    token = "t" * 24
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
    env.update(image_env(), TURNLOG_DATABASE_URL=f"sqlite:///{tmp_path / 't.db'}",
               TURNLOG_PORT=str(port), TURNLOG_API_TOKENS=f"{token}:write")
    with ServerProcess(_image_command(), tmp_path / "serve.log", port=port, env=env) as server:
        reply = server.wait_ready_sync("/v1/sessions", accept=any_answer,
                                       headers={"Authorization": f"Bearer {token}"})
        assert reply.status_code == 200, reply.text
