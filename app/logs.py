"""Structured logs on stderr, for turnlog's and uvicorn's records: readable lines on a
terminal, one JSON object per line otherwise (`TURNLOG_LOG_FORMAT` / `--log-format`
= auto | json | console), at `TURNLOG_LOG_LEVEL` / `--log-level`.

structlog renders turnlog's own events; the standard library's records
(uvicorn's error and access logs, SQLAlchemy, alembic) go through the same
processor chain via `ProcessorFormatter`, so a log shipper sees one format.
Every `turnlog` command calls `configure_logging` first (`serve` also hands
uvicorn `log_config=None` so it keeps this configuration); stdout stays for
results. Tests never call
it: structlog's defaults and `structlog.testing.capture_logs` suffice there.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from structlog.types import Processor

from app.domain.wire.url_tokens import REDACTED, redact_query

__all__ = ["REDACTED", "RedactTokens", "configure_logging", "redact_query"]

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class RedactTokens(logging.Filter):
    """Keeps tokens sent in a URL out of uvicorn's access log (the request is refused
    anyway, but the access line is written first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a
                                for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True

class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (a test runner swaps it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


LOG_FORMATS = ("auto", "json", "console")
# `json` asked for by name (`--log-format json`, TURNLOG_LOG_FORMAT=json): then the
# commands' own stderr lines go out as log records too (`app.cli.common.say`), so that
# stderr is JSON lines throughout. `auto` leaves them as the text a person reads.
_json_asked = [False]


def json_asked() -> bool:
    """Whether the last `configure_logging` was given `json` by name."""
    return _json_asked[0]
LOG_LEVELS = ("debug", "info", "warning", "error")


class QuietMigrationContext(logging.Filter):
    """Drops the two lines alembic logs each time it reads a database's schema
    revision ("Context impl …", "Will assume … DDL"): `/readyz` reads it on every
    probe, so a load balancer's checks filled the log with them. Its migration
    steps ("Running upgrade …") still show."""

    NOISE = ("Context impl %s.", "Will assume %s DDL.")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.NOISE


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Route every log record to stderr, rendered as `fmt` (auto: console on a TTY)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    _json_asked[0] = fmt == "json"
    console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: Processor = (structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
                           if console else structlog.processors.JSONRenderer())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *([] if console else [structlog.processors.format_exc_info]),
            renderer,
        ],
    )
    # What no line shows is not gathered for every record: where the call was made (a
    # frame walk through structlog's own frames), the thread's and the process's names
    # (the logging module's documented switches). ~30 % of an access line's CPU. A
    # standard-library logger's `stack_info=True` then shows no stack (turnlog's own
    # events keep theirs: structlog renders it, StackInfoRenderer above).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = _Stderr()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    # alembic announces every plugin it loads at INFO; its migration steps stay visible.
    logging.getLogger("alembic.runtime.plugins").setLevel("WARNING")
    migration = logging.getLogger("alembic.runtime.migration")
    if not any(isinstance(f, QuietMigrationContext) for f in migration.filters):
        migration.addFilter(QuietMigrationContext())
    for name in UVICORN_LOGGERS:
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers = []
        uvicorn_logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactTokens) for f in access.filters):
        access.addFilter(RedactTokens())
