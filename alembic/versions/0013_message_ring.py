"""The hot table as a ring of partitions, emptied by TRUNCATE: storage bounded without vacuum.

Storage layout
--------------
``messages`` becomes a table partitioned by list of a new column ``slot``
(smallint):

``messages_ring<n>`` (n = 0, 1, 2, ...)  the ring: unkeyed messages due within
                        ``park_ms`` (30 s) of their enqueue.  Inserts go to the
                        ring's current partition (``message_ring.slot``, the
                        column's default through ``message_slot()``).  Each
                        partition carries ``CHECK (idempotency_key IS NULL)``.
``messages_vacuumed``   slot -1: messages with an idempotency key (their unique
                        index, ``messages_idempotency_key_idx`` on
                        ``(idempotency_key, slot)``, holds across the table
                        because no ring partition may hold a key) and messages
                        delayed by more than ``park_ms``.  Reclaimed by vacuum,
                        as the whole table was before.
``message_ring``        one row: the current slot, the previous one and when
                        the ring last turned.

``<schema>.reclaim_messages(rotate_ms, park_ms, max_slots, channel)`` (``SECURITY
DEFINER``: emptying and attaching partitions needs the owner; EXECUTE revoked
from PUBLIC, granted to the workers' role in docs/security.md), called by each
worker process's reclaim loop: turns the ring when the current partition is
``rotate_ms`` old and not empty (to an emptied partition, else a new one
attached, up to ``max_slots``), moves the few pending rows left in an older
partition (handed back, or inserted under an old snapshot) to the current one or
to ``messages_vacuumed``, and empties each older partition that holds no row
with ``TRUNCATE``, under a ``LOCK`` that waits ``LOCK_TIMEOUT_MS`` (20 ms) at
most: a partition that a transaction has read is skipped and tried again at
the next call.  docs/design.md, "Reclaiming storage
without vacuum".

The primary key becomes ``(id, slot)`` (a partitioned table's unique
constraints contain the partition key); ``id`` keeps its sequence.  Upgrade
and downgrade copy every row under the migration's exclusive lock.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""

# ruff: noqa: S608 - the only interpolated names are the validated, quoted schema and constants.
from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from dramatiq_pg_outbox.migrations import quote_ident, schema_for_migration, set_schema_revision

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: Sequence[str] | None = None
depends_on: Sequence[str] | None = None

#: Ring partitions created at upgrade.
INITIAL_SLOTS = 4
#: How long reclaim_messages() waits for a lock before it skips (ms).  Every claim and ack locks
#: every partition for a few milliseconds, so with ``NOWAIT`` at 2,000 msg/s the ring took
#: busy partitions for held ones and grew to its 8 partitions, and a transaction that read the
#: table then held all of them (chaos scenario 10, stopped); claims queue behind a waiting
#: ``LOCK`` for this long at most.
LOCK_TIMEOUT_MS = 20
#: Messages due later than this after their enqueue go to ``messages_vacuumed`` at upgrade (ms):
#: ``dramatiq_pg_outbox.names.PARK_AFTER_MS`` when this revision was written.
PARK_MS = 30_000

#: Columns of messages before this revision, in order.
COLUMNS = (
    "id, queue_name, actor_name, message_id, state, attempts, enqueued_at, next_attempt_at, "
    "acquired_at, lease, owner, payload, idempotency_key, priority"
)


def _literal(text: str) -> str:
    """``text`` as an SQL string literal (schema names are validated: no quote can occur)."""
    return "'" + text.replace("'", "''") + "'"


def _swap_out(s: str) -> None:
    """Drop the view on messages and rename the table aside (indexes, constraints, sequence)."""
    op.execute(f"DROP VIEW {s}.queue_backlog")
    op.execute(f"ALTER TABLE {s}.messages RENAME TO messages_old")
    for index in ("messages_ready_idx", "messages_owner_idx", "messages_priority_idx",
                  "messages_idempotency_key_idx"):  # fmt: skip
        op.execute(f"ALTER INDEX {s}.{index} RENAME TO {index}_old")
    for constraint in ("pkey", "attempts_check", "lease_check", "queue_name_check", "state_check"):
        op.execute(
            f"ALTER TABLE {s}.messages_old "
            f"RENAME CONSTRAINT messages_{constraint} TO messages_old_{constraint}"
        )
    op.execute(f"ALTER SEQUENCE {s}.messages_id_seq RENAME TO messages_old_id_seq")


def _create_messages(s: str, slot: str, primary_key: str, partitioning: str) -> None:
    """A messages table shaped like ``messages_old`` (left by ``_swap_out``), its id sequence continued."""
    op.execute(
        f"""
        CREATE TABLE {s}.messages (
            LIKE {s}.messages_old INCLUDING DEFAULTS,
            {slot}
            CONSTRAINT messages_state_check CHECK (state IN ('pending', 'processing')),
            CONSTRAINT messages_lease_check CHECK ((state = 'processing') = (lease IS NOT NULL)),
            CONSTRAINT messages_attempts_check CHECK (attempts >= 0),
            CONSTRAINT messages_queue_name_check
                CHECK (queue_name ~ '^[a-zA-Z_][a-zA-Z0-9._-]*$'),
            {primary_key}
        ) {partitioning}
        """
    )
    op.execute(
        f"ALTER TABLE {s}.messages ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY "
        f"(SEQUENCE NAME {s}.messages_id_seq)"
    )
    op.execute(f"SELECT setval('{s}.messages_id_seq', last_value, is_called) FROM {s}.messages_old_id_seq")


def _indexes(s: str, key_columns: str) -> None:
    op.execute(
        f"CREATE INDEX messages_ready_idx ON {s}.messages (queue_name, next_attempt_at, id) "
        "WHERE state = 'pending'"
    )
    op.execute(f"CREATE INDEX messages_owner_idx ON {s}.messages (owner) WHERE state = 'processing'")
    op.execute(
        f"CREATE INDEX messages_priority_idx ON {s}.messages "
        "(queue_name, priority DESC, next_attempt_at, id) WHERE state = 'pending' AND priority > 0"
    )
    op.execute(
        f"CREATE UNIQUE INDEX messages_idempotency_key_idx ON {s}.messages ({key_columns}) "
        "WHERE idempotency_key IS NOT NULL"
    )


def _view(s: str) -> None:
    """The view of 0003 that reads messages (a view keeps the table it was made on)."""
    op.execute(
        f"""
        CREATE VIEW {s}.queue_backlog AS
        SELECT queue_name, actor_name,
               count(*) FILTER (WHERE state = 'pending' AND next_attempt_at <= now()) AS pending,
               count(*) FILTER (WHERE state = 'pending' AND next_attempt_at > now()) AS delayed,
               count(*) FILTER (WHERE state = 'processing') AS processing,
               coalesce(extract(epoch FROM now() - min(next_attempt_at)
                   FILTER (WHERE state = 'pending' AND next_attempt_at <= now())), 0)::double precision
                   AS oldest_due_age_s
        FROM {s}.messages
        GROUP BY queue_name, actor_name
        ORDER BY queue_name, actor_name
        """
    )


def _functions(schema: str, s: str) -> None:
    """message_slot(), attach_message_slot(n) and reclaim_messages(...)."""
    lit = _literal(schema)
    # The ring's partitions, (rel regclass, n smallint), as reclaim_messages() lists them.
    ring = (
        "SELECT c.oid::regclass AS rel, substr(c.relname, 14)::smallint AS n "
        "FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
        f"WHERE i.inhparent = '{s}.messages'::regclass AND c.relname ~ '^messages_ring[0-9]+$'"
    )
    op.execute(
        f"""
        CREATE FUNCTION {s}.message_slot() RETURNS smallint
        LANGUAGE sql STABLE SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $fn$ SELECT slot FROM {s}.message_ring $fn$
        """
    )
    op.execute(
        f"""
        CREATE FUNCTION {s}.attach_message_slot(n smallint) RETURNS void
        LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        AS $fn$
        DECLARE
            name text := 'messages_ring' || n;
        BEGIN
            EXECUTE format('CREATE TABLE %I.%I (LIKE %I.messages INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                           {lit}, name, {lit});
            EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (idempotency_key IS NULL), '
                           'ADD CONSTRAINT %I CHECK (slot IS NOT NULL AND slot = %s)',
                           {lit}, name, name || '_unkeyed_check', name || '_slot_check', n);
            EXECUTE format('ALTER TABLE %I.messages ATTACH PARTITION %I.%I FOR VALUES IN (%s)',
                           {lit}, {lit}, name, n);
        END
        $fn$
        """
    )
    op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.attach_message_slot(smallint) FROM PUBLIC")
    op.execute(
        f"""
        CREATE FUNCTION {s}.reclaim_messages(rotate_ms bigint, park_ms bigint, max_slots integer,
                                             channel text, max_moved integer DEFAULT 1000)
        RETURNS TABLE (slot smallint, rotated boolean, moved bigint, truncated integer, busy integer)
        LANGUAGE plpgsql SECURITY DEFINER
        SET search_path = pg_catalog, pg_temp
        SET lock_timeout = '{LOCK_TIMEOUT_MS}ms'
        AS $fn$
        DECLARE
            ring record;
            part record;
            cur smallint;
            target smallint;
            n bigint;
            occupied boolean;
            held boolean := false;
            emptied regclass[] := '{{}}';
        BEGIN
            rotated := false; moved := 0; truncated := 0; busy := 0;
            -- One caller at a time; the others return no row.
            SELECT r.slot, r.previous, r.rotated_at INTO ring
            FROM {s}.message_ring AS r FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                RETURN;
            END IF;
            cur := ring.slot;

            -- 1. Turn the ring: the current partition is rotate_ms old and has had rows.
            IF now() - ring.rotated_at >= rotate_ms * interval '1 millisecond'
               AND pg_relation_size(format('%I.%I', {lit}, 'messages_ring' || cur)::regclass) > 0 THEN
                -- An empty partition that no transaction holds now: one that a long transaction
                -- has read could not be emptied again until it ends.
                FOR part IN
                    {ring} ORDER BY 2
                LOOP
                    CONTINUE WHEN part.n = cur OR part.n IS NOT DISTINCT FROM ring.previous
                        OR pg_relation_size(part.rel) > 0;
                    BEGIN
                        EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part.rel);
                        target := part.n;
                        EXIT;
                    EXCEPTION WHEN lock_not_available THEN
                        busy := busy + 1;
                        held := true;
                    END;
                END LOOP;
                IF target IS NULL THEN
                    SELECT count(*) INTO n FROM ({ring}) AS p;
                    -- A new one when none is empty, or when the empty ones have been held for a
                    -- whole interval more (a claim holds one for milliseconds; a transaction that
                    -- read the table holds it until it ends).
                    IF n < max_slots
                       AND (NOT held
                            OR now() - ring.rotated_at >= 2 * rotate_ms * interval '1 millisecond') THEN
                        SELECT min(x) INTO target FROM generate_series(0, max_slots - 1) AS x
                        WHERE to_regclass(format('%I.%I', {lit}, 'messages_ring' || x)) IS NULL;
                        BEGIN
                            PERFORM {s}.attach_message_slot(target);
                        EXCEPTION WHEN lock_not_available THEN
                            target := NULL;
                            busy := busy + 1;
                        END;
                    ELSE
                        target := NULL;  -- the ring is full: the current partition keeps the inserts
                    END IF;
                END IF;
                IF target IS NOT NULL THEN
                    UPDATE {s}.message_ring
                    SET slot = target, previous = cur, rotated_at = now();
                    rotated := true;
                    ring.previous := cur;
                    cur := target;
                END IF;
            END IF;
            slot := cur;

            -- 2. Partitions older than the previous one: move their few pending rows, and
            --    empty those left with none (processing rows finish where they are).
            FOR part IN
                {ring} ORDER BY 2
            LOOP
                CONTINUE WHEN part.n = cur OR part.n IS NOT DISTINCT FROM ring.previous;
                CONTINUE WHEN pg_relation_size(part.rel) = 0;
                EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE state = ''processing'')', part.rel)
                    INTO occupied;
                CONTINUE WHEN occupied;
                EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %s WHERE state = ''pending'' '
                               'LIMIT %s) AS p', part.rel, max_moved + 1)
                    INTO n;
                CONTINUE WHEN n > max_moved;  -- a backlog: the consumers drain it in order
                IF n > 0 THEN
                    BEGIN
                        EXECUTE format(
                            'WITH gone AS (DELETE FROM %s WHERE state = ''pending'' RETURNING *), '
                            'placed AS (INSERT INTO %I.messages ({COLUMNS}, slot) '
                            'SELECT {COLUMNS}, CASE WHEN next_attempt_at > now() '
                            '+ %s * interval ''1 millisecond'' THEN -1 ELSE %s END '
                            'FROM gone RETURNING queue_name) '
                            'SELECT coalesce(sum(k), 0) FROM (SELECT k, pg_notify(%L, q) '
                            'FROM (SELECT queue_name AS q, count(*) AS k FROM placed GROUP BY 1) AS per_q) '
                            'AS woken',
                            part.rel, {lit}, park_ms, cur, channel)
                            INTO n;
                        moved := moved + n;
                    EXCEPTION WHEN lock_not_available THEN
                        busy := busy + 1;
                        CONTINUE;
                    END;
                END IF;
                emptied := emptied || part.rel;
            END LOOP;

            -- 3. Empty them, never waiting: a transaction holding one makes it wait for a later call.
            FOR part IN SELECT unnest(emptied) AS rel LOOP
                BEGIN
                    EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part.rel);
                    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', part.rel) INTO occupied;
                    IF NOT occupied THEN
                        EXECUTE format('TRUNCATE %s', part.rel);
                        truncated := truncated + 1;
                    END IF;
                EXCEPTION WHEN lock_not_available THEN
                    busy := busy + 1;
                END;
            END LOOP;
            RETURN NEXT;
        END
        $fn$
        """
    )
    op.execute(
        f"REVOKE EXECUTE ON FUNCTION {s}.reclaim_messages(bigint, bigint, integer, text, integer) FROM PUBLIC"
    )


def upgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    _swap_out(s)
    op.execute(
        f"""
        CREATE TABLE {s}.message_ring (
            one        boolean     PRIMARY KEY DEFAULT true CHECK (one),
            slot       smallint    NOT NULL,
            previous   smallint,
            rotated_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(f"INSERT INTO {s}.message_ring (slot) VALUES (0)")
    _functions(schema, s)
    _create_messages(
        s,
        f"slot smallint NOT NULL DEFAULT {s}.message_slot(),",
        "PRIMARY KEY (id, slot)",
        "PARTITION BY LIST (slot)",
    )
    _indexes(s, "idempotency_key, slot")
    op.execute(f"CREATE TABLE {s}.messages_vacuumed PARTITION OF {s}.messages FOR VALUES IN (-1)")
    for n in range(INITIAL_SLOTS):
        op.execute(f"SELECT {s}.attach_message_slot({n}::smallint)")
    op.execute(
        f"INSERT INTO {s}.messages ({COLUMNS}, slot) SELECT {COLUMNS}, "
        f"CASE WHEN idempotency_key IS NOT NULL OR next_attempt_at > enqueued_at + interval '{PARK_MS} ms' "
        f"THEN -1 ELSE 0 END FROM {s}.messages_old"
    )
    op.execute(f"DROP TABLE {s}.messages_old")
    _view(s)
    set_schema_revision(op.execute, schema, 13)


def downgrade() -> None:
    schema = schema_for_migration()
    s = quote_ident(schema)
    _swap_out(s)
    _create_messages(s, "", "PRIMARY KEY (id)", "")
    op.execute(f"ALTER TABLE {s}.messages DROP COLUMN slot")
    _indexes(s, "idempotency_key")
    op.execute(f"INSERT INTO {s}.messages ({COLUMNS}) SELECT {COLUMNS} FROM {s}.messages_old")
    op.execute(f"DROP TABLE {s}.messages_old")  # and its partitions
    op.execute(f"DROP FUNCTION {s}.reclaim_messages(bigint, bigint, integer, text, integer)")
    op.execute(f"DROP FUNCTION {s}.attach_message_slot(smallint)")
    op.execute(f"DROP FUNCTION {s}.message_slot()")
    op.execute(f"DROP TABLE {s}.message_ring")
    _view(s)
    set_schema_revision(op.execute, schema, 12)
