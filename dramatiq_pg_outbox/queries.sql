-- All SQL of the broker's hot path and maintenance, one query per
-- "-- name: <name> --" header (loaded by dramatiq_pg_outbox/_queries.py).
-- {schema} is replaced by the quoted schema name once per broker; parameters
-- are psycopg named placeholders with explicit casts.  Times compared across
-- processes always come from the database clock (now()).

-- name: enqueue --
-- Inserts any number of messages in one statement (one row per array element)
-- and wakes the listeners of every queue that got a message that is due now.
-- pg_notify is transactional: inside an application transaction the
-- notification is delivered at commit, never before; Postgres folds identical
-- notifications of one transaction, so there is one per queue at most.  The
-- payload is the queue name only (NOTIFY payloads are limited to 8000 bytes).
-- Idempotency: a row whose key (NULL for none) is already in the hot table
-- (unique partial index, ON CONFLICT DO NOTHING, also within this batch) or
-- in history (the message was processed) is skipped.  Rows without a key
-- never conflict.
WITH inserted AS (
    INSERT INTO {schema}.messages
        (queue_name, actor_name, message_id, next_attempt_at, payload, idempotency_key)
    SELECT q, a, m, now() + d * interval '1 millisecond', p, k
    FROM unnest(%(queue_names)s::text[], %(actor_names)s::text[], %(message_ids)s::text[],
                %(delays)s::bigint[], %(payloads)s::bytea[], %(idempotency_keys)s::text[])
        AS t(q, a, m, d, p, k)
    WHERE k IS NULL
       OR NOT EXISTS (SELECT 1 FROM {schema}.history AS h WHERE h.idempotency_key = t.k)
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING queue_name, next_attempt_at <= now() AS due
)
SELECT pg_notify(%(channel)s, queue_name)
FROM (SELECT DISTINCT queue_name FROM inserted WHERE due AND %(notify)s::boolean) AS woken;

-- name: enqueue_unkeyed --
-- The enqueue above for a batch in which no message has an idempotency key
-- (the common case): same rows and notifications, without the history check
-- and the ON CONFLICT arbiter.  Postgres makes a custom plan at every
-- execution of these statements (the array lengths are only known then), and
-- planning the history subquery doubled the cost of a one-message enqueue
-- (measured ~190 -> ~90 us per statement inside a transaction).
WITH inserted AS (
    INSERT INTO {schema}.messages (queue_name, actor_name, message_id, next_attempt_at, payload)
    SELECT q, a, m, now() + d * interval '1 millisecond', p
    FROM unnest(%(queue_names)s::text[], %(actor_names)s::text[], %(message_ids)s::text[],
                %(delays)s::bigint[], %(payloads)s::bytea[]) AS t(q, a, m, d, p)
    RETURNING queue_name, next_attempt_at <= now() AS due
)
SELECT pg_notify(%(channel)s, queue_name)
FROM (SELECT DISTINCT queue_name FROM inserted WHERE due AND %(notify)s::boolean) AS woken;

-- name: enqueue_one --
-- enqueue_unkeyed for exactly one message (one send() per transaction, the
-- outbox's common case): scalar parameters instead of arrays.  Adapting six
-- one-element arrays cost ~60 us of client CPU and unnest() ~35 us of server
-- time per statement.
WITH inserted AS (
    INSERT INTO {schema}.messages (queue_name, actor_name, message_id, next_attempt_at, payload)
    VALUES (%(queue_name)s::text, %(actor_name)s::text, %(message_id)s::text,
            now() + %(delay)s::bigint * interval '1 millisecond', %(payload)s::bytea)
    RETURNING queue_name, next_attempt_at <= now() AS due
)
SELECT pg_notify(%(channel)s, queue_name) FROM inserted WHERE due AND %(notify)s::boolean;

-- name: notify --
-- Wakes the listeners of the given queues (used after commit, or after a requeue).
SELECT pg_notify(%(channel)s, q) FROM unnest(%(queue_names)s::text[]) AS q;

-- name: claim --
-- Claims up to %(limit)s due messages of one queue for this consumer.
-- Why a CTE: the LIMIT and FOR UPDATE SKIP LOCKED must apply to the row
-- selection exactly once; written as "UPDATE ... WHERE id IN (subquery)" the
-- planner may flatten the subquery into a join and lock (or skip) more rows
-- than it returns under concurrency.  The selection is an index scan of
-- messages_ready_idx (equality on queue_name, range on next_attempt_at, same
-- ORDER BY), with no OR across states.  attempts is charged here, before the
-- actor runs, and every claim writes a fresh lease that fences later acks.
-- Why "= ANY (ARRAY(SELECT ...))" and not "FROM candidates": with statistics
-- taken while the table was nearly empty (autoanalyze between two bursts),
-- the generic plan of the join became a full scan of messages_pkey with the
-- CTE as the inner side, O(table) per claim: a claim of 64 took 795 ms
-- instead of 0.4 ms with 100k rows pending, a stall until the next
-- autoanalyze.  The array is
-- an InitPlan, so the UPDATE is always an index scan on the primary key.
WITH candidates AS (
    SELECT id
    FROM {schema}.messages
    WHERE queue_name = %(queue_name)s
      AND state = 'pending'
      AND next_attempt_at <= now()
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.messages AS m
SET state = 'processing',
    attempts = m.attempts + 1,
    lease = %(lease)s,
    owner = %(owner)s,
    acquired_at = now()
WHERE m.id = ANY (ARRAY(SELECT id FROM candidates))
RETURNING m.id, m.attempts, m.payload;

-- name: ack --
-- Archives completed messages: the DELETE and the INSERT into history are one
-- statement.  Fenced by lease: a row that was released and claimed again
-- elsewhere (new lease) is not touched; the caller counts those as stale.
WITH done AS (
    DELETE FROM {schema}.messages AS m
    USING unnest(%(ids)s::bigint[], %(leases)s::uuid[]) AS a(id, lease)
    WHERE m.id = a.id AND m.lease = a.lease AND m.state = 'processing'
    RETURNING m.*
)
INSERT INTO {schema}.history
    (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at, payload,
     idempotency_key)
SELECT id, queue_name, actor_name, message_id, 'completed', attempts, enqueued_at, acquired_at, payload,
       idempotency_key
FROM done;

-- name: archive --
-- Moves messages to history in state %(state)s with their error: failed for a
-- dead letter (nack), completed for an acked delivery whose actor raised
-- (Retries enqueued its retry).  Fenced like ack.
WITH failed AS (
    DELETE FROM {schema}.messages AS m
    USING unnest(%(ids)s::bigint[], %(leases)s::uuid[], %(error_types)s::text[], %(errors)s::text[])
        AS a(id, lease, error_type, error)
    WHERE m.id = a.id AND m.lease = a.lease AND m.state = 'processing'
    RETURNING m.*, a.error_type AS failure_type, a.error AS failure
)
INSERT INTO {schema}.history
    (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at,
     error_type, error, payload, idempotency_key)
SELECT id, queue_name, actor_name, message_id, %(state)s, attempts, enqueued_at, acquired_at,
       failure_type, failure, payload, idempotency_key
FROM failed;

-- name: requeue --
-- Hands claimed but unstarted messages back at once, without charging them
-- the attempt their claim took.  Fenced like ack.  Wakes the listeners of
-- those queues in the same statement (unless %(notify)s is false) and returns
-- the released count per queue.
WITH released AS (
    UPDATE {schema}.messages AS m
    SET state = 'pending', attempts = greatest(m.attempts - 1, 0), lease = NULL, owner = NULL
    FROM unnest(%(ids)s::bigint[], %(leases)s::uuid[]) AS a(id, lease)
    WHERE m.id = a.id AND m.lease = a.lease AND m.state = 'processing'
    RETURNING m.queue_name
),
per_queue AS (
    SELECT queue_name, count(*) AS n FROM released GROUP BY queue_name
)
SELECT queue_name, n, CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, queue_name) END
FROM per_queue;

-- name: heartbeat --
INSERT INTO {schema}.workers (id, hostname, pid, queues)
VALUES (%(id)s, %(hostname)s, %(pid)s, %(queues)s::text[])
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), queues = excluded.queues;

-- name: unregister_worker --
DELETE FROM {schema}.workers WHERE id = %(id)s;

-- name: rescue --
-- Releases messages whose owner stopped heartbeating (crashed, killed,
-- partitioned away) or whose claim is older than the optional hard bound,
-- and quarantines those already delivered max_deliveries times: they go to
-- history as failed and never run again.  Liveness, not task length, decides,
-- so a long task of a live worker is never taken away.  SKIP LOCKED keeps
-- concurrent rescuers (one per worker process) and flushes out of each
-- other's way.  Dead worker rows are dropped in the same statement.
WITH stuck AS (
    SELECT m.id
    FROM {schema}.messages AS m
    WHERE m.state = 'processing'
      AND (
        NOT EXISTS (
            SELECT 1 FROM {schema}.workers AS w
            WHERE w.id = m.owner
              AND w.heartbeat_at >= now() - %(heartbeat_timeout_ms)s * interval '1 millisecond'
        )
        OR m.acquired_at < now() - %(max_lease_ms)s::bigint * interval '1 millisecond'
      )
    FOR UPDATE OF m SKIP LOCKED
),
quarantined AS (
    DELETE FROM {schema}.messages AS m
    USING stuck
    WHERE m.id = stuck.id AND m.attempts >= %(max_deliveries)s
    RETURNING m.*
),
archived AS (
    INSERT INTO {schema}.history
        (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at,
         error_type, error, payload, idempotency_key)
    SELECT id, queue_name, actor_name, message_id, 'failed', attempts, enqueued_at, acquired_at,
           'MaxDeliveriesExceeded',
           format('quarantined: delivered %%s times without an ack (max_deliveries=%%s); '
                  'its worker probably died while running it', attempts, %(max_deliveries)s),
           payload, idempotency_key
    FROM quarantined
    RETURNING queue_name
),
released AS (
    UPDATE {schema}.messages AS m
    SET state = 'pending', lease = NULL, owner = NULL
    FROM stuck
    WHERE m.id = stuck.id AND m.attempts < %(max_deliveries)s
    RETURNING m.queue_name
),
dead_workers AS (
    DELETE FROM {schema}.workers
    WHERE heartbeat_at < now() - %(heartbeat_timeout_ms)s * interval '1 millisecond'
    RETURNING id
),
woken AS (
    SELECT pg_notify(%(channel)s, queue_name) FROM (SELECT DISTINCT queue_name FROM released) AS q
)
SELECT (SELECT count(*) FROM released),
       (SELECT count(*) FROM archived),
       (SELECT count(*) FROM dead_workers),
       (SELECT count(*) FROM woken);

-- name: release_orphans --
-- Releases rows this live process holds in the database but not in memory:
-- a claim whose reply was lost with the connection.  They never reached an
-- actor, so their attempt is given back.  The grace period keeps claims that
-- are still on their way to memory out of reach.
WITH orphans AS (
    UPDATE {schema}.messages AS m
    SET state = 'pending', attempts = greatest(m.attempts - 1, 0), lease = NULL, owner = NULL
    WHERE m.owner = %(owner)s
      AND m.state = 'processing'
      AND m.acquired_at < now() - %(grace_ms)s * interval '1 millisecond'
      AND NOT (m.id = ANY(%(known_ids)s::bigint[]))
    RETURNING m.queue_name
)
SELECT count(*) FROM orphans;

-- name: queue_size --
-- One statement, hence one snapshot: pending, delayed and in-flight rows of a
-- queue and of its delay queue are counted atomically.
SELECT count(*) FROM {schema}.messages WHERE queue_name = ANY(%(queue_names)s::text[]);

-- name: purge --
DELETE FROM {schema}.messages WHERE queue_name = ANY(%(queue_names)s::text[]);

-- name: schema_revision --
SELECT to_regclass(%(table)s) IS NOT NULL, obj_description(to_regclass(%(table)s), 'pg_class');
