"""Scenario prune (issue 9): retention of a large history, DELETE (revision 0006) vs DROP PARTITION (0007).

Two schemas of one database, migrated to 0006 (plain ``history``) and to head
(partitioned by day), get the same N rows (default 10,000,000; ``--prune-rows``)
spread evenly over the last 30 days, each with a payload of 100 bytes and
every other one with an idempotency key, then ANALYZE.  Timed, on each:

* prune of the rows older than 15 days: 0006 with the statement of the old
  ``prune`` command (``DELETE ... WHERE finished_at < now() - 15 days``), then the
  ``VACUUM`` that makes the space reusable (autovacuum would do it later, at a
  cost the DELETE alone hides); 0007 with :func:`dramatiq_pg_outbox.partitions.prune`
  (drops 15 day partitions, deletes the older rows of the day at the cutoff);
* archive: INSERT of 200,000 more rows finished now (what ack/nack flushes do,
  in one statement), before the prune;
* the idempotency-key lookup of the enqueue statement (``EXISTS`` on
  ``history.idempotency_key``), 2,000 lookups of existing and missing keys;
* the workers' ack flush (the broker's own ``ack`` statement: DELETE from
  ``messages``, INSERT into ``history``, one statement per batch of 64 claimed
  rows, as the flush loop writes them), 19,200 rows, three rounds alternating the
  two schemas, median.  The statement is head's: the 0006 schema gets the
  ``priority`` column it archives (revision 0010's ``ADD COLUMN``, a catalog change) and the
  ``finished_counts`` table it counts into (revision 0018).

The ratios printed are 0006 / 0007 (above 1: the partitioned table is faster).
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import time
import uuid
from typing import Any

import psycopg

from dramatiq_pg_outbox import upgrade
from dramatiq_pg_outbox._queries import queries_for_schema
from dramatiq_pg_outbox._runtime import fence_params
from dramatiq_pg_outbox.partitions import day_partitions, prune

from .bench_common import Context, drop_database, markdown_table, recreate_database

DEFAULT_ROWS = 10_000_000
DAYS = 30
PRUNE_DAYS = 15
ARCHIVE_ROWS = 200_000
LOOKUPS = 2_000
#: Rows and batch size of the ack-flush measure.
ACK_ROWS = 19_200
ACK_BATCH = 64

_LOAD = """
INSERT INTO {s}.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at,
                         started_at, finished_at, error_type, error, payload, idempotency_key)
SELECT i, 'q' || (i %% 8), 'actor' || (i %% 20), md5(i::text), CASE WHEN i %% 50 = 0 THEN 'failed'
       ELSE 'completed' END, 1, t - interval '2 s', t - interval '1 s', t, NULL, NULL,
       convert_to(repeat('x', 100), 'UTF8'), CASE WHEN i %% 2 = 0 THEN 'key-' || i END
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
     LATERAL (SELECT now() - (%(span)s::interval * (i - %(first)s) / %(count)s)) AS x(t)
"""


def _load(conn: psycopg.Connection[Any], schema: str, first: int, count: int, span: dt.timedelta) -> float:
    started = time.perf_counter()
    conn.execute(
        _LOAD.format(s=schema),
        {"first": first, "last": first + count - 1, "count": count, "span": span},
    )
    return time.perf_counter() - started


def _lookups(conn: psycopg.Connection[Any], schema: str, rows: int, lookups: int) -> float:
    """Mean microseconds of the enqueue statement's history check."""
    keys = [f"key-{2 * (i * 7919 % (rows // 2) + 1)}" if i % 2 else f"missing-{i}" for i in range(lookups)]
    query = f"SELECT EXISTS (SELECT 1 FROM {schema}.history AS h WHERE h.idempotency_key = %s)"  # noqa: S608
    started = time.perf_counter()
    for key in keys:
        conn.execute(query, (key,)).fetchone()
    return (time.perf_counter() - started) / lookups * 1e6


def _ack_flush(conn: psycopg.Connection[Any], schema: str, rows: int) -> float:
    """Rows per second archived by the ``ack`` statement in batches of ACK_BATCH."""
    lease = uuid.uuid4()
    # Message ids continue after the loaded history's (archived rows keep their id).
    conn.execute(
        f"SELECT setval(pg_get_serial_sequence('{schema}.messages', 'id'), "  # noqa: S608
        f"(SELECT max(id) FROM {schema}.history))"
    )
    ids = [
        row[0]
        for row in conn.execute(
            f"INSERT INTO {schema}.messages (queue_name, actor_name, message_id, payload, state, attempts, "  # noqa: S608
            "lease, owner, acquired_at) SELECT 'q', 'a', md5(i::text), convert_to(repeat('x', 100), 'UTF8'), "
            "'processing', 1, %s, %s, now() FROM generate_series(1, %s) AS i RETURNING id",
            (lease, uuid.uuid4(), rows),
        )
    ]
    conn.execute(f"VACUUM ANALYZE {schema}.messages")
    query = queries_for_schema(schema)["ack"]
    started = time.perf_counter()
    for lo in range(0, len(ids), ACK_BATCH):
        batch = ids[lo : lo + ACK_BATCH]
        conn.execute(query, fence_params([(i, lease) for i in batch]))
    return len(ids) / (time.perf_counter() - started)


def run(ctx: Context) -> dict[str, Any]:
    rows = int(
        os.environ.get("BENCH_PRUNE_ROWS", 10_000 if ctx.smoke else 200_000 if ctx.quick else DEFAULT_ROWS)
    )
    # A smoke run checks that every step runs, on a few rows.
    archive_rows, lookups, ack_rows = (
        (1_000, 100, 2 * ACK_BATCH) if ctx.smoke else (ARCHIVE_ROWS, LOOKUPS, ACK_ROWS)
    )
    name = "bench_prune"
    recreate_database(ctx.admin_url, name)
    url = ctx.db_url(name)
    try:
        upgrade(url, schema="plain", revision="0006")
        # The ack statement measured below is head's, which archives the priority column of
        # revision 0010: give the 0006 tables that column (as 0010 adds it) so that both
        # schemas run the same statement and differ by the history layout alone.
        with psycopg.connect(url, autocommit=True) as conn:
            for table in ("messages", "history"):
                conn.execute(f"ALTER TABLE plain.{table} ADD COLUMN priority smallint NOT NULL DEFAULT 0")
        upgrade(url, schema="parted")
        # And the counters head's ack statement upserts (finished_counts, revision 0018).
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE plain.finished_counts (LIKE parted.finished_counts INCLUDING ALL)")
        results: dict[str, dict[str, float]] = {}
        with psycopg.connect(url, autocommit=True) as conn:
            # Partitions for the 30 days of rows (the maintenance loop makes only the days ahead).
            today = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]  # type: ignore[index]
            for back in range(1, DAYS + 1):
                conn.execute(
                    "SELECT parted.create_history_partitions(0, %s)", (today - dt.timedelta(days=back),)
                )
            for schema in ("plain", "parted"):
                r = results[schema] = {}
                print(f"  loading {rows:,} rows into {schema}.history ...", flush=True)
                r["load_s"] = _load(conn, schema, 1, rows, dt.timedelta(days=DAYS))
                conn.execute(f"ANALYZE {schema}.history")
                r["archive_rows_per_s"] = archive_rows / _load(
                    conn, schema, rows + 1, archive_rows, dt.timedelta(seconds=1)
                )
                r["lookup_us"] = _lookups(conn, schema, rows, lookups)
            acks: dict[str, list[float]] = {"plain": [], "parted": []}
            for _ in range(3):
                for schema in ("plain", "parted"):
                    acks[schema].append(_ack_flush(conn, schema, ack_rows))
            for schema, rates in acks.items():
                results[schema]["ack_rows_per_s"] = statistics.median(rates)
            older = dt.timedelta(days=PRUNE_DAYS)
            started = time.perf_counter()
            deleted = conn.execute(
                "DELETE FROM plain.history WHERE finished_at < now() - %s", (older,)
            ).rowcount
            results["plain"]["prune_s"] = time.perf_counter() - started
            started = time.perf_counter()
            conn.execute("VACUUM plain.history")
            results["plain"]["vacuum_s"] = time.perf_counter() - started
            before = len(day_partitions(conn, "parted"))
            started = time.perf_counter()
            pruned = prune(conn, "parted", older)
            results["parted"]["prune_s"] = time.perf_counter() - started
            results["parted"]["vacuum_s"] = 0.0
            left = conn.execute("SELECT count(*) FROM parted.history").fetchone()[0]  # type: ignore[index]
            left_plain = conn.execute("SELECT count(*) FROM plain.history").fetchone()[0]  # type: ignore[index]
        plain, parted = results["plain"], results["parted"]
        table = markdown_table(
            ["", "0006 plain history", "0007 partitioned by day", "0006 / 0007"],
            [
                [
                    f"prune older than {PRUNE_DAYS} days",
                    f"{plain['prune_s']:.2f} s (DELETE of {deleted:,} rows)",
                    f"{parted['prune_s']:.3f} s ({len(pruned.dropped)} of {before} partitions dropped, "
                    f"{pruned.deleted:,} rows deleted)",
                    f"{plain['prune_s'] / parted['prune_s']:.1f}x",
                ],
                [
                    "prune + VACUUM",
                    f"{plain['prune_s'] + plain['vacuum_s']:.2f} s",
                    f"{parted['prune_s']:.3f} s (nothing to vacuum)",
                    f"{(plain['prune_s'] + plain['vacuum_s']) / parted['prune_s']:.1f}x",
                ],
                [
                    f"archive {archive_rows:,} rows (one INSERT)",
                    f"{plain['archive_rows_per_s']:,.0f} rows/s",
                    f"{parted['archive_rows_per_s']:,.0f} rows/s",
                    f"{plain['archive_rows_per_s'] / parted['archive_rows_per_s']:.2f}x",
                ],
                [
                    f"ack flush, batches of {ACK_BATCH} (the workers' archive statement)",
                    f"{plain['ack_rows_per_s']:,.0f} rows/s",
                    f"{parted['ack_rows_per_s']:,.0f} rows/s",
                    f"{plain['ack_rows_per_s'] / parted['ack_rows_per_s']:.2f}x",
                ],
                [
                    "idempotency lookup",
                    f"{plain['lookup_us']:.0f} µs",
                    f"{parted['lookup_us']:.0f} µs",
                    f"{plain['lookup_us'] / parted['lookup_us']:.2f}x",
                ],
                [f"load {rows:,} rows", f"{plain['load_s']:.1f} s", f"{parted['load_s']:.1f} s", ""],
            ],
        )
        print(f"  rows left: plain {left_plain:,}, partitioned {left:,}", flush=True)
        return {"rows": rows, "results": results, "rows_left": [left_plain, left], "table": table}
    finally:
        drop_database(ctx.admin_url, name)
