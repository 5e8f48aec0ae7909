"""``message_slot()`` in PL/pgSQL, so that its statement is planned once per session.

Every unkeyed message's row reads the ring's current partition through
``message_slot()``, the default of ``messages.slot`` and a branch of the enqueue
statements (migration 0013).  It was a SQL function, ``SECURITY DEFINER`` with
its own ``search_path`` (the roles of docs/security.md need no privilege on
``message_ring``), which PostgreSQL cannot inline: the SQL-function executor then
parses and plans its ``SELECT`` again in every statement that calls it.  PL/pgSQL
keeps the plan of its statement for the session: a transaction of one business row
and the outbox's one-message insert (``enqueue_one``) went from 301-305 to 286-290 us
(``python -m benchmarks.profile_outbox_send --pgbench``: ``pgbench -M prepared``, one
client; benchmarks/README.md, section 33).  The function stays ``STABLE``, so it reads the ring
in the calling statement's snapshot as before (what migration 0016 relies on),
and keeps its owner's rights, its ``search_path`` and its grants (``CREATE OR
REPLACE``).  The downgrade restores 0013's SQL function.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None

# ruff: noqa: S608 - the only interpolated name is the validated, quoted schema.


def _create_message_slot(s: str, language: str, body: str) -> None:
    """``CREATE OR REPLACE`` of ``message_slot()``: its owner's rights, search_path and grants kept."""
    op.execute(
        f"""
        CREATE OR REPLACE FUNCTION {s}.message_slot() RETURNS smallint
        LANGUAGE {language} STABLE SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $fn$ {body} $fn$
        """
    )


def upgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    _create_message_slot(s, "plpgsql", f"BEGIN RETURN (SELECT slot FROM {s}.message_ring); END")
    set_schema_revision(op.execute, schema, 24)


def downgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    _create_message_slot(s, "sql", f"SELECT slot FROM {s}.message_ring")  # as migration 0013 made it
    set_schema_revision(op.execute, schema, 23)
