"""Operator controls of the dashboard: running versus prefetched, schedules switched off.

Storage layout
--------------
``workers.running``       bigint[], the message rows whose actor the worker
                          process runs now, written by its heartbeat: a
                          processing row listed there is *running*, any other
                          processing row is claimed and *prefetched* (waiting
                          in the process for a free worker thread).  As of the
                          last heartbeat (``heartbeat_interval``).
``schedules.disabled_at`` timestamptz, NULL for an enabled schedule; set by the
                          dashboard's Disable.  A disabled schedule is not
                          claimed by any scheduler; its ticks pass.  Enabled
                          again, its missed ticks follow its ``missed`` policy,
                          as after a scheduler outage (``skip``: none of them runs).

Both are catalog-only changes (a column without a default, or with a constant one).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"ALTER TABLE {s}.workers ADD COLUMN running bigint[] NOT NULL DEFAULT '{{}}'")
    op.execute(f"ALTER TABLE {s}.schedules ADD COLUMN disabled_at timestamptz")
    set_schema_revision(op.execute, schema_for_migration(), 11)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"ALTER TABLE {s}.schedules DROP COLUMN disabled_at")
    op.execute(f"ALTER TABLE {s}.workers DROP COLUMN running")
    set_schema_revision(op.execute, schema_for_migration(), 10)
