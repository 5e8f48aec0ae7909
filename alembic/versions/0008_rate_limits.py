"""Rate limits: the tables of ``dramatiq_pg_outbox.rate_limits.PostgresBackend``.

Storage layout
--------------
``rate_limits``        one row per key of Dramatiq's rate limiters and barriers:
                       ``value`` (a counter: running holders of a
                       ``ConcurrentRateLimiter``, calls in a window bucket, the
                       parties still expected by a ``Barrier``) and ``expires_at``
                       (``now() + ttl`` on the database clock, renewed by every
                       write, as Redis' ``PX``).  A row whose ``expires_at`` has
                       passed counts as absent: every statement treats it so,
                       and the backend's cleanup deletes it later.
``rate_limit_events``  one row per key that ``wait_notify`` published: the event
                       exists until ``expires_at``, so a waiter that arrives late
                       still sees it (Redis keeps the list for its TTL).

Durability: both tables are logged.  An UNLOGGED table is emptied after a
server crash; a barrier (``GroupCallbacks``' completion callback) would then
never fire, and a concurrency limit would admit new holders beside the running
ones.  ``benchmarks/bench_rate_limits.py`` measures both kinds (see
benchmarks/README.md); an operator who accepts that loss for cheaper writes may
run ``ALTER TABLE <schema>.rate_limits SET UNLOGGED``.

``rate_limit_incr_and_sum(key, keys, amount, maximum, ttl_ms)``  the window
                       limiter's operation, exact under concurrency: it takes an
                       advisory lock per key of the window, then reads their sum.

Bloat: counters are updated in place, and ``expires_at`` changes at every
write; no index covers it, so the updates stay HOT (a fillfactor of 70 keeps
room on the page), and the cleanup's ``DELETE ... WHERE expires_at <= now()``
scans a table that holds only the live keys of the limiters.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None

#: First key of the advisory locks of rate_limit_incr_and_sum ("rl"), apart from other locks.
LOCK_CLASS = 0x726C


def upgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(
        f"""
        CREATE TABLE {s}.rate_limits (
            key        text        PRIMARY KEY,
            value      bigint      NOT NULL,
            expires_at timestamptz NOT NULL
        ) WITH (fillfactor = 70)
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.rate_limit_events (
            key        text        PRIMARY KEY,
            expires_at timestamptz NOT NULL
        )
        """
    )
    # The window limiter's operation needs the other buckets as committed after its lock:
    # a function, whose statements each take a new snapshot (one statement can not).
    op.execute(
        f"""
        CREATE FUNCTION {s}.rate_limit_incr_and_sum(
            p_key text, p_keys text[], p_amount bigint, p_maximum bigint, p_ttl_ms bigint
        ) RETURNS boolean LANGUAGE plpgsql AS $$
        DECLARE
            mine bigint;
            total bigint;
        BEGIN
            -- Callers of overlapping windows queue here: a transaction-scoped lock per
            -- key (class {LOCK_CLASS}), taken in one order, so that none deadlocks.
            PERFORM pg_advisory_xact_lock({LOCK_CLASS}, hashtext(k))
               FROM (SELECT DISTINCT k FROM unnest(p_keys || p_key) AS k ORDER BY k) AS ordered;
            SELECT coalesce(sum(value), 0) INTO total FROM {s}.rate_limits
             WHERE key = ANY (p_keys) AND expires_at > now();
            SELECT coalesce(max(value), 0) INTO mine FROM {s}.rate_limits
             WHERE key = p_key AND expires_at > now();
            IF mine + p_amount > p_maximum OR total + p_amount > p_maximum THEN
                RETURN false;
            END IF;
            INSERT INTO {s}.rate_limits AS r (key, value, expires_at)
            VALUES (p_key, p_amount, now() + p_ttl_ms * interval '1 millisecond')
            ON CONFLICT (key) DO UPDATE
                SET value = CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + excluded.value,
                    expires_at = excluded.expires_at;
            RETURN true;
        END
        $$
        """  # noqa: S608 - the schema is validated and quoted
    )
    set_schema_revision(op.execute, schema_for_migration(), 8)


def downgrade() -> None:
    s = quote_ident(schema_for_migration())
    op.execute(f"DROP FUNCTION {s}.rate_limit_incr_and_sum(text, text[], bigint, bigint, bigint)")
    op.execute(f"DROP TABLE {s}.rate_limit_events")
    op.execute(f"DROP TABLE {s}.rate_limits")
    set_schema_revision(op.execute, schema_for_migration(), 7)
