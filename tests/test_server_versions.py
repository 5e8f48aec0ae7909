"""Every supported PostgreSQL major: what differs between them, and the switch that picks the server.

``.ci/run`` runs the core tests (this file among them) a second and a third time with
``$DRAMATIQ_PG_OUTBOX_TEST_BINDIR`` set to the oldest and the newest supported majors (see
``tests/conftest.py``); the main run uses the local server (PostgreSQL 15 on Debian 12).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dramatiq_pg_outbox.dashboard.store import raw_queries

from .conftest import BINDIR_VAR, ROOT, SCHEMA

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
MICROSECOND = dt.timedelta(microseconds=1)


def bucket_start(at: dt.datetime, bucket: dt.timedelta) -> dt.datetime:
    """The start of ``at``'s bucket, counted in whole buckets from the Unix epoch (date_bin's rule)."""
    return EPOCH + (at - EPOCH) // bucket * bucket


def insert_history(db: psycopg.Connection[Any], actor: str, queue: str, finished: list[dt.datetime]) -> None:
    with db.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {SCHEMA}.history (id, queue_name, actor_name, message_id, state, attempts, "
            "enqueued_at, started_at, finished_at, payload) "
            "VALUES (-(1e9 + floor(random() * 1e9))::bigint, %s, %s, gen_random_uuid()::text, "
            "'completed', 1, %s, %s, %s, '')",
            [(queue, actor, at, at, at) for at in finished],
        )


def test_the_tests_run_on_the_server_of_the_chosen_bindir(admin_url: str) -> None:
    bindir = os.environ.get(BINDIR_VAR)
    if not bindir:
        pytest.skip(f"${BINDIR_VAR} is not set: the tests use the server conftest.py finds")
    version = subprocess.run(
        [str(Path(bindir) / "postgres"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"\b(\d+)\.\d+", version)
    assert match is not None, version
    with psycopg.connect(admin_url) as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    assert row is not None
    assert row[0] // 10000 == int(match.group(1))


def test_a_bindir_without_postgresql_is_refused_with_the_fix(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env.pop("DRAMATIQ_PG_OUTBOX_TEST_URL", None)
    env[BINDIR_VAR] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert f"${BINDIR_VAR}={tmp_path} holds no initdb, pg_ctl and postgres" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("bucket", "boundary"),
    [
        (dt.timedelta(seconds=15), dt.datetime(2026, 3, 29, 0, 59, 45, tzinfo=dt.timezone.utc)),
        (dt.timedelta(minutes=1), dt.datetime(2026, 11, 27, 23, 59, tzinfo=dt.timezone.utc)),
        (dt.timedelta(hours=1), dt.datetime(2026, 3, 29, 1, 0, tzinfo=dt.timezone.utc)),
        (dt.timedelta(days=1), dt.datetime(2026, 10, 25, 0, 0, tzinfo=dt.timezone.utc)),
    ],
    ids=["15 s", "1 min", "1 h", "1 day"],
)
def test_message_stats_buckets_start_on_whole_buckets_from_the_epoch(
    db: psycopg.Connection[Any], bucket: dt.timedelta, boundary: dt.datetime
) -> None:
    # Given deliveries finished a microsecond before a bucket boundary, on it, and a microsecond
    # after (around daylight-saving changes of Europe/Paris, the session's time zone: buckets
    # are spans of absolute time, not of local time)
    assert bucket_start(boundary, bucket) == boundary
    actor = f"buckets_{uuid.uuid4().hex[:8]}"
    finished = [boundary - MICROSECOND, boundary, boundary + MICROSECOND]
    insert_history(db, actor, "versions", finished)
    try:
        db.execute("SET TimeZone = 'Europe/Paris'")
        # When message_stats() groups them
        rows = db.execute(
            f"SELECT bucket_start, deliveries FROM {SCHEMA}.message_stats(%s, %s) WHERE actor_name = %s "
            "ORDER BY 1",
            (bucket, boundary - bucket, actor),
        ).fetchall()
        # Then the first is alone in the bucket before the boundary, the other two in the next one,
        # as date_bin(bucket, finished_at, epoch) counts them on PostgreSQL 14 and later
        # (compared in UTC: Python finds an ambiguous local time, as 02:00 on 2026-10-25 in Paris,
        # unequal to every time of another zone)
        assert [(start.astimezone(dt.timezone.utc), n) for start, n in rows] == [
            (boundary - bucket, 1),
            (boundary, 2),
        ]
    finally:
        db.execute("RESET TimeZone")
        db.execute(f"DELETE FROM {SCHEMA}.history WHERE actor_name = %s", (actor,))


def test_the_dashboards_queue_minutes_start_on_whole_minutes(db: psycopg.Connection[Any]) -> None:
    # Given deliveries of one queue around the last whole minute, within the hour the sparklines show
    queue = f"minutes_{uuid.uuid4().hex[:8]}"
    row = db.execute("SELECT now()").fetchone()
    assert row is not None
    minute = bucket_start(row[0], dt.timedelta(minutes=1)) - dt.timedelta(minutes=1)
    insert_history(db, "minutes", queue, [minute - MICROSECOND, minute, minute + MICROSECOND])
    try:
        # When the dashboard's query counts them per minute
        query = raw_queries()["queue_minutes"].replace("{schema}", SCHEMA)
        rows = [(start, n) for name, start, n in db.execute(query).fetchall() if name == queue]
        # Then one is in the minute before and two in the minute that starts on the boundary
        assert rows == [(minute - dt.timedelta(minutes=1), 1), (minute, 2)]
    finally:
        db.execute(f"DELETE FROM {SCHEMA}.history WHERE queue_name = %s", (queue,))
