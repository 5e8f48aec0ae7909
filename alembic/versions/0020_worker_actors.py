"""The actors each worker process declares: ``workers.actors``.

Storage layout
--------------
``workers``  + actors text[] (the names of the actors declared on the process's
             broker, sorted; written by each heartbeat beside ``queues``).

Read by the Spark data source's opt-in actor check (``check_actor``): a write
for an actor that no live worker of its queue declares (a typo, a module the
workers do not import) is refused on the driver instead of dead-lettering every
message as ``ActorNotFound``.  A worker of an older version of the package
heartbeats without the column's value: its row keeps the default (no actor).

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    # A default of a constant: no table rewrite (PostgreSQL 11+), a brief ACCESS EXCLUSIVE lock.
    op.execute(f"ALTER TABLE {s}.workers ADD COLUMN actors text[] NOT NULL DEFAULT '{{}}'")
    set_schema_revision(op.execute, schema_for_migration(), 20)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"ALTER TABLE {s}.workers DROP COLUMN actors")
    set_schema_revision(op.execute, schema_for_migration(), 19)
