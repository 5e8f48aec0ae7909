"""Partitioned history (migration 0007) against a real PostgreSQL: upgrade and downgrade keep
every row, prune drops whole day partitions, partitions are created ahead (by the command,
by concurrent callers and by the workers' maintenance loop), the idempotency lookup stays an
index scan."""

from __future__ import annotations

import datetime as dt
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_pg_outbox import PostgresBroker, downgrade, upgrade
from dramatiq_pg_outbox.cli import main
from dramatiq_pg_outbox.partitions import create_partitions, day_partitions, prune

from .helpers import count, wait_for

COLUMNS = (
    "id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at, finished_at, "
    "error_type, error, payload, idempotency_key"
)


@pytest.fixture(autouse=True)
def past_partitions_dropped(db: psycopg.Connection[Any]) -> Iterator[None]:
    """The day partitions before today that a test made are gone after it (other tests expect
    the layout of a fresh migration: old rows in the default partition)."""
    yield
    today = db_today(db)
    for p in day_partitions(db, "dramatiq"):
        if p.day < today:
            db.execute(f"DROP TABLE dramatiq.{p.name}")


def insert_history(
    db: psycopg.Connection[Any], schema: str, ages: list[dt.timedelta], first_id: int = 1
) -> None:
    """One history row per age (finished that long before now()), ids from ``first_id``."""
    with db.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {schema}.history (id, queue_name, actor_name, message_id, state, attempts, "
            "enqueued_at, started_at, finished_at, error_type, error, payload, idempotency_key) "
            "VALUES (%s, 'q', 'a', %s, %s, 1, now() - %s - interval '1 s', now() - %s - interval '1 s', "
            "now() - %s, %s, %s, %s, %s)",
            [
                (
                    first_id + i,
                    f"m{first_id + i}",
                    "failed" if i % 3 == 0 else "completed",
                    age,
                    age,
                    age,
                    "E" if i % 3 == 0 else None,
                    "boom" if i % 3 == 0 else None,
                    b"payload",
                    f"key-{first_id + i}" if i % 2 == 0 else None,
                )
                for i, age in enumerate(ages)
            ],
        )


def rows(db: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return db.execute(f"SELECT {COLUMNS} FROM {schema}.history ORDER BY id").fetchall()


def relkind(db: psycopg.Connection[Any], table: str) -> str:
    row = db.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", (table,)).fetchone()
    assert row is not None
    return str(row[0])


def db_today(db: psycopg.Connection[Any]) -> dt.date:
    row = db.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def age_at(db: psycopg.Connection[Any], day: dt.date, time: dt.time) -> dt.timedelta:
    """The age (for ``insert_history``) of a row finished on ``day`` at ``time`` UTC.

    A fixed age such as "30 days" lands on one day or the next depending on the hour the test
    runs; a row meant for a given day partition is placed at a time of that day instead.
    """
    row = db.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0] - dt.datetime.combine(day, time, tzinfo=dt.timezone.utc)  # type: ignore[no-any-return]


def test_the_upgrade_to_0007_and_the_downgrade_keep_every_row(database_url: str, db: Any) -> None:
    schema = f"parts_{uuid.uuid4().hex[:10]}"
    try:
        # Given a 0006 schema with history rows from 200 days ago to now
        upgrade(database_url, schema=schema, revision="0006")
        ages = [dt.timedelta(days=d, hours=h) for d in (0, 1, 2, 10, 89, 200) for h in (1, 5)]
        insert_history(db, schema, ages)
        before = rows(db, schema)
        assert len(before) == 12 and relkind(db, f"{schema}.history") == "r"
        # When it is upgraded
        upgrade(database_url, schema=schema, revision="0007")
        # Then history is partitioned, holds the same rows, recent days in their own partitions
        assert relkind(db, f"{schema}.history") == "p"
        assert rows(db, schema) == before
        days = {p.day for p in day_partitions(db, schema)}
        today = db_today(db)
        assert {today + dt.timedelta(days=i) for i in range(8)} <= days
        in_default = count(db, f"SELECT count(*) FROM {schema}.history_default")
        assert in_default == 2  # the two rows of 200 days ago: older than the 90 days backfilled
        assert count(db, f"SELECT count(*) FROM {schema}.message_attempts") >= 1  # views re-created
        assert count(db, f"SELECT count(*) FROM {schema}.message_errors") >= 1
        # And a downgrade gives the plain table back, with the same rows
        downgrade(database_url, schema=schema, revision="0006")
        assert relkind(db, f"{schema}.history") == "r"
        assert rows(db, schema) == before
        assert count(db, f"SELECT count(*) FROM {schema}.message_errors") >= 1
        # And upgrading again works (nothing of the first upgrade was left behind)
        upgrade(database_url, schema=schema)
        assert rows(db, schema) == before
    finally:
        db.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_migrate_says_what_the_0007_rewrite_will_do_and_shows_its_progress(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    schema = f"parts_{uuid.uuid4().hex[:10]}"
    try:
        # Given a 0006 schema with 25,000 history rows over the last 30 days
        upgrade(database_url, schema=schema, revision="0006")
        db.execute(
            f"INSERT INTO {schema}.history (id, queue_name, actor_name, message_id, state, attempts, "
            "enqueued_at, finished_at, payload) "
            "SELECT i, 'q', 'a', 'm' || i, 'completed', 1, now() - i * interval '100 s', "
            "now() - i * interval '100 s', '' FROM generate_series(1, 25000) AS i"
        )
        capsys.readouterr()
        # When the migrate command upgrades it to 0007
        assert main(["migrate", "--url", database_url, "--schema", schema, "--revision", "0007"]) == 0
        out = capsys.readouterr().out.splitlines()
        # Then it first says what it will do and how long it should take, then shows progress
        assert out[0].startswith("0007 upgrade: 25,000 history rows to copy, about "), out
        assert "history stays locked until the migration commits" in out[0]
        progress = [line for line in out if " copied " in line]
        assert len(progress) >= 2, out  # batches of at least 10,000 rows
        assert progress[-1].startswith("0007 upgrade: copied 25,000 of 25,000 rows (100 %)")
        assert out[-1].startswith(f"schema {schema!r} is at revision 0007")
        assert count(db, f"SELECT count(*) FROM {schema}.history") == 25_000
        # And a downgrade, from the partitioned table, keeps every row too
        downgrade(database_url, schema=schema, revision="0006")
        assert count(db, f"SELECT count(DISTINCT id) FROM {schema}.history") == 25_000
    finally:
        db.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_prune_drops_whole_day_partitions_and_keeps_exactly_the_newer_rows(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given day partitions for the last 10 days and rows every 7 h 13 m over them, plus old
    # rows in the default partition
    today = db_today(db)
    for back in range(1, 12):
        db.execute("SELECT dramatiq.create_history_partitions(0, %s)", (today - dt.timedelta(days=back),))
    ages = [dt.timedelta(hours=7 * k, minutes=13) for k in range(35)]
    insert_history(db, "dramatiq", ages)
    insert_history(db, "dramatiq", [dt.timedelta(days=400), dt.timedelta(days=401)], first_id=1000)
    assert count(db, "SELECT count(*) FROM dramatiq.history_default") == 2
    kept_ids = [1 + k for k, age in enumerate(ages) if age < dt.timedelta(days=5)]
    # When an operator prunes what is older than 5 days
    assert main(["prune", "--url", database_url, "--older-than", "5d"]) == 0
    out = capsys.readouterr().out
    # Then exactly the rows of the last 5 days are left
    assert [r[0] for r in db.execute("SELECT id FROM dramatiq.history ORDER BY id").fetchall()] == kept_ids
    # And the day partitions entirely older than the cutoff were dropped, not emptied
    left = {p.day for p in day_partitions(db, "dramatiq")}
    cutoff_day = db.execute("SELECT ((now() - interval '5 days') AT TIME ZONE 'UTC')::date").fetchone()[0]
    assert min(left) == cutoff_day
    dropped = int(out.split("dropped ")[1].split(" ")[0])
    assert dropped >= 5
    # And only the default partition's rows and the cutoff day's older rows were deleted one by one
    deleted = int(out.split("deleted ")[1].split(" ")[0])
    assert 2 <= deleted <= 2 + 4  # a day holds at most 4 of the 7 h 13 m rows
    # And pruning again finds nothing
    assert main(["prune", "--url", database_url, "--older-than", "5d"]) == 0
    assert "dropped 0 day partition(s) of about 0 row(s), deleted 0" in capsys.readouterr().out


def test_a_drop_that_cannot_get_its_lock_is_left_for_the_next_run(database_url: str, db: Any) -> None:
    today = db_today(db)
    db.execute("SELECT dramatiq.create_history_partitions(0, %s)", (today - dt.timedelta(days=30),))
    insert_history(db, "dramatiq", [age_at(db, today - dt.timedelta(days=30), dt.time(12))])
    # Given a long query holding a lock on history (an analytics report)
    with psycopg.connect(database_url) as report:
        report.execute("SELECT count(*) FROM dramatiq.history")
        # When prune runs beside it
        with psycopg.connect(database_url, autocommit=True) as conn:
            result = prune(conn, "dramatiq", dt.timedelta(days=7), lock_timeout=100, attempts=2)
        # Then the old partition is kept, its row too, and nothing waited long
        assert [p.day for p in result.kept] == [today - dt.timedelta(days=30)] and not result.dropped
        assert count(db, "SELECT count(*) FROM dramatiq.history") == 1
    # And the next run, without the report, drops it
    with psycopg.connect(database_url, autocommit=True) as conn:
        result = prune(conn, "dramatiq", dt.timedelta(days=7))
    assert [p.day for p in result.dropped] == [today - dt.timedelta(days=30)]
    assert count(db, "SELECT count(*) FROM dramatiq.history") == 0


def test_maintain_creates_the_days_ahead_idempotently_and_under_concurrency(
    database_url: str, db: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    today = db_today(db)
    # (the days after today hold no rows: drop them so that this test creates them)
    for p in day_partitions(db, "dramatiq"):
        if p.day > today:
            db.execute(f"DROP TABLE dramatiq.{p.name}")
    # When an operator runs maintain for 12 days ahead, twice
    assert main(["maintain", "--url", database_url, "--days-ahead", "12"]) == 0
    first = capsys.readouterr().out
    assert main(["maintain", "--url", database_url, "--days-ahead", "12"]) == 0
    second = capsys.readouterr().out
    # Then the first created the days (today + 1 to today + 12 at least), the second nothing
    days = {p.day for p in day_partitions(db, "dramatiq")}
    assert {today + dt.timedelta(days=i) for i in range(1, 13)} <= days
    assert int(first.split()[1]) >= 12 and second.startswith("created 0 history partition(s)")
    # And 6 callers at once, for 40 days, create each missing day once and none fails
    barrier = threading.Barrier(6)
    created: list[int] = []
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            with psycopg.connect(database_url, autocommit=True) as conn:
                barrier.wait()
                created.append(create_partitions(conn, "dramatiq", 40))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=caller) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sum(created) >= 40 - 13 and sorted(created)[:-1] == [0] * 5
    assert {today + dt.timedelta(days=i) for i in range(1, 41)} <= {
        p.day for p in day_partitions(db, "dramatiq")
    }
    # And bad input is one line
    assert main(["maintain", "--url", database_url, "--days-ahead", "-1"]) == 2
    assert "must be within 0..3660" in capsys.readouterr().err


def test_workers_create_the_partitions_ahead(db: Any, make_broker: Any, start_worker: Any) -> None:
    today = db_today(db)
    for p in day_partitions(db, "dramatiq"):
        if p.day > today:
            db.execute(f"DROP TABLE dramatiq.{p.name}")
    # When a worker starts (on a queue: a process that consumes nothing runs no maintenance)
    broker: PostgresBroker = make_broker()
    dramatiq.actor(lambda: None, broker=broker, actor_name="noop")
    start_worker(broker)
    # Then its maintenance loop creates the next 7 days

    def ahead() -> bool:
        return {today + dt.timedelta(days=i) for i in range(1, 8)} <= {
            p.day for p in day_partitions(db, "dramatiq")
        }

    wait_for(ahead, 20, "the partitions of the next 7 days")


def test_the_idempotency_lookup_is_an_index_scan_of_each_partition(db: Any) -> None:
    today = db_today(db)
    for back in range(1, 4):
        db.execute("SELECT dramatiq.create_history_partitions(0, %s)", (today - dt.timedelta(days=back),))
    # Given 3 days of history, 3,000 rows a day, half of them keyed
    ages = [
        age_at(db, today - dt.timedelta(days=d), dt.time(1)) - dt.timedelta(seconds=s)
        for d in (1, 2, 3)
        for s in range(0, 30_000, 10)
    ]
    insert_history(db, "dramatiq", ages)
    db.execute("ANALYZE dramatiq.history")
    # When the enqueue statement's history check is planned
    plan = "\n".join(
        r[0]
        for r in db.execute(
            "EXPLAIN SELECT 1 FROM dramatiq.history AS h WHERE h.idempotency_key = 'key-1001'"
        ).fetchall()
    )
    # Then every partition with rows is read through its index; only empty ones (no page to
    # read, so a scan costs nothing) are scanned
    scanned = re.findall(r"Seq Scan on (\w+)", plan)
    assert all(count(db, f"SELECT count(*) FROM dramatiq.{name}") == 0 for name in scanned), plan
    for back in range(1, 4):
        day = today - dt.timedelta(days=back)
        assert re.search(rf"Index (Only )?Scan using history_p{day:%Y%m%d}_idempotency_key_idx", plan), plan
