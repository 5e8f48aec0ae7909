"""Dead letters counted as they happen: the source of ``dramatiq_pg_outbox_dead_lettered_total``.

Storage layout
--------------
``dead_letter_counts``  (queue_name, shard) -> n: messages dead-lettered by the
                        workers so far (a nack after the last retry, a
                        quarantine after ``max_deliveries``, an undecodable
                        payload), added by the statement that archives them, in
                        its transaction.  Monotonic: ``prune`` and
                        ``retry-failed`` leave it alone (a count derived from
                        history would fall at every prune, and Prometheus'
                        ``rate()`` would read that as a counter reset).  A
                        flush adds to the shard ``pg_backend_pid() % 16`` of its
                        connection, so the flushes of many processes rarely wait
                        for one another's row lock during a storm of failures; the
                        exporter sums the shards.  Operator cancels (the
                        dashboard's Cancel) are not counted.
                        Seeded with the dead letters in history at upgrade time.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""

# ruff: noqa: S608 - the only interpolated name is the validated, quoted schema.
from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.dead_letter_counts (
            queue_name text     NOT NULL,
            shard      smallint NOT NULL,
            n          bigint   NOT NULL,
            PRIMARY KEY (queue_name, shard)
        )
        """
    )
    op.execute(
        f"INSERT INTO {s}.dead_letter_counts (queue_name, shard, n) "
        f"SELECT queue_name, 0, count(*) FROM {s}.history WHERE state = 'failed' "
        "AND error_type IS DISTINCT FROM 'Canceled' GROUP BY queue_name"
    )
    set_schema_revision(op.execute, schema_for_migration(), 12)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.dead_letter_counts")
    set_schema_revision(op.execute, schema_for_migration(), 11)
