"""Idempotency key: at most one message per key.

``messages.idempotency_key`` (nullable) carries the ``idempotency_key`` option
of a message (``actor.send_with_options(..., idempotency_key="...")``) or the
key that ``dramatiq_pg_outbox.spark.enqueue_dataframe`` derives from a batch id
and a row key.  A UNIQUE partial index makes the database refuse a second row
with the same key while the first is in the hot table; the ``enqueue`` query
turns the conflict into ``ON CONFLICT DO NOTHING``.  Rows without a key never
conflict.

Finished messages leave the hot table, so the key is also copied to
``history.idempotency_key`` (indexed, not unique) and ``enqueue`` skips keys
found there too: re-running a job after its messages were processed adds
nothing.  Retries re-enqueue a message with its options; those retry rows are
stored without the key (they are the same message, not a new one).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    # Adding a nullable column without a default is a catalog-only change:
    # no table rewrite, only a brief ACCESS EXCLUSIVE lock.
    op.execute(f"ALTER TABLE {s}.messages ADD COLUMN idempotency_key text")
    op.execute(f"ALTER TABLE {s}.history ADD COLUMN idempotency_key text")
    op.execute(
        f"CREATE UNIQUE INDEX messages_idempotency_key_idx ON {s}.messages (idempotency_key) "
        "WHERE idempotency_key IS NOT NULL"
    )
    op.execute(
        f"CREATE INDEX history_idempotency_key_idx ON {s}.history (idempotency_key) "
        "WHERE idempotency_key IS NOT NULL"
    )
    set_schema_revision(op.execute, schema_for_migration(), 2)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP INDEX {s}.history_idempotency_key_idx")
    op.execute(f"DROP INDEX {s}.messages_idempotency_key_idx")
    op.execute(f"ALTER TABLE {s}.history DROP COLUMN idempotency_key")
    op.execute(f"ALTER TABLE {s}.messages DROP COLUMN idempotency_key")
    set_schema_revision(op.execute, schema_for_migration(), 1)
