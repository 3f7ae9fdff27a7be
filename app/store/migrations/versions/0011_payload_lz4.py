"""A turn's payload compressed with LZ4 rather than pglz (PostgreSQL built with LZ4).

An event's `payload` (a 2k-token turn's record without its prompt and R3:
~20 KB of JSON, mostly the output's logprobs) is TOASTed and compressed on
every append. With PostgreSQL's default, pglz, that compression cost the
backend ~0.25–0.3 ms per turn (PostgreSQL's CPU per turn in `bench/ingest.py`:
2.25 → 2.00 ms; an INSERT of the same payloads alone: 0.54 ms/row with pglz,
0.22 with LZ4), for ~10 % fewer bytes (12.9 KB vs
14.3 KB a row, next to ~0.8 MB of the turn's R3 patch). Reads decompress
faster too. Rows written before keep their pglz values: PostgreSQL reads
both, per value.

Only where the server has LZ4 (`--with-lz4`, as Debian's and the PGDG
packages are): `default_toast_compression` lists `lz4` among its values
then, and `SET COMPRESSION lz4` would fail without it. On Citus the ALTER is
propagated to every shard of `events`. SQLite stores text uncompressed; it
has nothing to set.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

HAS_LZ4 = ("SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
           "WHERE name = 'default_toast_compression'")


def _set_payload_compression(method: str) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql" or not bind.exec_driver_sql(HAS_LZ4).scalar():
        return
    op.execute(f"ALTER TABLE events ALTER COLUMN payload SET COMPRESSION {method}")


def upgrade() -> None:
    _set_payload_compression("lz4")


def downgrade() -> None:
    _set_payload_compression("default")
