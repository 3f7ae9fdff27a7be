"""Runtime settings, read from `TURNLOG_*` environment variables (pydantic-settings).

`Settings` is a plain model of groups, one per part that reads them: `store`
(the database), `cache` (the per-process state cache), `server` (the
connections of `turnlog serve`), `limits` (request bodies and sessions),
`access` (API tokens and Host names), `log`, `ui`, `history`. Each group is its
own `BaseSettings` with the prefix `TURNLOG_`, so a field's environment variable
is `TURNLOG_` + its name, exactly as in the flat layout before (`TURNLOG_DATABASE_URL`
is `store.database_url`), and each reads `.env` itself. Lists and the token table
are parsed once, here, when the settings are loaded: readers get `list[str]` and
`dict[str, Scope]`, never a comma-separated string.

A `Settings` object is the whole configuration of a server process: `turnlog serve`
hands it (pickled) to uvicorn's worker processes instead of writing the
environment. `Settings.load(**flat)` and `settings.replace(**flat)` take the flat
names (the variable names without the prefix), so callers need not know the groups.

Refuses: echoing a setting's value in an error (it may hold a token or a database
password: `hide_input_in_errors`).
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./turnlog.db"

Scope = Literal["read", "write"]
SCOPES: tuple[Scope, ...] = ("read", "write")
# RFC 6750 b64token characters (no ':' or ','), long enough to be a secret.
TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*\Z")  # fullmatch: `$` allows a "\n"
MIN_TOKEN_CHARS = 16


def parse_api_tokens(text: str) -> dict[str, Scope]:
    """`TURNLOG_API_TOKENS`: comma-separated `token:scope` pairs, scope `read` or `write`.

    Errors name the entry by position, never echo a token.
    """
    tokens: dict[str, Scope] = {}
    for index, entry in enumerate(text.split(","), start=1):
        entry = entry.strip()
        if not entry:
            continue
        token, sep, scope = entry.rpartition(":")
        where = f"TURNLOG_API_TOKENS entry {index}"
        if not sep or scope not in SCOPES:
            raise ValueError(f"{where} must be `token:read` or `token:write`")
        if len(token) < MIN_TOKEN_CHARS or not TOKEN_RE.fullmatch(token):
            raise ValueError(f"{where}: a token is at least {MIN_TOKEN_CHARS} characters of "
                             "[A-Za-z0-9-._~+/] (optionally ending in '=')")
        if token in tokens:
            raise ValueError(f"{where} repeats an earlier token")
        tokens[token] = "write" if scope == "write" else "read"
    return tokens


def split_commas(value: Any) -> Any:
    """A comma-separated variable as a list: entries stripped, empty entries dropped.
    A list (a copy of loaded settings, a caller's keyword) is only stripped the same way."""
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, list | tuple | set | frozenset):
        return [item.strip() for item in value if isinstance(item, str) and item.strip()]
    return value  # anything else: pydantic refuses it as not a list


# Environment variables are strings: without NoDecode pydantic-settings would expect JSON.
CommaList = Annotated[list[str], NoDecode]


class _Group(BaseSettings):
    # Inputs stay out of error messages: they may hold tokens or database passwords.
    model_config = SettingsConfigDict(env_prefix="TURNLOG_", env_file=".env", extra="ignore",
                                      hide_input_in_errors=True)


class StoreSettings(_Group):
    """The database and what is done to it at start."""

    database_url: str = Field(default=DEFAULT_DATABASE_URL, repr=False)  # may hold a password
    pool_size: int = Field(default=10, ge=1)
    max_overflow: int = Field(default=10, ge=0)
    statement_timeout_ms: int = Field(default=60_000, ge=0)
    migrate_on_start: bool = True
    # SQLite: `PRAGMA quick_check` at start (turn off for very large files).
    integrity_check: bool = True
    # PostgreSQL group commit (docs/ingest.md): appends of different sessions arriving
    # while a commit is in flight share the next one, collected for at most this many
    # microseconds (0 = off: one transaction per append), appends and argument bytes.
    group_commit_window_us: int = Field(default=1000, ge=0, le=100_000)
    # At most 1024: a transaction id spans 1024 event positions (migration 0012), and
    # a group is one transaction writing one event per append.
    group_commit_max_appends: int = Field(default=32, ge=1, le=1024)
    group_commit_max_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    # An append waits for a group only while this many of the process's appends (or
    # groups) are in flight; with fewer it runs alone, in parallel (docs/ingest.md).
    group_commit_siblings: int = Field(default=5, ge=1)


class CacheSettings(_Group):
    """The per-process cache of folded session states."""

    state_cache_sessions: int = Field(default=512, ge=0)
    # The state cache is bounded in bytes too (token arrays and facts of cached sessions).
    state_cache_bytes: int = Field(default_factory=lambda: default_state_cache_bytes(), ge=0)


class ServerSettings(_Group):
    """Where `turnlog serve` listens and its connection limits (docs/operations.md,
    "Limits and timeouts"): request headers are bounded before anything else runs,
    slow clients are cut off."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    max_headers: int = Field(default=100, ge=8)
    header_timeout_s: float = Field(default=10.0, gt=0)
    keep_alive_timeout_s: int = Field(default=5, ge=1)
    limit_concurrency: int = Field(default=1000, ge=0)  # 0 = no limit


class LimitSettings(_Group):
    """What one request body and one session may be."""

    max_body_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    body_timeout_s: float = Field(default=30.0, gt=0)
    # Bodies above this many bytes are parsed on a worker thread, at most
    # `max_large_uploads` at a time, so they never stall the event loop.
    large_body_bytes: int = Field(default=1024 * 1024, ge=0)
    # A JSON or MessagePack body that would decode into more values (containers, keys,
    # scalars) is refused (413) before it is decoded: it bounds the decoded memory.
    max_body_values: int = Field(default=2_000_000, ge=1000)
    max_large_uploads: int = Field(default=2, ge=1)
    # Turn bodies above this many bytes are decoded, validated and encoded on a worker
    # thread, and so are those above `large_body_bytes` once their R3 payload is set
    # aside; the rest on the event loop, where a 2k-token turn's ~2 ms of work costs
    # less than the two thread hand-offs would (docs/ingest.md).
    offload_body_bytes: int = Field(default=16 * 1024 * 1024, ge=0)
    # Every body (and a large one holding an upload slot) must keep arriving: byte n by
    # `upload_grace_s + n / min_upload_rate` seconds after its first read, or 408.
    min_upload_rate: int = Field(default=64 * 1024, ge=0)  # bytes/s; 0 = no minimum
    upload_grace_s: float = Field(default=10.0, gt=0)
    max_nodes: int = Field(default=1024, ge=1)  # nodes of one session


class AccessSettings(_Group):
    """Who is answered: API tokens, and the Host names served without them."""

    # `TURNLOG_API_TOKENS`: comma-separated `token:scope` pairs (scope `read` or `write`);
    # empty = no auth. Parsed here, so a bad entry stops start-up (naming the entry).
    api_tokens: Annotated[dict[str, Scope], NoDecode] = Field(default_factory=dict, repr=False)
    # Without tokens only loopback Host names are served; more names, comma-separated.
    allowed_hosts: CommaList = Field(default_factory=list)

    @field_validator("api_tokens", mode="before")
    @classmethod
    def _parse_tokens(cls, value: Any) -> Any:
        return parse_api_tokens(value) if isinstance(value, str) else value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        hosts = split_commas(value)
        return [host.lower() for host in hosts] if isinstance(hosts, list) else hosts


class LogSettings(_Group):
    """Logs on stderr (app.logs), in every process."""

    # auto = readable on a terminal, JSON lines otherwise.
    log_format: Literal["auto", "json", "console"] = "auto"
    # None: `info` for `turnlog serve`, `warning` for the other commands.
    log_level: Literal["debug", "info", "warning", "error"] | None = None


class UiSettings(_Group):
    # A local tokenizer.json: the UI shows token text beside the ids (needs the optional
    # `tokenizers` package); empty = ids only.
    tokenizer: str = ""


class HistorySettings(_Group):
    # Metric-history whitelist, comma-separated; empty = DEFAULT_METRIC_KEYS.
    metric_keys: CommaList = Field(default_factory=list)

    @field_validator("metric_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        return split_commas(value)


class Settings(BaseModel):
    """Every group, each read from the environment (and `.env`) when not given."""

    store: StoreSettings = Field(default_factory=StoreSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    access: AccessSettings = Field(default_factory=AccessSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    ui: UiSettings = Field(default_factory=UiSettings)
    history: HistorySettings = Field(default_factory=HistorySettings)

    GROUPS: ClassVar[tuple[str, ...]] = ("store", "cache", "server", "limits", "access",
                                         "log", "ui", "history")

    @classmethod
    def load(cls, **flat: Any) -> Settings:
        """The environment's settings, with `flat` (names as in the environment, without
        `TURNLOG_`: `database_url=…`) taking precedence, as keyword arguments of the flat
        layout did."""
        by_group = _by_group(flat)
        return cls(**{name: cls._group_type(name)(**by_group.get(name, {}))
                      for name in cls.GROUPS})

    def replace(self, **flat: Any) -> Settings:
        """A copy with `flat` (names as in `load`) changed, validated as if loaded."""
        groups: dict[str, Any] = {}
        for name, changes in _by_group(flat).items():
            group = getattr(self, name)
            # model_validate, not the constructor: the environment is not read again.
            groups[name] = type(group).model_validate({**dict(group), **changes})
        return self.model_copy(update=groups)

    @classmethod
    def _group_type(cls, name: str) -> type[_Group]:
        annotation = cls.model_fields[name].annotation
        assert isinstance(annotation, type) and issubclass(annotation, _Group)
        return annotation


def _by_group(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        for name in Settings.GROUPS:
            if key in Settings._group_type(name).model_fields:
                groups.setdefault(name, {})[key] = value
                break
        else:
            raise TypeError(f"no setting named {key!r}")
    return groups


def default_state_cache_bytes() -> int:
    """An eighth of physical memory (256 MiB if it cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 2 * 1024**3
    return max(64 * 1024**2, total // 8)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings.load()
