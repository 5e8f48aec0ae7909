"""The ring turns to a partition it attached at a later call, never in the call that attached it.

A statement's tuple routing uses the partitions of ``messages`` as the backend's
relation cache knew them when it locked the table (parse, bind), while the slot
it inserts into (``message_slot()``, the ring's row) is read in the snapshot it
takes after that.  When ``reclaim_messages()`` attached a partition and turned the
ring to it in one transaction, an ``INSERT`` whose lock came just before that
commit and whose snapshot just after found no partition for its row
(``CheckViolation: no partition of relation "messages" found for row``, slot = the
new one): an ``outbox()`` transaction failed at ``COMMIT`` for nothing.  Seen by the
history checker (``benchmarks/chaos/checker.py``) twice in a few minutes of runs with
partitions held by locks (each such hold makes the ring attach); the window is the
few microseconds between a statement's lock and its snapshot, longer on a loaded
machine.  Now a call that attaches a partition leaves the ring where it is; a later
call (a fifth of ``rotate_interval`` later, from any process) turns to it, by then
in every routing that locked the table since the attach.

The function is 0015's (0013's with the isolation check) with that one change;
the downgrade restores 0015's.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26
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

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None

#: The statement of 0013's function that attaches a new partition to the ring.
ATTACH = "PERFORM {s}.attach_message_slot(target);"


def _reclaim_messages(schema: str, s: str) -> str:
    """``CREATE OR REPLACE`` of ``reclaim_messages`` as 0015 creates it."""
    previous = revision_module("0015_reclaim_read_committed.py")
    return str(previous._guarded(previous._originals(schema, s)["reclaim_messages"], "reclaim_messages"))


def upgrade() -> None:
    schema = schema_for_migration()
    op.execute(reclaim_messages_sql(schema, quote_ident(schema)))
    set_schema_revision(op.execute, schema, int(revision))


def reclaim_messages_sql(schema: str, s: str) -> str:
    """``CREATE OR REPLACE`` of ``reclaim_messages`` as this revision creates it (0021 reuses it)."""
    sql = _reclaim_messages(schema, s)
    attach = ATTACH.format(s=s)
    assert sql.count(attach) == 1, "0013's attach statement not found"
    indent = sql[sql.index(attach) - 40 : sql.index(attach)].rsplit("\n", 1)[1]
    later = (
        f"{attach}\n"
        f"{indent}-- Not current yet: a statement that locked messages before this commit routes\n"
        f"{indent}-- with the partitions it knew then (migration 0016); a later call turns to it.\n"
        f"{indent}target := NULL;"
    )
    return sql.replace(attach, later)


def downgrade() -> None:
    schema = schema_for_migration()
    op.execute(_reclaim_messages(schema, quote_ident(schema)))
    assert down_revision is not None
    set_schema_revision(op.execute, schema, int(down_revision))
