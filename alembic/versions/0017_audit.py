"""The audit trail: one row per operator action, from the dashboard or the command line.

Storage layout
--------------
``audit``    id (identity) -> at (when), operator (the dashboard's basic-auth user or
             ``token``, the command line's OS user), source (``dashboard`` or ``cli``),
             action (``retry``, ``discard``, ``cancel``, ``purge``, ``run-now``,
             ``pause``, ``resume``, ``schedule-enable``, ``schedule-disable``),
             target (a queue, a message id, a schedule, a filter), count (rows
             changed), detail (free text: the client address, a reason).

Written by the statement of each action's caller after the action committed (an
action that changed nothing is recorded too, with count 0). Read newest first by
the dashboard's Audit page and ``dramatiq-pg-outbox audit``. Nothing deletes its rows:
they are small, one per click; delete old ones by hand if ever needed.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.audit (
            id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            at       timestamptz NOT NULL DEFAULT now(),
            operator text        NOT NULL,
            source   text        NOT NULL CHECK (source IN ('dashboard', 'cli')),
            action   text        NOT NULL,
            target   text        NOT NULL,
            count    bigint      NOT NULL DEFAULT 0,
            detail   text        NOT NULL DEFAULT ''
        )
        """
    )
    set_schema_revision(op.execute, schema_for_migration(), 17)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.audit")
    set_schema_revision(op.execute, schema_for_migration(), 16)
