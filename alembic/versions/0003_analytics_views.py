"""Analytics in SQL: the aggregates of ``python -m dramatiq_pg_outbox.spark_analytics``.

``message_stats(bucket interval, since timestamptz)``
    per actor and time bucket of ``finished_at`` (whole buckets from the Unix
    epoch, as the Spark job buckets and ``date_bin(bucket, finished_at, epoch)``
    would; written without ``date_bin``, which PostgreSQL 13 lacks): deliveries, completed, retried (a
    completed history row with an error type: the actor raised and Retries
    enqueued a retry), failed (dead-lettered), throughput per second, failure
    and retry rates, exact latency percentiles in milliseconds of enqueue ->
    start (``wait``) and start -> finish (``run``).
``message_stats_by_minute``, ``message_stats_by_hour``
    the same, for the last day and the last 30 days.
``message_attempts``
    per actor: how many messages needed n deliveries (all stored rows of a
    message_id: retries and redeliveries after a crash both count).
``message_errors``
    per actor and error type: retried, failed, total, rank (1 = most frequent).
``queue_backlog``
    per queue and actor, from the live table: pending (due), delayed,
    processing, age of the oldest due message in seconds.

These read the history table directly: fast at small and medium scale (the
BRIN index on ``finished_at`` bounds ``since``); the Spark job is for a
history too large for one query.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

# ruff: noqa: S608 - the only interpolated name is the validated, quoted schema.
from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE FUNCTION {s}.message_stats(
            bucket interval DEFAULT interval '1 minute',
            since timestamptz DEFAULT '-infinity'
        )
        RETURNS TABLE (
            actor_name text, bucket_start timestamptz,
            deliveries bigint, completed bigint, retried bigint, failed bigint,
            throughput_per_s double precision, failure_rate double precision, retry_rate double precision,
            wait_p50_ms double precision, wait_p90_ms double precision, wait_p99_ms double precision,
            run_p50_ms double precision, run_p90_ms double precision, run_p99_ms double precision
        )
        LANGUAGE sql STABLE
        AS $$
            SELECT h.actor_name,
                   to_timestamp(floor(extract(epoch FROM h.finished_at) / extract(epoch FROM bucket))
                                * extract(epoch FROM bucket)) AS bucket_start,
                   count(*),
                   count(*) FILTER (WHERE h.state = 'completed' AND h.error_type IS NULL),
                   count(*) FILTER (WHERE h.state = 'completed' AND h.error_type IS NOT NULL),
                   count(*) FILTER (WHERE h.state = 'failed'),
                   count(*) / extract(epoch FROM bucket)::double precision,
                   (count(*) FILTER (WHERE h.state = 'failed'))::double precision / count(*),
                   (count(*) FILTER (WHERE h.state = 'completed' AND h.error_type IS NOT NULL))
                       ::double precision / count(*),
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY w.wait_ms),
                   percentile_cont(0.9) WITHIN GROUP (ORDER BY w.wait_ms),
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY w.wait_ms),
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY w.run_ms),
                   percentile_cont(0.9) WITHIN GROUP (ORDER BY w.run_ms),
                   percentile_cont(0.99) WITHIN GROUP (ORDER BY w.run_ms)
            FROM {s}.history AS h
            CROSS JOIN LATERAL (
                SELECT extract(epoch FROM h.started_at - h.enqueued_at) * 1000 AS wait_ms,
                       extract(epoch FROM h.finished_at - h.started_at) * 1000 AS run_ms
            ) AS w
            WHERE h.finished_at >= since
            GROUP BY 1, 2
            ORDER BY 1, 2
        $$
        """
    )
    op.execute(
        f"CREATE VIEW {s}.message_stats_by_minute AS "
        f"SELECT * FROM {s}.message_stats(interval '1 minute', now() - interval '1 day')"
    )
    op.execute(
        f"CREATE VIEW {s}.message_stats_by_hour AS "
        f"SELECT * FROM {s}.message_stats(interval '1 hour', now() - interval '30 days')"
    )
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
    op.execute(
        f"""
        CREATE VIEW {s}.queue_backlog AS
        SELECT queue_name, actor_name,
               count(*) FILTER (WHERE state = 'pending' AND next_attempt_at <= now()) AS pending,
               count(*) FILTER (WHERE state = 'pending' AND next_attempt_at > now()) AS delayed,
               count(*) FILTER (WHERE state = 'processing') AS processing,
               coalesce(extract(epoch FROM now() - min(next_attempt_at)
                   FILTER (WHERE state = 'pending' AND next_attempt_at <= now())), 0)::double precision
                   AS oldest_due_age_s
        FROM {s}.messages
        GROUP BY queue_name, actor_name
        ORDER BY queue_name, actor_name
        """
    )
    set_schema_revision(op.execute, schema_for_migration(), 3)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    for view in ("queue_backlog", "message_errors", "message_attempts", "message_stats_by_hour"):
        op.execute(f"DROP VIEW {s}.{view}")
    op.execute(f"DROP VIEW {s}.message_stats_by_minute")
    op.execute(f"DROP FUNCTION {s}.message_stats(interval, timestamptz)")
    set_schema_revision(op.execute, schema_for_migration(), 2)
