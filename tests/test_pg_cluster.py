"""`tests.pg.start_cluster`: a second throwaway cluster with its own postgresql.conf settings."""

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from tests.pg import Unavailable, start_cluster
from tests.pg.binaries import find_bindir


async def test_a_cluster_starts_with_extra_settings_and_is_deleted_on_stop():
    try:
        find_bindir()
    except Unavailable as exc:
        pytest.skip(f"no PostgreSQL server binaries: {exc}")
    cluster = start_cluster({"work_mem": "7MB", "application_name": "turnlog-test"})
    try:
        url = make_url(cluster.url()).set(drivername="postgresql")
        conn = await asyncpg.connect(url.render_as_string(hide_password=False))
        try:
            assert await conn.fetchval("SHOW work_mem") == "7MB"
            assert await conn.fetchval("SHOW fsync") == "off"  # the test defaults stay
            assert await conn.fetchval("SHOW port") == str(cluster.port)
        finally:
            await conn.close()
    finally:
        cluster.stop()
    assert not cluster.base.exists()
