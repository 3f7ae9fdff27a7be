"""Everything dialect-specific in the store: connection set-up and SQL.

Each branch on SQLite versus PostgreSQL lives here, so the rest of the store
reads the same on both backends.

Connections. SQLite (embedded default): WAL, `foreign_keys=ON`,
`synchronous=FULL`, a busy timeout, and `BEGIN IMMEDIATE` for writes so a
writer never upgrades a read lock mid-transaction; it has a single writer
(`single_writer`), so in-process writers queue on an asyncio lock instead of
spinning on the busy timeout. PostgreSQL (asyncpg): READ COMMITTED,
pre-ping, statement and idle-in-transaction timeouts so no append can hold
the feed fence for long; plus a plain asyncpg pool with the same settings for
the append's one-round-trip call (`app/store/append/fastpath.py`). Every new
PostgreSQL connection of either first checks the store's clock (`reclock`);
every SQLite writer connection remembers the files it opened (`sqlite_files`).

SQL. PostgreSQL's feed fence: a reader takes only events whose writing
transaction id is below the oldest transaction still running in its snapshot
(`pg_snapshot_xmin(pg_current_snapshot())`, on the store's transaction clock:
the server's ids plus `turnlog_clock`'s offset, migration 0012), so an insert
that commits after a later one was read can never be skipped. SQLite has a single writer and its
rowid order is commit order, so it needs no fence. Also the append's row
lock, the consumer groups' locks (advisory, `SKIP LOCKED`, row locks), the
upsert, code-point text order, time buckets, Citus detection, R3 retention's
permission to empty patch data and VACUUM.

The horizon is read by a statement of its own, before the page query, and
bound as a value. On a single PostgreSQL that changes nothing (a transaction
below the horizon committed before it was read, so the page's later snapshot
sees it). On Citus it is what makes the fence valid at all: transaction ids
are per node, and a function in a query over distributed tables runs on the
workers, against the workers' own ids. turnlog's rows carry the
*coordinator's* transaction id (the column default is evaluated on the
coordinator, where every insert is planned), and the horizon must be the
coordinator's too. It holds because every write transaction of turnlog
touches one session, so one worker: Citus commits such a transaction on the
worker (one-phase commit) before the coordinator's own commit ends it, so
once the coordinator no longer sees it running, its rows are visible on the
worker. (A transaction spanning two workers would use two-phase commit,
whose COMMIT PREPARED follows the coordinator's commit; turnlog has none.)
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import asyncpg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.sql.elements import ColumnElement

from app.settings import Settings
from app.store.engine import sqlite_files
from app.store.engine.schema import events, sessions

# On the store's transaction clock (migration 0012): the server's ids plus the offset
# that keeps them ahead of rows a restored database carries from another server.
PG_XMIN = ("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint "
           "+ (SELECT xid_offset FROM turnlog_clock WHERE id = 1)")
CITUS_DETECT = "SELECT 1 FROM pg_extension WHERE extname = 'citus'"
# The store's clock ahead of every stamped row (`turnlog_reclock()`, migration 0012): run
# by every migration run that ends before 0014 (a downgrade's target; from 0014 on,
# RECLOCK_ON_CONNECT). A revision before 0012 has no clock: nothing to do.
RECLOCK = ("DO $$ BEGIN IF to_regproc('turnlog_reclock') IS NOT NULL AND "
           "to_regproc('turnlog_reclock_after_start') IS NULL THEN "
           "PERFORM turnlog_reclock(); END IF; END $$")
# On a new connection: 0014's reclock, once after each crash or start of the server (the
# first connection then reads every row's shard; the others one local row). Nothing on a
# store not migrated to 0014: 0012's reclock moved the clock with no cause on Citus
# under concurrent writers (its one statement is not one snapshot there).
RECLOCK_ON_CONNECT = (
    "DO $$ BEGIN IF to_regproc('turnlog_reclock_after_start') IS NOT NULL THEN "
    "PERFORM turnlog_reclock_after_start(); END IF; END $$")


def _is_postgres(conn: AsyncConnection) -> bool:
    return conn.dialect.name == "postgresql"


# -- connections ------------------------------------------------------------------

def normalize_url(url: str) -> str:
    """Accept plain `postgres://`, `postgresql://` and `sqlite://` URLs and pick the
    async drivers (`postgres://` is what Heroku-style environments hand out)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgres":
        parsed, backend = parsed.set(drivername="postgresql+asyncpg"), "postgresql"
    if backend == "postgresql" and parsed.drivername != "postgresql+asyncpg":
        parsed = parsed.set(drivername="postgresql+asyncpg")
    elif backend == "sqlite" and parsed.drivername != "sqlite+aiosqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    elif backend not in ("postgresql", "sqlite"):
        raise ValueError(f"unsupported database {backend!r}: use sqlite or postgresql")
    return parsed.render_as_string(hide_password=False)


def sqlite_path(url: str) -> str | None:
    """The database file of a SQLite URL (None: in memory)."""
    database = make_url(url).database
    return None if database in (None, "", ":memory:") else database


# How long a SQLite write may wait in all, in this process's queue of writers and then
# for the file's write lock another process holds (SQLite's busy timeout).
SQLITE_BUSY_S = 60
# What is left of that for the file's lock, in ms, for a write that waited in the queue
# first (None: the full busy timeout); `Database` sets it around each SQLite write.
sqlite_busy_budget: ContextVar[int | None] = ContextVar("sqlite_busy_budget", default=None)
_BUSY_LOWERED = "turnlog_busy_lowered"  # a connection record's: its busy timeout is lowered


def busy_pragma(info: dict[str, Any]) -> str | None:
    """The `PRAGMA busy_timeout` a SQLite writer connection (its record's `info`) needs
    before this write's `BEGIN IMMEDIATE`: the write's remaining budget, or the full
    timeout again after an earlier write lowered it; None when it has it already."""
    budget = sqlite_busy_budget.get()
    if budget is None and not info.get(_BUSY_LOWERED):
        return None
    info[_BUSY_LOWERED] = budget is not None
    return f"PRAGMA busy_timeout={SQLITE_BUSY_S * 1000 if budget is None else budget}"


def _sqlite_engine(url: str, *, immediate: bool) -> AsyncEngine:
    engine = create_async_engine(url, connect_args={"timeout": SQLITE_BUSY_S}, poolclass=NullPool
                                 if ":memory:" in url else None)
    path = sqlite_path(url)
    first: dict[str, Any] = {}  # the file the engine's first connection opened

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # The busy timeout first: `journal_mode` waits for a lock another process holds
        # too. A connection opened for a write that waited in the queue gets what is left
        # of the write's budget (`busy_pragma` restores the full one for the next).
        budget = sqlite_busy_budget.get() if immediate else None
        record.info[_BUSY_LOWERED] = budget is not None
        for pragma in (f"busy_timeout={SQLITE_BUSY_S * 1000 if budget is None else budget}",
                       "journal_mode=WAL", "foreign_keys=ON", "synchronous=FULL"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()
        if immediate and path is not None:
            sqlite_files.remember(record.info, path, first)

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        pragma = busy_pragma(conn.connection.info) if immediate else None
        if pragma is not None:
            conn.exec_driver_sql(pragma)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


# Seconds an idle driver-pool connection is kept (create_driver_pool); the engine's
# `pool_recycle` is the same.
IDLE_LIFETIME_S = 1800


def _server_settings(settings: Settings) -> dict[str, str]:
    server_settings = {
        "application_name": "turnlog",
        "idle_in_transaction_session_timeout": "30000",
    }
    if settings.store.statement_timeout_ms:
        server_settings["statement_timeout"] = str(settings.store.statement_timeout_ms)
    return server_settings


async def reclock(conn: asyncpg.Connection) -> None:
    """Move the store's clock past every stamped row if the server's ids are behind
    them; in normal operation it moves nothing (the rows' ids are read before the
    server's next id: every id seen is below it).

    Run on every new connection, before its first write, and not only by `turnlog
    migrate`: the server's ids can fall behind the rows while turnlog runs. On
    Citus a writer's id is the coordinator's, whose own transaction writes no WAL
    of its own, so its commit is not flushed: a coordinator that crashes hands out
    again the ids of its last ~200 ms of commits, already stamped on durable
    worker rows — and positions would repeat and fall within a session. Every
    connection of a process is new after such a crash (as after a restore onto
    another server), so no write is stamped before the clock has moved.

    Only the first connection after the server crashed or (re)started does the
    full check, which on Citus reads every shard (so it needs every worker up,
    ~40 ms); the others read one row of the coordinator's, so a worker down keeps
    failing only the sessions it holds.
    """
    await conn.execute(RECLOCK_ON_CONNECT)


def _postgres_engine(url: str, settings: Settings) -> AsyncEngine:
    server_settings = _server_settings(settings)
    engine = create_async_engine(
        url,
        pool_size=settings.store.pool_size,
        max_overflow=settings.store.max_overflow,
        pool_pre_ping=True,
        pool_recycle=IDLE_LIFETIME_S,
        isolation_level="READ COMMITTED",
        connect_args={"server_settings": server_settings, "command_timeout": 120},
    )

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.run_async(reclock)

    return engine


def backend(url: str) -> str:
    """`sqlite` or `postgresql`, from a (normalized) URL."""
    return make_url(url).get_backend_name()


def file_integrity_checkable(url: str) -> bool:
    """SQLite: the database is one file that `PRAGMA quick_check` can verify at start."""
    return backend(url) == "sqlite"


def single_writer(url: str) -> bool:
    """SQLite: one writer at a time, so writes are queued in process."""
    return backend(url) == "sqlite"


def create_engines(url: str, settings: Settings) -> tuple[AsyncEngine, AsyncEngine]:
    """(writer, reader) engines for a normalized URL; one shared pool on PostgreSQL."""
    if single_writer(url):
        return _sqlite_engine(url, immediate=True), _sqlite_engine(url, immediate=False)
    engine = _postgres_engine(url, settings)
    return engine, engine


async def create_driver_pool(url: str, settings: Settings,
                             warm: ConnectionWarmer | None = None) -> asyncpg.Pool | None:
    """A plain asyncpg pool for the append's one-round-trip call (PostgreSQL; None on
    SQLite), with the engine's session settings.

    Separate from SQLAlchemy's pool because a checkout there pays a ping round
    trip (`pool_pre_ping`); asyncpg's pool drops a broken connection when it is
    released and opens a new one on demand, so a restarted server needs no ping.

    Idle connections stay open for 30 minutes, as SQLAlchemy's are recycled
    (asyncpg closes them after 5 by default): a rollout's sessions start
    together after a training phase that often lasts longer than 5, and
    opening their connections then would add ~5 ms to each first turn, more
    when eight connect at once. One the server ends is noticed when its socket
    closes and replaced on the next acquire; the 30 minutes bound how long a
    flow a middlebox dropped silently is kept. Its transactions are READ
    COMMITTED whatever the database's default, as the engine's are: the
    functions rely on it (a conflicting open reads the row that won). `warm`: run
    on each new connection after its plan setting (PostgreSQL, not Citus).
    """
    if backend(url) != "postgresql":
        return None
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    return await asyncpg.create_pool(
        dsn, min_size=0, max_size=settings.store.pool_size, command_timeout=120,
        max_inactive_connection_lifetime=IDLE_LIFETIME_S,
        server_settings={**_server_settings(settings),
                         "default_transaction_isolation": "read committed"},
        init=functools.partial(_prepare_driver_connection, warm=warm),
        reset=_nothing_to_reset)


# The driver pool's calls plan once (PostgreSQL; not Citus). A parameterized statement
# is planned again for its first five runs on a connection ("custom plans", made for
# that call's values), and so is every statement inside a PL/pgSQL function; for
# `turnlog_append` the values include a 0.8 MB R3 patch. Measured in the PostgreSQL
# log with the gateway's benchmark (8 sessions, three runs): a connection's first five
# appends took 1.8-2.6 ms to bind and 8.3-10.0 ms to run; with generic plans from the
# first call 0.4-0.7 and 6.0-7.8; later calls cost the same either way
# (docs/ingest.md). Every statement these functions run looks rows up by key, so one
# plan fits every call.
# Citus plans a distributed statement's route from its parameters; its functions keep
# the server's default.
GENERIC_PLANS = ("SELECT set_config('plan_cache_mode', 'force_generic_plan', false) "
                 "WHERE NOT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')")


# What makes a new driver-pool connection's first calls as quick as its later ones
# (`app/store/append/warm.py`), given by the writer that owns the calls.
ConnectionWarmer = Callable[[asyncpg.Connection], Awaitable[object]]


async def _prepare_driver_connection(conn: asyncpg.Connection,
                                     warm: ConnectionWarmer | None = None) -> None:
    """A new driver-pool connection: the clock checked (`reclock`), generic plans, and
    its functions run once (`warm`), on PostgreSQL but not Citus."""
    await reclock(conn)
    if await conn.fetchval(GENERIC_PLANS) is not None and warm is not None:
        await warm(conn)


async def _nothing_to_reset(_conn: asyncpg.Connection) -> None:
    """The driver pool's release step, in place of asyncpg's default reset query
    (`pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`): one more round
    trip after every append's commit, before its caller is answered. The pool's
    connections only ever call `turnlog_append` / `turnlog_try_append` in their own
    transactions — no session locks, cursors, LISTENs or SETs to undo; asyncpg still
    rolls back a transaction left open before this runs."""


# -- SQL --------------------------------------------------------------------------

async def feed_fence(
    conn: AsyncConnection, xid: ColumnElement[int] = events.c.xid
) -> ColumnElement[bool] | None:
    """Rows of transactions that can no longer commit behind a reader (PG only)."""
    if not _is_postgres(conn):
        return None
    return xid < await _horizon(conn)


async def _horizon(conn: AsyncConnection) -> int:
    """The coordinator's transaction horizon, read by a statement of its own (see above)."""
    return int((await conn.execute(sa.text(PG_XMIN))).scalar_one())


async def fence_lag_seconds(conn: AsyncConnection, now_us: int) -> float:
    """How far the feed fence holds readers back, in seconds (0.0 on SQLite).

    The larger of: how long the oldest committed event still behind the fence
    has waited (from the events table: needs no grant, sees every role's
    writes), and the age of the oldest running transaction with an xid that
    `pg_stat_activity` shows (without `pg_read_all_stats` only this role's own:
    other roles' `xact_start` reads NULL, which is why the first part exists).
    """
    if not _is_postgres(conn):
        return 0.0
    held_us = (await conn.execute(
        sa.select(sa.func.min(events.c.recorded_us)).where(events.c.xid >= await _horizon(conn))
    )).scalar()
    running = (await conn.execute(sa.text(
        "SELECT EXTRACT(EPOCH FROM clock_timestamp() - min(xact_start)) "
        "FROM pg_stat_activity WHERE backend_xid IS NOT NULL"
    ))).scalar()
    held = 0.0 if held_us is None else max(0.0, (now_us - int(held_us)) / 1e6)
    return max(held, float(running or 0.0))


def lock_for_append(conn: AsyncConnection, query: sa.Select[Any]) -> sa.Select[Any]:
    """The session row read that serializes appends (SQLite's single writer already does)."""
    if _is_postgres(conn):
        # NO KEY UPDATE: serializes appends without blocking inserts that only
        # reference the session row (foreign keys take KEY SHARE locks).
        return query.with_for_update(key_share=True)
    return query


LOCK_SESSION = "SELECT id FROM sessions WHERE session_id = $1 FOR NO KEY UPDATE"

# A session's writers queue here before they lock its row (migration 0012; the same
# key in `turnlog_append`). A writer woken from the row lock takes its transaction id,
# and under READ COMMITTED may then find the updated row locked by a newcomer and wait
# again: its id is older than the newcomer's, whose write commits first, and its
# events (the feed's order, their positions) would come first. An advisory lock takes
# no transaction id, and queued writers reach the row one at a time: ids — and
# positions — follow each session's commit order.
SESSION_WRITERS = "SELECT pg_advisory_xact_lock(29804, hashtext(:session_id))"

# One migrating process at a time (`pg_advisory_lock`, held by `turnlog migrate`'s
# judging connection while another connection migrates): a key nothing else takes. It
# was the consumer groups' lock's, which a close takes after writing its event, so a
# close waited for the migration while the migration's DDL waited for that close's
# locks — a wait PostgreSQL cannot see as a deadlock (the holder is the migrating
# process's idle connection), ended only by the server's statement timeout, failing the
# close. The store's advisory keys: (29804, hashtext(session_id)) a session's writers,
# (29805, 0) the reclock (migration 0014), (29806, 0) this; and one bigint key,
# GROUPS_LOCK_KEY (app/store/handoff/consumers.py: closes and rewards shared, a group's
# definition exclusive). A bigint key and an (int, int) key never conflict: PostgreSQL
# keeps the two forms apart.
MIGRATION_LOCK = "29806, 0"


async def queue_for_session(conn: AsyncConnection, session_id: str) -> None:
    """Wait for `session_id`'s writers before this one (PostgreSQL; SQLite's single
    writer already orders them), held to the end of the transaction."""
    if _is_postgres(conn):
        await conn.execute(sa.text(SESSION_WRITERS), {"session_id": session_id})


async def lock_sessions(conn: AsyncConnection, session_ids: Sequence[str]) -> None:
    """Lock several sessions' rows as an append locks one, in the order given.

    PostgreSQL: one statement per session (Citus routes a lock only by
    `session_id = $1`); the first through SQLAlchemy, which opens the
    transaction, the rest pipelined on the driver connection in one trip.
    SQLite: nothing to do, the write transaction (`BEGIN IMMEDIATE`) already
    excludes every other writer.
    """
    if not _is_postgres(conn) or not session_ids:
        return
    first, *rest = session_ids
    await conn.execute(lock_for_append(
        conn, sa.select(sessions.c.id).where(sessions.c.session_id == first)))
    if rest:
        raw = await _driver_connection(conn)
        await raw.executemany(LOCK_SESSION, [(sid,) for sid in rest])


async def bulk_insert(
    conn: AsyncConnection, table: sa.Table, rows: Sequence[Mapping[str, Any]]
) -> None:
    """Insert rows of one shape (the keys of the first) in the connection's transaction.

    PostgreSQL: COPY on the driver connection, without SQLAlchemy's statement
    building and binding (Citus accepts COPY into a distributed table and routes
    each row to its shard); SQLite: one executemany.
    """
    if not rows:
        return
    if not _is_postgres(conn):
        await conn.execute(table.insert(), list(rows))
        return
    raw = await _driver_connection(conn)
    columns = list(rows[0])
    await raw.copy_records_to_table(
        table.name, columns=columns, records=[tuple(row[c] for c in columns) for row in rows])


async def _driver_connection(conn: AsyncConnection) -> asyncpg.Connection:
    """The asyncpg connection under `conn`, inside `conn`'s open transaction."""
    raw = (await conn.get_raw_connection()).driver_connection
    assert isinstance(raw, asyncpg.Connection) and raw.is_in_transaction(), \
        "a statement through SQLAlchemy must have opened the transaction first"
    return raw


def lock_rows(query: sa.Select[Any]) -> sa.Select[Any]:
    """`FOR UPDATE` on PostgreSQL; SQLite's single writer already holds every row
    (SQLAlchemy renders no lock clause there)."""
    return query.with_for_update()


def skip_locked(query: sa.Select[Any]) -> sa.Select[Any]:
    """`FOR UPDATE SKIP LOCKED` on PostgreSQL: rows another transaction holds are
    passed over, not waited for; SQLite has a single writer, so nothing is held."""
    return query.with_for_update(skip_locked=True)


async def advisory_xact_lock(conn: AsyncConnection, key: int, shared: bool) -> None:
    """A transaction-scoped advisory lock on `key`, shared or exclusive (PostgreSQL);
    SQLite's single writer serializes the transactions already."""
    if _is_postgres(conn):
        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        await conn.execute(sa.text(f"SELECT {fn}(:key)"), {"key": key})


def upsert(
    conn: AsyncConnection, table: sa.Table, values: Sequence[Mapping[str, Any]],
    index_elements: Sequence[str], update: Sequence[str],
) -> Any:
    """INSERT … ON CONFLICT (index_elements) DO UPDATE SET the `update` columns."""
    insert = postgresql.insert if _is_postgres(conn) else sqlite.insert
    stmt = insert(table).values(list(values))
    return stmt.on_conflict_do_update(
        index_elements=list(index_elements),
        set_={name: stmt.excluded[name] for name in update},
    )


def code_point_order(conn: AsyncConnection, text: ColumnElement[Any]) -> ColumnElement[Any]:
    """`text` compared by code point on both dialects.

    SQLite's default BINARY collation compares UTF-8 bytes (code point order);
    PostgreSQL's database collation may be linguistic, so it is pinned to "C".
    """
    return text.collate("C") if _is_postgres(conn) else text


def time_bucket(conn: AsyncConnection, seconds_since_epoch: ColumnElement[Any],
                seconds: int) -> ColumnElement[Any]:
    """The index of the `seconds`-long bucket a time falls in, as an integer.

    PostgreSQL floors; SQLite's cast truncates, which is the floor for the
    positive times records carry.
    """
    if _is_postgres(conn):
        return sa.cast(sa.func.floor(seconds_since_epoch / seconds), sa.BigInteger)
    return sa.cast(seconds_since_epoch / seconds, sa.Integer)


# -- Citus and R3 retention ---------------------------------------------------------

def has_citus(connection: Connection) -> bool:
    """True when the database has the Citus extension (asked by the migrations)."""
    if connection.dialect.name != "postgresql":
        return False
    return connection.execute(sa.text(CITUS_DETECT)).first() is not None


async def citus_detected(conn: AsyncConnection) -> bool:
    """`has_citus` on an async connection (False on SQLite without asking)."""
    if not _is_postgres(conn):
        return False
    return (await conn.execute(sa.text(CITUS_DETECT))).first() is not None


async def permit_r3_prune(conn: AsyncConnection, citus: bool) -> None:
    """Let this transaction empty R3 patch data (the immutability trigger of migration
    0005): on PostgreSQL the transaction-local setting `turnlog.r3_prune`, set first
    so that on Citus (`citus`) it is propagated to the worker before the statements
    there; SQLite's trigger asks for the session's mark instead, set by the caller."""
    if not _is_postgres(conn):
        return
    if citus:
        await conn.execute(sa.text("SET LOCAL citus.propagate_set_commands = 'local'"))
    await conn.execute(sa.text("SET LOCAL turnlog.r3_prune = 'on'"))


async def vacuum(engine: AsyncEngine, table: str) -> None:
    """Make the pages of a table's dead tuples reusable now rather than at autovacuum's
    next pass (PostgreSQL and Citus); SQLite reuses freed pages by itself."""
    if engine.dialect.name != "postgresql":
        return
    async with engine.connect() as conn:
        auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
        await auto.execute(sa.text(f"VACUUM {table}"))
