"""`app.settings`: groups whose fields keep the flat `TURNLOG_*` names, lists and the
token table parsed once at load, bad values named without echoing them."""

from __future__ import annotations

import os
import pickle
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.cli.common import describe_failure
from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "w-0123456789abcdef"
# Every variable as operators know it (docs/operations.md, README): none may be renamed.
NAMES = {
    "DATABASE_URL", "POOL_SIZE", "MAX_OVERFLOW", "STATEMENT_TIMEOUT_MS", "MIGRATE_ON_START",
    "INTEGRITY_CHECK", "STATE_CACHE_SESSIONS", "STATE_CACHE_BYTES", "HOST", "PORT",
    "MAX_HEADER_BYTES", "MAX_HEADERS", "HEADER_TIMEOUT_S", "KEEP_ALIVE_TIMEOUT_S",
    "LIMIT_CONCURRENCY", "MAX_BODY_BYTES", "BODY_TIMEOUT_S", "LARGE_BODY_BYTES",
    "MAX_BODY_VALUES", "MAX_LARGE_UPLOADS", "OFFLOAD_BODY_BYTES", "MIN_UPLOAD_RATE",
    "UPLOAD_GRACE_S", "MAX_NODES",
    "API_TOKENS", "ALLOWED_HOSTS", "LOG_FORMAT", "LOG_LEVEL", "TOKENIZER", "METRIC_KEYS",
    "GROUP_COMMIT_WINDOW_US", "GROUP_COMMIT_MAX_APPENDS", "GROUP_COMMIT_MAX_BYTES",
    "GROUP_COMMIT_SIBLINGS",
}


@pytest.fixture(autouse=True)
def no_turnlog_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("TURNLOG_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # no `.env` but the one a test writes


def fields() -> dict[str, tuple[str, typing.Any]]:
    """Flat name → (group, annotation) over every group."""
    found: dict[str, tuple[str, typing.Any]] = {}
    for group in Settings.GROUPS:
        for name, info in Settings._group_type(group).model_fields.items():
            assert name not in found, f"{name} in two groups"
            found[name] = (group, info.annotation)
    return found


def test_the_variable_names_are_those_of_the_flat_layout() -> None:
    assert {name.upper() for name in fields()} == NAMES
    documented = "".join(path.read_text() for path in [ROOT / "README.md",
                                                         *(ROOT / "docs").glob("*.md")])
    assert [name for name in sorted(NAMES) if f"TURNLOG_{name}" not in documented] == []


def sample(annotation: typing.Any) -> tuple[str, typing.Any]:
    """An environment value of this type and what it loads as."""
    if annotation is bool:
        return "false", False
    if annotation is int:
        return "1024", 1024
    if annotation is float:
        return "2.5", 2.5
    if annotation is str:
        return "value-x", "value-x"
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal or type(None) in args:
        literal = next(a for a in args if a is not type(None))
        choice = (typing.get_args(literal) or args)[-1]
        return choice, choice
    raise AssertionError(f"no sample for {annotation}")


def test_every_variable_reaches_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    expected: dict[str, tuple[str, typing.Any]] = {}
    for name, (group, annotation) in fields().items():
        if name in ("api_tokens", "allowed_hosts", "metric_keys"):
            continue  # parsed: below
        text, value = sample(annotation)
        monkeypatch.setenv(f"TURNLOG_{name.upper()}", text)
        expected[name] = (group, value)
    monkeypatch.setenv("TURNLOG_PORT", "8123")
    expected["port"] = ("server", 8123)
    settings = Settings.load()
    assert {name: (group, getattr(getattr(settings, group), name))
            for name, (group, _) in expected.items()} == expected
    assert settings.store.database_url == "value-x"
    assert settings.limits.max_body_bytes == 1024


@pytest.mark.parametrize(("text", "hosts", "keys"), [
    ("", [], []),
    (" , ,", [], []),
    ("Turnlog.LAB", ["turnlog.lab"], ["Turnlog.LAB"]),
    (" a.lab , ,B.lab ,", ["a.lab", "b.lab"], ["a.lab", "B.lab"]),
])
def test_comma_lists_are_parsed_at_load(monkeypatch: pytest.MonkeyPatch, text: str,
                                        hosts: list[str], keys: list[str]) -> None:
    monkeypatch.setenv("TURNLOG_ALLOWED_HOSTS", text)
    monkeypatch.setenv("TURNLOG_METRIC_KEYS", text)
    settings = Settings.load()
    assert settings.access.allowed_hosts == hosts  # Host names compare lower-case
    assert settings.history.metric_keys == keys


def test_tokens_are_a_table_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    other = "r-0123456789abcdef"
    monkeypatch.setenv("TURNLOG_API_TOKENS", f" {TOKEN}:write , ,{other}:read,")
    assert Settings.load().access.api_tokens == {TOKEN: "write", other: "read"}
    monkeypatch.setenv("TURNLOG_API_TOKENS", "")
    assert Settings.load().access.api_tokens == {}


def test_dotenv_is_read(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("TURNLOG_DATABASE_URL=sqlite:///from-dotenv.db\n"
                                   f"TURNLOG_API_TOKENS={TOKEN}:read\n"
                                   "TURNLOG_ALLOWED_HOSTS=a, b\nTURNLOG_MAX_NODES=7\n")
    settings = Settings.load()
    assert settings.store.database_url == "sqlite:///from-dotenv.db"
    assert settings.access.api_tokens == {TOKEN: "read"}
    assert settings.access.allowed_hosts == ["a", "b"]
    assert settings.limits.max_nodes == 7


def test_a_bad_token_names_its_entry_never_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNLOG_API_TOKENS", f"{TOKEN}:write, {TOKEN[::-1]}:admin")
    with pytest.raises(ValidationError) as info:
        Settings.load()
    for text in (str(info.value), describe_failure(info.value)):
        assert "TURNLOG_API_TOKENS entry 2 must be `token:read` or `token:write`" in text
        assert TOKEN not in text and TOKEN[::-1] not in text
    assert describe_failure(info.value).startswith("invalid setting TURNLOG_API_TOKENS:")


def test_a_bad_value_names_its_variable_without_echoing_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNLOG_POOL_SIZE", "secret-ish")
    with pytest.raises(ValidationError) as info:
        Settings.load()
    assert "secret-ish" not in str(info.value)
    assert describe_failure(info.value).startswith("invalid setting TURNLOG_POOL_SIZE:")


def test_replace_validates_and_does_not_read_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.load(database_url="sqlite:///a.db", max_nodes=3)
    monkeypatch.setenv("TURNLOG_MAX_NODES", "99")
    changed = settings.replace(host="10.0.0.1", allowed_hosts="X.lab, ", api_tokens=f"{TOKEN}:read")
    assert (changed.server.host, changed.access.allowed_hosts) == ("10.0.0.1", ["x.lab"])
    assert changed.access.api_tokens == {TOKEN: "read"}
    assert changed.limits.max_nodes == 3 and changed.store.database_url == "sqlite:///a.db"
    assert settings.server.host == "127.0.0.1"  # a copy
    with pytest.raises(ValidationError):
        settings.replace(api_tokens=f"{TOKEN}:admin")
    with pytest.raises(ValidationError):
        settings.replace(port=0)
    with pytest.raises(TypeError, match="no setting named 'database'"):
        settings.replace(database="x")


def test_settings_pickle_whole() -> None:
    """uvicorn hands them to each worker process pickled."""
    settings = Settings.load(database_url="sqlite:///a.db", api_tokens=f"{TOKEN}:write",
                             allowed_hosts="a", log_format="json")
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_secrets_stay_out_of_the_repr() -> None:
    settings = Settings.load(database_url="postgresql://u:pw-secret@h/db",
                             api_tokens=f"{TOKEN}:write")
    assert "pw-secret" not in repr(settings) and TOKEN not in repr(settings)


def test_a_group_commit_fits_the_positions_of_one_transaction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Migration 0012 gives a transaction 1024 event positions; a group of more appends
    # would fail every one of them at its 1025th event.
    assert Settings.load(group_commit_max_appends=1024).store.group_commit_max_appends == 1024
    monkeypatch.setenv("TURNLOG_GROUP_COMMIT_MAX_APPENDS", "1025")
    with pytest.raises(ValidationError) as info:
        Settings.load()
    assert describe_failure(info.value).startswith(
        "invalid setting TURNLOG_GROUP_COMMIT_MAX_APPENDS:")
