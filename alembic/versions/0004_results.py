"""Results: the table of ``dramatiq_pg_outbox.results.PostgresBackend``.

Storage layout
--------------
``results``  one row per stored result of Dramatiq's ``Results`` middleware.
             ``message_key`` is the backend's key of the message
             (``ResultBackend.build_message_key``: an MD5 hex digest of
             ``namespace:queue:actor:message_id`` by default); ``result`` is the
             encoded result, or the encoded exception of a failed message, as
             the backend's encoder wrote it; ``expires_at`` is ``now() + ttl`` on
             the database clock.  A row whose ``expires_at`` has passed is
             invisible to readers at once, and deleted later by
             ``PostgresBackend.delete_expired`` (a batched ``DELETE`` that reads
             ``results_expires_at_idx``).  A second store for the same key (a
             message run again after its worker died) replaces the row.

Bloat: a row is inserted once, read once or a few times, and deleted once;
it is not updated in place in the normal path, so the default fillfactor
(100) fits (free space kept for HOT updates would stay unused) and default
autovacuum settings apply.  Deletes follow ``expires_at``, which for one TTL
follows insertion order, so whole pages empty out and are reused.  The
table is logged: results survive a crash and reach streaming replicas like
the messages that produced them.  An operator who prefers cheaper writes and
accepts losing results on a crash can run ``ALTER TABLE <schema>.results
SET UNLOGGED``; the backend works the same.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.results (
            message_key text        PRIMARY KEY,
            result      bytea       NOT NULL,
            expires_at  timestamptz NOT NULL
        )
        """
    )
    # The cleanup deletes the oldest expired rows first, in batches: a range
    # scan of this index, however large the table.
    op.execute(f"CREATE INDEX results_expires_at_idx ON {s}.results (expires_at)")
    set_schema_revision(op.execute, schema_for_migration(), 4)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP TABLE {s}.results")
    set_schema_revision(op.execute, schema_for_migration(), 3)
