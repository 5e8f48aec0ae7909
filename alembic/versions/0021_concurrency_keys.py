"""Concurrency keys: at most N messages of one key processing at a time, enforced by the claim.

Storage layout
--------------
``messages``            + concurrency_key text (NULL: no limit), concurrency_limit integer
                        (the limit the message was sent with; NULL: 1).
``history``             + the same two columns, written for dead letters (nack, quarantine)
                        so that ``retry-failed`` puts a message back with its key.
``concurrency_limits``  prefix (text, primary key) -> max_running (integer >= 0), updated_at:
                        limits set at run time (``dramatiq-pg-outbox limits set``, the
                        dashboard); a key takes the limit of the longest prefix it starts
                        with, before the broker's ``concurrency_limits`` option and the
                        message's own limit.  0 holds every message of the matching keys.

Indexes
-------
``messages_keyed_idx``    (queue_name, concurrency_key, next_attempt_at, id) WHERE pending and
                          keyed: the keyed claim walks the keys of a queue (one probe per key)
                          and takes each key's oldest due rows.
``messages_key_running_idx``  (concurrency_key) WHERE processing and keyed: how many of a
                          key's messages are processing.
Unkeyed messages enter neither index (both are partial).

``reclaim_messages()`` moves pending rows between the ring's partitions with a list of
columns: it is created again with the two new columns in that list.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import (
    quote_ident,
    revision_module,
    schema_for_migration,
    set_schema_revision,
)

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def _reclaim_messages(schema: str, s: str, *, with_keys: bool) -> str:
    """0016's ``reclaim_messages``, its moved columns with the concurrency key's if ``with_keys``."""
    sql = str(revision_module("0016_turn_to_attached_partitions_later.py").reclaim_messages_sql(schema, s))
    if not with_keys:
        return sql
    columns = str(revision_module("0013_message_ring.py").COLUMNS)
    assert sql.count(columns) == 2, "0013's moved columns not found"
    return sql.replace(columns, columns + ", concurrency_key, concurrency_limit")


def upgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    for table in ("messages", "history"):
        op.execute(
            f"ALTER TABLE {s}.{table} ADD COLUMN concurrency_key text, ADD COLUMN concurrency_limit integer"
        )
    op.execute(
        f"ALTER TABLE {s}.messages ADD CONSTRAINT messages_concurrency_check "
        "CHECK (concurrency_key <> '' AND concurrency_limit >= 0)"
    )
    op.execute(
        f"CREATE INDEX messages_keyed_idx ON {s}.messages (queue_name, concurrency_key, next_attempt_at, id) "
        "WHERE state = 'pending' AND concurrency_key IS NOT NULL"
    )
    op.execute(
        f"CREATE INDEX messages_key_running_idx ON {s}.messages (concurrency_key) "
        "WHERE state = 'processing' AND concurrency_key IS NOT NULL"
    )
    op.execute(
        f"""
        CREATE TABLE {s}.concurrency_limits (
            prefix      text        PRIMARY KEY CHECK (prefix <> ''),
            max_running integer     NOT NULL CHECK (max_running >= 0),
            updated_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(_reclaim_messages(schema, s, with_keys=True))
    set_schema_revision(op.execute, schema, 21)


def downgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    op.execute(_reclaim_messages(schema, s, with_keys=False))
    op.execute(f"DROP TABLE {s}.concurrency_limits")
    op.execute(f"ALTER TABLE {s}.messages DROP CONSTRAINT messages_concurrency_check")
    for table in ("messages", "history"):
        op.execute(f"ALTER TABLE {s}.{table} DROP COLUMN concurrency_key, DROP COLUMN concurrency_limit")
    set_schema_revision(op.execute, schema, 20)
