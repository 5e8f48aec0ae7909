"""Priorities: the ``broker_priority`` of a message decides which due message is claimed first.

Storage layout
--------------
``messages.priority``  smallint, 0 (the default: no priority) to 255; a higher
                       number is claimed first among the due messages of a
                       queue, FIFO within a priority (see the claim in
                       ``queries.sql``).  Written from the ``broker_priority``
                       message option at enqueue.
``history.priority``   the same, kept when a message is archived, so that a
                       dead letter retried (``retry-failed``, the dashboard)
                       keeps its priority.
``messages_priority_idx``  (queue_name, priority DESC, next_attempt_at, id) of
                       the pending rows with priority > 0 only: the claim reads
                       it first; rows without a priority (the common case) stay
                       in ``messages_ready_idx`` alone, so an unprioritized
                       queue pays one probe of an empty index range.

Adding a column with a constant default is a catalog change (no table
rewrite, PostgreSQL 11+), on the hot table and on every history partition.
The partial index is built empty of rows before any message has a priority:
its build reads the hot table once (the waiting messages), never history.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"ALTER TABLE {s}.messages ADD COLUMN priority smallint NOT NULL DEFAULT 0")
    op.execute(f"ALTER TABLE {s}.history ADD COLUMN priority smallint NOT NULL DEFAULT 0")
    op.execute(
        f"CREATE INDEX messages_priority_idx ON {s}.messages "
        "(queue_name, priority DESC, next_attempt_at, id) WHERE state = 'pending' AND priority > 0"
    )
    set_schema_revision(op.execute, schema_for_migration(), 10)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP INDEX {s}.messages_priority_idx")
    op.execute(f"ALTER TABLE {s}.history DROP COLUMN priority")
    op.execute(f"ALTER TABLE {s}.messages DROP COLUMN priority")
    set_schema_revision(op.execute, schema_for_migration(), 9)
