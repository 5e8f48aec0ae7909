"""Queue pauses: the queues whose messages no consumer or relay claims for now.

Storage layout
--------------
``queue_pauses``  one row per paused queue name (``dramatiq-pg-outbox pause QUEUE``
                  writes the queue and its delay queue ``QUEUE.DQ``): ``paused_at``,
                  the database clock when it was paused.  The claim of a consumer
                  and of the relay skips a queue with a row; sending is unchanged
                  (messages wait).  ``resume`` deletes the rows and wakes the
                  queue's consumers (NOTIFY).  A table, not memory: the state
                  survives restarts of workers and of the server.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.queue_pauses (
            queue_name text        PRIMARY KEY,
            paused_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    set_schema_revision(op.execute, schema_for_migration(), 9)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.queue_pauses")
    set_schema_revision(op.execute, schema_for_migration(), 8)
