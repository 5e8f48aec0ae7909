"""Cancel a running message: history's state ``canceled`` and the cancel request of a claim.

Storage layout
--------------
``messages``         + cancel_requested_at timestamptz (NULL: none), cancel_reason text:
                     set on a processing row by the operator's cancel (the CLI's
                     ``cancel``, the dashboard's Cancel), which also notifies the broker
                     channel with ``cancel:<row id>``.  The worker running it interrupts
                     the actor (or lets it ask ``is_canceled()``); its outcome is archived
                     as ``canceled``.  A marked row is never handed back to pending: the
                     rescuer, the orphan check and a stopping worker archive it as
                     ``canceled`` instead.  Nullable without a default: no rewrite.
``history``          state CHECK: ``completed``, ``failed`` or ``canceled`` (an operator's
                     cancel, of a waiting or a running message, with error type
                     ``Canceled``).  Before this revision a canceled waiting message was
                     stored as ``failed`` with error type ``Canceled``; those rows become
                     ``canceled``.  A canceled message is not a dead letter: the failed
                     page, ``retry-failed`` and the dead-letter counters leave it.
``finished_counts``  state CHECK: + ``canceled`` (counted by the statements that cancel;
                     the rows converted above are added, as 0018 added history's).

The new CHECK of the partitioned ``history`` is added ``NOT VALID``: every row already
stored passed the stricter constraint it replaces, so a validation would read the whole
history under the lock that holds every ack, to prove nothing.  Partitions created
later carry it validated.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None

# ruff: noqa: S608 - the only interpolated name is the validated, quoted schema.


def _history_states(s: str, states: str) -> None:
    op.execute(f"ALTER TABLE {s}.history DROP CONSTRAINT history_state_check")
    op.execute(
        f"ALTER TABLE {s}.history ADD CONSTRAINT history_state_check CHECK (state IN ({states})) NOT VALID"
    )


def _finished_states(s: str, states: str) -> None:
    op.execute(f"ALTER TABLE {s}.finished_counts DROP CONSTRAINT finished_counts_state_check")
    op.execute(
        f"ALTER TABLE {s}.finished_counts"
        f" ADD CONSTRAINT finished_counts_state_check CHECK (state IN ({states}))"
    )


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"ALTER TABLE {s}.messages ADD COLUMN cancel_requested_at timestamptz, ADD COLUMN cancel_reason text"
    )
    _history_states(s, "'completed', 'failed', 'canceled'")
    _finished_states(s, "'completed', 'retried', 'failed', 'canceled'")
    # The dead letters of type Canceled were never counted as dead letters nor as finished
    # (0012, 0018): they are counted as canceled now.
    op.execute(
        f"""
        WITH converted AS (
            UPDATE {s}.history SET state = 'canceled'
            WHERE state = 'failed' AND error_type = 'Canceled'
            RETURNING queue_name, actor_name
        )
        INSERT INTO {s}.finished_counts (queue_name, actor_name, state, shard, n)
        SELECT queue_name, actor_name, 'canceled', 0, count(*) FROM converted GROUP BY 1, 2
        """
    )
    set_schema_revision(op.execute, schema_for_migration(), 22)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"UPDATE {s}.history SET state = 'failed' WHERE state = 'canceled'")
    op.execute(f"DELETE FROM {s}.finished_counts WHERE state = 'canceled'")
    _history_states(s, "'completed', 'failed'")
    _finished_states(s, "'completed', 'retried', 'failed'")
    # A marked row loses its mark: its worker finishes it as it would have before.
    op.execute(f"ALTER TABLE {s}.messages DROP COLUMN cancel_requested_at, DROP COLUMN cancel_reason")
    set_schema_revision(op.execute, schema_for_migration(), 21)
