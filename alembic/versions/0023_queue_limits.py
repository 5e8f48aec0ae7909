"""Run-time limits of concurrency keys configured per queue.

Storage layout
--------------
``concurrency_limits``  + queue_name text NOT NULL DEFAULT '' (``''``: every queue); the
                        primary key becomes (queue_name, prefix).  The keyed claim of a
                        queue takes the limit of the longest prefix among that queue's own
                        limits first, then among the limits of every queue, then the limit
                        the message carries (``dramatiq-pg-outbox limits set PREFIX N
                        --queue QUEUE``, the dashboard's Limits page).  Existing limits keep
                        applying to every queue.  A key stays one resource across queues:
                        its processing messages are counted in every queue, whichever limit
                        a claim applies.

The empty string, not NULL, stands for "every queue" so that the pair is a primary key on
every supported PostgreSQL (``UNIQUE NULLS NOT DISTINCT`` is PostgreSQL 15's).

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None

# ruff: noqa: S608 - the only interpolated name is the validated, quoted schema.


def upgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    op.execute(
        f"""
        ALTER TABLE {s}.concurrency_limits
            ADD COLUMN queue_name text NOT NULL DEFAULT '',
            DROP CONSTRAINT concurrency_limits_pkey,
            ADD PRIMARY KEY (queue_name, prefix)
        """
    )
    set_schema_revision(op.execute, schema, 23)


def downgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    # A queue's own limits cannot be kept without the column: they go (a limit of every
    # queue with the same prefix may exist beside them).
    op.execute(f"DELETE FROM {s}.concurrency_limits WHERE queue_name <> ''")
    op.execute(
        f"""
        ALTER TABLE {s}.concurrency_limits
            DROP CONSTRAINT concurrency_limits_pkey,
            DROP COLUMN queue_name,
            ADD PRIMARY KEY (prefix)
        """
    )
    set_schema_revision(op.execute, schema, 22)
