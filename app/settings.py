"""Runtime settings, read from `TURNLOG_*` environment variables (pydantic-settings)."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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


class Settings(BaseSettings):
    # Inputs stay out of error messages: they may hold tokens or database passwords.
    model_config = SettingsConfigDict(env_prefix="TURNLOG_", env_file=".env", extra="ignore",
                                      hide_input_in_errors=True)

    database_url: str = DEFAULT_DATABASE_URL
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_body_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    max_nodes: int = Field(default=1024, ge=1)
    pool_size: int = Field(default=10, ge=1)
    max_overflow: int = Field(default=10, ge=0)
    statement_timeout_ms: int = Field(default=60_000, ge=0)
    state_cache_sessions: int = Field(default=512, ge=0)
    # The state cache is bounded in bytes too (token arrays and facts of cached sessions).
    state_cache_bytes: int = Field(default_factory=lambda: default_state_cache_bytes(), ge=0)
    # Connection limits of `turnlog serve` (docs/operations.md, "Limits and timeouts"):
    # request headers are bounded before anything else runs, slow clients are cut off.
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    max_headers: int = Field(default=100, ge=8)
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    keep_alive_timeout_s: int = Field(default=5, ge=1)
    limit_concurrency: int = Field(default=1000, ge=0)  # 0 = no limit
    # Bodies above this many bytes are parsed on a worker thread, at most
    # `max_large_uploads` at a time, so they never stall the event loop.
    large_body_bytes: int = Field(default=1024 * 1024, ge=0)
    # A JSON or MessagePack body that would decode into more values (containers, keys,
    # scalars) is refused (413) before it is decoded: it bounds the decoded memory.
    max_body_values: int = Field(default=2_000_000, ge=1000)
    max_large_uploads: int = Field(default=2, ge=1)
    # A large body (one holding an upload slot) must keep arriving: its byte n by
    # `upload_grace_s + n / min_upload_rate` seconds after its first read, or 408.
    min_upload_rate: int = Field(default=64 * 1024, ge=0)  # bytes/s; 0 = no minimum
    upload_grace_s: float = Field(default=10.0, gt=0)
    # PostgreSQL group commit (docs/ingest.md): appends of different sessions arriving
    # while a commit is in flight share the next one, collected for at most this many
    # microseconds (0 = off: one transaction per append), appends and argument bytes.
    group_commit_window_us: int = Field(default=1000, ge=0, le=100_000)
    group_commit_max_appends: int = Field(default=32, ge=1)
    group_commit_max_bytes: int = Field(default=16 * 1024 * 1024, ge=1)
    # Without tokens only loopback Host names are served; more names, comma-separated.
    allowed_hosts: str = ""
    # A local tokenizer.json: the UI shows token text beside the ids (needs the optional
    # `tokenizers` package); empty = ids only.
    tokenizer: str = ""
    # SQLite: `PRAGMA quick_check` at start (turn off for very large files).
    integrity_check: bool = True
    # Comma-separated `token:scope` pairs (scope `read` or `write`); empty = no auth.
    api_tokens: str = ""
    migrate_on_start: bool = True
    # Metric-history whitelist, comma-separated; empty = DEFAULT_METRIC_KEYS.
    metric_keys: str = ""
    # Logs on stderr: auto = readable on a terminal, JSON lines otherwise.
    log_format: Literal["auto", "json", "console"] = "auto"
    # None: `info` for `turnlog serve`, `warning` for the other commands.
    log_level: Literal["debug", "info", "warning", "error"] | None = None

    @field_validator("api_tokens")
    @classmethod
    def _valid_api_tokens(cls, value: str) -> str:
        parse_api_tokens(value)
        return value

    @property
    def extra_hosts(self) -> list[str]:
        return [h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()]

    @property
    def token_scopes(self) -> dict[str, Scope]:
        return parse_api_tokens(self.api_tokens)


def default_state_cache_bytes() -> int:
    """An eighth of physical memory (256 MiB if it cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 2 * 1024**3
    return max(64 * 1024**2, total // 8)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
