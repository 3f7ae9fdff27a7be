"""Runtime settings, read from `TURNLOG_*` environment variables (pydantic-settings)."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./turnlog.db"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TURNLOG_", env_file=".env", extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_body_bytes: int = Field(default=512 * 1024 * 1024, ge=1)
    max_nodes: int = Field(default=1024, ge=1)
    pool_size: int = Field(default=10, ge=1)
    max_overflow: int = Field(default=10, ge=0)
    statement_timeout_ms: int = Field(default=60_000, ge=0)
    state_cache_sessions: int = Field(default=512, ge=0)
    api_tokens: str = ""
    migrate_on_start: bool = True
    # Metric-history whitelist, comma-separated; empty = DEFAULT_METRIC_KEYS.
    metric_keys: str = ""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
