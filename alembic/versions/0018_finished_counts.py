"""Finished messages counted per queue, actor and outcome: ``dramatiq_pg_outbox_messages_finished_total``.

Storage layout
--------------
``finished_counts``  (queue_name, actor_name, state, shard) -> n: messages moved to
                     history so far, by outcome (``state``):

                     * ``completed``: acked (the ``ack`` statement, the relay's
                       archive too);
                     * ``retried``: acked after the actor raised, Retries having
                       enqueued its retry (``archive`` in state completed; a
                       completed history row with an error type, as
                       ``message_stats()`` of migration 0003 calls it);
                     * ``failed``: dead-lettered (``archive`` in state failed: a
                       nack after the last retry, an undecodable payload, a
                       follow-up that cannot be written; and ``rescue``'s
                       quarantine after ``max_deliveries``), the same events as
                       ``dead_letter_counts`` (migration 0012) with the actor.

                     An operator's Cancel (the dashboard, ``dramatiq-pg-outbox
                     cancel``) is not counted: the message never ran, and it is not
                     a dead letter either.  ``retry-failed`` and ``discard`` leave
                     the counts alone (a dead letter retried that fails again counts
                     twice: it failed twice).  Monotonic: ``prune`` does not touch it.

Why a table written by the ack, and not a count of history at scrape time
-------------------------------------------------------------------------
A count of history would fall at every ``prune`` (Prometheus' ``rate()`` reads a
fall as a counter reset) and would read all of history at every scrape (millions
of rows, every 15 s).  Counting on the way in costs one upsert per (queue, actor)
group of a flush batch, not one per message: the ``ack`` and ``archive``
statements add ``count(*) ... GROUP BY queue_name, actor_name`` of the rows they
move, in a data-modifying CTE of the same statement (no extra round trip), to the
shard ``pg_backend_pid() % 16`` of their connection, so the flushes of many
processes rarely wait for one another's row lock; the rows of one statement are
upserted in (queue, actor) order, so two flushes that share a shard lock them in
one order.  The exporter sums the shards.  The table stays small (queues x actors
x 3 x 16 rows at most) and its updates are HOT (``n`` is not indexed).

Seeded from history at upgrade time (one ``GROUP BY``, shard 0): what was pruned
before is not counted.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""

# ruff: noqa: S608 - the only interpolated name is the validated, quoted schema.
from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.finished_counts (
            queue_name text     NOT NULL,
            actor_name text     NOT NULL,
            state      text     NOT NULL CHECK (state IN ('completed', 'retried', 'failed')),
            shard      smallint NOT NULL,
            n          bigint   NOT NULL,
            PRIMARY KEY (queue_name, actor_name, state, shard)
        )
        """
    )
    op.execute(
        f"""
        INSERT INTO {s}.finished_counts (queue_name, actor_name, state, shard, n)
        SELECT queue_name, actor_name,
               CASE WHEN state = 'failed' THEN 'failed'
                    WHEN error_type IS NULL THEN 'completed' ELSE 'retried' END,
               0, count(*)
          FROM {s}.history
         WHERE state = 'completed' OR error_type IS DISTINCT FROM 'Canceled'
         GROUP BY 1, 2, 3
        """
    )
    set_schema_revision(op.execute, schema_for_migration(), 18)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.finished_counts")
    set_schema_revision(op.execute, schema_for_migration(), 17)
