"""The two functions that read rows committed after their lock refuse any level but READ COMMITTED.

``<schema>.reclaim_messages(...)`` (0013) takes a partition's ``ACCESS
EXCLUSIVE`` lock, checks that the partition holds no row and empties it with
``TRUNCATE``; ``<schema>.rate_limit_incr_and_sum(...)`` (0008) takes an advisory
lock per key, then sums the window's counters.  Both need each statement to see
what was committed before it started, after the lock: READ COMMITTED.  Under
REPEATABLE READ or SERIALIZABLE the whole call reads the snapshot of its first
statement: the ring's check missed rows committed while the lock was awaited
and ``TRUNCATE`` deleted them (7 of 10 committed messages lost in a test), and
the window limiter admitted past its maximum.

The package's connections run at READ COMMITTED whatever the defaults
(``dramatiq_pg_outbox._isolation``, docs/guarantees.md "Isolation levels"); this
revision makes the two functions raise ``invalid_transaction_state`` (SQLSTATE
25000) when they are called at another level, as a caller of its own would.  The
functions are 0013's and 0008's as written there, with the check first; the
downgrade restores them.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType, SimpleNamespace

from alembic import op
from dramatiq_pg_outbox.migrations import (
    quote_ident,
    revision_module,
    schema_for_migration,
    set_schema_revision,
)

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None


def _created(module: ModuleType, run: Callable[[], None], function: str) -> str:
    """The ``CREATE FUNCTION`` of ``function`` that ``run`` (code of ``module``) executes, as ``CREATE OR
    REPLACE``: the other statements ``run`` would execute are recorded, not run."""
    executed: list[str] = []
    module.op = SimpleNamespace(execute=executed.append)
    run()
    (sql,) = [s for s in executed if s.lstrip().startswith("CREATE FUNCTION") and f".{function}(" in s]
    return sql.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _originals(schema: str, s: str) -> dict[str, str]:
    """``CREATE OR REPLACE`` of the two functions as 0013 and 0008 create them, by name."""
    ring = revision_module("0013_message_ring.py")
    limits = revision_module("0008_rate_limits.py")
    return {
        "reclaim_messages": _created(ring, lambda: ring._functions(schema, s), "reclaim_messages"),
        "rate_limit_incr_and_sum": _created(limits, limits.upgrade, "rate_limit_incr_and_sum"),
    }


def _guarded(sql: str, function: str) -> str:
    """``sql`` with a check of the isolation level first in the function's body (its outer BEGIN)."""
    lines = sql.split("\n")
    at = next(i for i, line in enumerate(lines) if line.strip() == "BEGIN")
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())] + "    "
    check = [
        "-- Its statements must see what was committed before each of them, after the lock:",
        "-- READ COMMITTED only (migration 0015).",
        "IF current_setting('transaction_isolation') <> 'read committed' THEN",
        f"    RAISE EXCEPTION '{function}() runs only in READ COMMITTED, not in %',",
        "          upper(current_setting('transaction_isolation'))",
        "        USING ERRCODE = 'invalid_transaction_state',",
        "              HINT = 'Call it outside a transaction of that level, or in one begun with "
        "BEGIN ISOLATION LEVEL READ COMMITTED.';",
        "END IF;",
    ]
    return "\n".join([*lines[: at + 1], *(indent + line for line in check), *lines[at + 1 :]])


def upgrade() -> None:
    schema = schema_for_migration()
    for function, sql in _originals(schema, quote_ident(schema)).items():
        op.execute(_guarded(sql, function))
    set_schema_revision(op.execute, schema, int(revision))


def downgrade() -> None:
    schema = schema_for_migration()
    for sql in _originals(schema, quote_ident(schema)).values():
        op.execute(sql)
    assert down_revision is not None
    set_schema_revision(op.execute, schema, int(down_revision))
