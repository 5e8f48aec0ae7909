"""Idempotency keys: one arbiter per key that the ack does not delete.

Storage layout
--------------
``idempotency_keys``    idempotency_key (primary key) -> created_at: one row per
                        key ever stored, written by the statement that stores
                        the key's message (``INSERT ... ON CONFLICT DO
                        NOTHING``: the statement that inserts the row stores the
                        message, every other one skips it).  The ack, the nack,
                        a quarantine, a cancel and ``retry-failed`` move the
                        message between ``messages`` and ``history`` and leave
                        the row alone, so a send of the key is refused from the
                        commit of the first send until the row goes: when the
                        message leaves both tables (``prune``, the dashboard's
                        Discard, a purge of its queue), never before.

Why: the unique index on ``messages`` holds a key only while its message is in
the hot table, and the history check of ``enqueue`` reads the statement's
snapshot.  A send that waited on the unique index behind an ack found no
conflict once the ack committed, and a history snapshot taken before the ack:
the key was stored twice (issue 31, defect 1).  A key row is never deleted
while its message is in either table, so every send of that key meets it.

Backfilled from the keyed rows of ``messages`` and ``history``
(``created_at``: the earliest ``enqueued_at`` of the key), under a SHARE lock
on both tables: no keyed row can be written meanwhile.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26
"""

# ruff: noqa: S608 - the only interpolated name is the validated, quoted schema.
from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.idempotency_keys (
            idempotency_key text        PRIMARY KEY,
            created_at      timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(f"LOCK TABLE {s}.messages, {s}.history IN SHARE MODE")
    op.execute(
        f"INSERT INTO {s}.idempotency_keys (idempotency_key, created_at) "
        f"SELECT idempotency_key, min(enqueued_at) FROM ("
        f"SELECT idempotency_key, enqueued_at FROM {s}.messages WHERE idempotency_key IS NOT NULL "
        f"UNION ALL "
        f"SELECT idempotency_key, enqueued_at FROM {s}.history WHERE idempotency_key IS NOT NULL"
        f") AS keyed GROUP BY idempotency_key"
    )
    set_schema_revision(op.execute, schema_for_migration(), 14)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.idempotency_keys")
    set_schema_revision(op.execute, schema_for_migration(), 13)
