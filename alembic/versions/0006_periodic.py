"""Periodic jobs: the table of ``dramatiq_pg_outbox.periodic``'s schedulers.

Storage layout
--------------
``schedules``  one row per schedule declared in code (``@periodic`` or a
               ``Schedule`` list).  ``cron`` (with ``tz``, an IANA zone name)
               or ``every_ms`` (epoch-aligned interval) is the rule;
               ``next_run_at`` is the next tick to enqueue, on the database
               clock.  A scheduler enqueues a due tick and advances
               ``next_run_at`` past ``now()`` in one transaction, after
               ``SELECT ... FOR UPDATE SKIP LOCKED`` on the row: that lock and
               that transaction make each tick enqueued exactly once by any
               number of schedulers (see ``periodic_claim`` in
               ``queries.sql``).  ``last_run_at`` is the newest tick enqueued,
               ``last_enqueued_at`` when that happened; ``runs`` counts the
               ticks enqueued, ``missed_ticks`` those that got no message of
               their own (the ``missed`` policy, ``once`` or ``skip``, for ticks
               more than ``grace_ms`` late).  ``seen_at`` is refreshed by every
               running scheduler that declares the schedule; a schedule no
               scheduler declared for a while gets ``removed_at`` (it is no
               longer enqueued) and is deleted later.

Bloat: a row is updated at every tick of its schedule (once a second for the
fastest ones), never on an indexed column, so the updates are HOT; a
fillfactor of 50 keeps room on each page for the new row versions.  The table
holds one row per schedule: it stays a few pages.

Revision ID: 0006
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0006"
down_revision: str | None = "0004"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.schedules (
            name             text        PRIMARY KEY,
            actor_name       text        NOT NULL,
            queue_name       text        NOT NULL,
            cron             text,
            every_ms         bigint,
            tz               text        NOT NULL DEFAULT 'UTC',
            missed           text        NOT NULL DEFAULT 'once',
            grace_ms         bigint      NOT NULL DEFAULT 60000,
            next_run_at      timestamptz NOT NULL,
            last_run_at      timestamptz,
            last_enqueued_at timestamptz,
            runs             bigint      NOT NULL DEFAULT 0,
            missed_ticks     bigint      NOT NULL DEFAULT 0,
            created_at       timestamptz NOT NULL DEFAULT now(),
            updated_at       timestamptz NOT NULL DEFAULT now(),
            seen_at          timestamptz NOT NULL DEFAULT now(),
            removed_at       timestamptz,
            CONSTRAINT schedules_rule_check CHECK ((cron IS NULL) <> (every_ms IS NULL)),
            CONSTRAINT schedules_every_check CHECK (every_ms IS NULL OR every_ms > 0),
            CONSTRAINT schedules_missed_check CHECK (missed IN ('once', 'skip')),
            CONSTRAINT schedules_grace_check CHECK (grace_ms >= 0)
        ) WITH (fillfactor = 50)
        """
    )
    set_schema_revision(op.execute, schema_for_migration(), 6)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.schedules")
    set_schema_revision(op.execute, schema_for_migration(), 4)
