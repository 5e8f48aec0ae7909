"""Partitioned history: one partition per UTC day, so that retention drops tables.

Storage layout
--------------
``history`` becomes a table partitioned by range of ``finished_at``:
``history_pYYYYMMDD`` holds the rows finished on that UTC day, and
``history_default`` whatever falls outside the partitions that exist (rows
archived on a day whose partition was not created in time).  Retention
(``dramatiq-pg-outbox prune``) drops whole day partitions, O(1) whatever their
size, and deletes only the rows of the partition at the cutoff and of the
default partition; ``DELETE`` of millions of rows (and the VACUUM that must
follow it) is gone.

Partitions are created ahead of time by ``<schema>.create_history_partitions(days)``,
a ``SECURITY DEFINER`` function (owned by the migrating role: creating a
partition needs the table's owner) that the workers' maintenance loop and
``dramatiq-pg-outbox maintain`` call; it takes an advisory lock, so any number
of callers is safe, and skips a day whose rows already landed in the default
partition (they stay there until pruned).  No extension (pg_partman) is needed.
EXECUTE is revoked from PUBLIC: grant it to the workers' role (docs/security.md).

Keys: the primary key becomes ``(id, finished_at)`` (a partitioned table's
unique constraints must contain the partition key); ``id`` comes from
``messages`` and is unique by construction.  Every index of 0001/0002 is
re-created as a partitioned index, so the idempotency-key lookup is an index
scan of each partition.

Upgrade copies every row, into day partitions for the days of the last 90
with rows and into the default partition before that, plus the next 7 days
ahead; downgrade copies every row back into a plain table.  Both rewrite the
table under an exclusive lock: plan a maintenance window for a large history
(benchmarks/README.md has the time per million rows).  The views of 0003 that
read history are re-created on the new table.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

# ruff: noqa: S608 - the only interpolated names are the validated, quoted schema and constants.
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None

#: Days of existing history that get a partition each at upgrade (older rows go to the default one).
BACKFILL_DAYS = 90
#: Days ahead created at upgrade.
AHEAD_DAYS = 7
#: The copy is split into about this many statements (a progress line each) ...
COPY_STEPS = 20
#: ... of at least this many rows each.
COPY_MIN_ROWS = 10_000
#: Seconds per million history rows of the copy, measured (benchmarks/README.md, "Upgrading to 0007").
SECONDS_PER_MILLION = 5.4

#: Says what a long step will do, then its progress (``dramatiq-pg-outbox migrate`` prints it).
log = logging.getLogger("dramatiq_pg_outbox.migrations")


def _copy_history(s: str, direction: str) -> None:
    """INSERT every row of ``history_old`` into ``history``, announced, then in page ranges with progress.

    Offline (``migrate --sql``) and for the downgrade (whose source is the
    partitioned table) it is one statement.  Online, TID range scans
    (PostgreSQL 14+) copy about 1/``COPY_STEPS`` of the rows (at least
    ``COPY_MIN_ROWS``) at a time, each a sequential read of its pages; all in
    the migration's one transaction, so an interrupted upgrade leaves history
    as it was.
    """
    bind = None if op.get_context().as_sql else op.get_bind()
    if bind is None or direction == "downgrade":
        # Offline, or from the partitioned table (its pages are its partitions'): one statement.
        op.execute(f"INSERT INTO {s}.history SELECT * FROM {s}.history_old")
        return
    rows, pages = bind.exec_driver_sql(
        f"SELECT count(*), (pg_relation_size('{s}.history_old') "
        f"/ current_setting('block_size')::int)::bigint FROM {s}.history_old"
    ).one()
    if not rows:
        return  # nothing to copy, nothing to say
    log.info(
        "0007 %s: %s history rows to copy, about %.0f s at %.0f s per million rows measured; "
        "history stays locked until the migration commits (interrupted, nothing changes)",
        direction, f"{rows:,}", rows / 1e6 * SECONDS_PER_MILLION, SECONDS_PER_MILLION,
    )  # fmt: skip
    batch = max(COPY_MIN_ROWS, rows / COPY_STEPS)
    step = max(1, math.ceil(pages * batch / rows))
    copied, started = 0, time.monotonic()
    for first in range(0, pages + 1, step):
        result = bind.exec_driver_sql(
            f"INSERT INTO {s}.history SELECT * FROM {s}.history_old "
            f"WHERE ctid >= '({first},0)'::tid AND ctid < '({first + step},0)'::tid"
        )
        copied += result.rowcount
        log.info(
            "0007 %s: copied %s of %s rows (%.0f %%), %.1f s",
            direction, f"{copied:,}", f"{rows:,}", 100 * copied / rows, time.monotonic() - started,
        )  # fmt: skip
    if copied != rows:  # the table is locked: nothing can come or go meanwhile
        raise RuntimeError(f"0007 {direction}: copied {copied} of {rows} history rows; rolled back")


def _indexes(s: str) -> None:
    op.execute(f"CREATE INDEX history_finished_at_idx ON {s}.history USING brin (finished_at)")
    op.execute(
        f"CREATE INDEX history_failed_idx ON {s}.history (queue_name, finished_at) WHERE state = 'failed'"
    )
    op.execute(
        f"CREATE INDEX history_idempotency_key_idx ON {s}.history (idempotency_key) "
        "WHERE idempotency_key IS NOT NULL"
    )


def _views(s: str) -> None:
    """The two views of 0003 that name the history table (a view keeps the table it was made on)."""
    op.execute(
        f"""
        CREATE VIEW {s}.message_attempts AS
        SELECT actor_name, attempts, count(*) AS messages
        FROM (
            SELECT actor_name, message_id, sum(attempts)::integer AS attempts
            FROM {s}.history
            GROUP BY actor_name, message_id
        ) AS per_message
        GROUP BY actor_name, attempts
        ORDER BY actor_name, attempts
        """
    )
    op.execute(
        f"""
        CREATE VIEW {s}.message_errors AS
        SELECT actor_name, error_type, retried, failed, total,
               row_number() OVER (PARTITION BY actor_name ORDER BY total DESC, error_type) AS rank
        FROM (
            SELECT actor_name, error_type,
                   count(*) FILTER (WHERE state = 'completed') AS retried,
                   count(*) FILTER (WHERE state = 'failed') AS failed,
                   count(*) AS total
            FROM {s}.history
            WHERE error_type IS NOT NULL
            GROUP BY actor_name, error_type
        ) AS e
        ORDER BY actor_name, rank
        """
    )


def _swap_out(s: str) -> None:
    """Drop the views on history and rename it aside (with its indexes and constraints)."""
    op.execute(f"DROP VIEW {s}.message_errors")
    op.execute(f"DROP VIEW {s}.message_attempts")
    op.execute(f"ALTER TABLE {s}.history RENAME TO history_old")
    for index in ("history_finished_at_idx", "history_failed_idx", "history_idempotency_key_idx"):
        op.execute(f"ALTER INDEX {s}.{index} RENAME TO {index}_old")
    op.execute(f"ALTER TABLE {s}.history_old RENAME CONSTRAINT history_pkey TO history_old_pkey")
    op.execute(
        f"ALTER TABLE {s}.history_old RENAME CONSTRAINT history_state_check TO history_old_state_check"
    )


def _create_history(s: str, primary_key: str, partitioning: str) -> None:
    """A new history table shaped like ``history_old`` (left by ``_swap_out``)."""
    op.execute(
        f"""
        CREATE TABLE {s}.history (
            LIKE {s}.history_old INCLUDING DEFAULTS,
            CONSTRAINT history_state_check CHECK (state IN ('completed', 'failed')),
            {primary_key}
        ) {partitioning}
        """
    )


def upgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    _swap_out(s)
    _create_history(s, "PRIMARY KEY (id, finished_at)", "PARTITION BY RANGE (finished_at)")
    op.execute(f"CREATE TABLE {s}.history_default PARTITION OF {s}.history DEFAULT")
    _indexes(s)
    # The function that creates day partitions ahead: the loop's own lock, then one
    # CREATE per missing day; a day whose rows are already in the default partition
    # cannot get a partition (check_violation) and is skipped.
    op.execute(
        f"""
        CREATE FUNCTION {s}.create_history_partitions(days integer DEFAULT 7,
                                                      from_day date DEFAULT NULL)
        RETURNS integer
        LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $fn$
        DECLARE
            first date := coalesce(from_day, (now() AT TIME ZONE 'UTC')::date);
            day date;
            name text;
            created integer := 0;
        BEGIN
            IF days < 0 OR days > 3660 THEN  -- ten years: a typo, not a plan
                RAISE EXCEPTION 'days must be 0..3660, not %', days;
            END IF;
            PERFORM pg_advisory_xact_lock(hashtext({_literal(schema)} || '.history partitions'));
            FOR i IN 0 .. days LOOP
                day := first + i;
                name := 'history_p' || to_char(day, 'YYYYMMDD');
                CONTINUE WHEN to_regclass(format('%I.%I', {_literal(schema)}, name)) IS NOT NULL;
                BEGIN
                    EXECUTE format(
                        'CREATE TABLE %I.%I PARTITION OF %I.history FOR VALUES FROM (%L) TO (%L)',
                        {_literal(schema)}, name, {_literal(schema)},
                        day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
                    created := created + 1;
                EXCEPTION WHEN check_violation THEN
                    NULL;  -- rows of that day are in the default partition already
                END;
            END LOOP;
            RETURN created;
        END
        $fn$
        """
    )
    op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.create_history_partitions(integer, date) FROM PUBLIC")
    # Partitions for the recent days that have rows, and the days ahead; then the rows.
    op.execute(
        f"""
        SELECT {s}.create_history_partitions(0, d::date)
        FROM (SELECT DISTINCT (finished_at AT TIME ZONE 'UTC')::date AS d FROM {s}.history_old
              WHERE finished_at >= now() - interval '{BACKFILL_DAYS} days') AS days
        """
    )
    op.execute(f"SELECT {s}.create_history_partitions({AHEAD_DAYS})")
    _copy_history(s, "upgrade")
    op.execute(f"DROP TABLE {s}.history_old")
    _views(s)
    set_schema_revision(op.execute, schema, 7)


def downgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    _swap_out(s)
    _create_history(s, "PRIMARY KEY (id)", "")
    _indexes(s)
    _copy_history(s, "downgrade")
    op.execute(f"DROP TABLE {s}.history_old")  # and its partitions
    op.execute(f"DROP FUNCTION {s}.create_history_partitions(integer, date)")
    _views(s)
    set_schema_revision(op.execute, schema, 6)


def _literal(text: str) -> str:
    """``text`` as an SQL string literal (schema names are validated: no quote can occur)."""
    return "'" + text.replace("'", "''") + "'"
