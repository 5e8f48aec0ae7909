-- All SQL of the broker's hot path and maintenance, one query per
-- "-- name: <name> --" header (loaded by dramatiq_pg_outbox/_queries.py).
-- {schema} is replaced by the quoted schema name once per broker; parameters
-- are psycopg named placeholders with explicit casts.  Times compared across
-- processes always come from the database clock (now()).

-- fragment: worker_alive --
-- The one rule for "worker process w is alive": it heartbeated within
-- heartbeat_timeout (milliseconds), on the database clock.  Used by the
-- consumers' ranking, the rescuer (which releases the claims of the others and
-- drops their rows), the Prometheus gauge and the dashboard.
w.heartbeat_at >= now() - %(heartbeat_timeout_ms)s::bigint * interval '1 millisecond'

-- fragment: dead_letter_filter --
-- The one selection of dead letters (history rows, unqualified columns): by queue,
-- actor, error type and a case-insensitive search in the error text (or an exact
-- message id), each NULL for any.  The dashboard's failed list and retry_failed
-- (its Retry, the CLI's retry-failed) apply it: a retry moves what the page shows.
(%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s)
AND (%(actor_name)s::text IS NULL OR actor_name = %(actor_name)s)
AND (%(error_type)s::text IS NULL OR error_type = %(error_type)s)
AND (%(search)s::text IS NULL
     OR strpos(lower(coalesce(error, '')), lower(%(search)s)) > 0
     OR message_id = %(search)s)

-- fragment: fenced --
-- The lease fence of ack, archive, requeue and relay_release: the row still
-- carries the lease of the delivery that decided (a row released and claimed
-- again elsewhere has a new lease, and the stale decision is not applied).
-- %(fences)s holds "<row id>/<lease>" per decision; with the row ids as an
-- index condition (m.id = ANY(%(ids)s)) this is a filter of the rows found,
-- never a join: joined with unnest(ids, leases), the planner probed the
-- messages partitions in a nested loop, and for a drained partition whose
-- statistics said 0 rows (vacuumed while the horizon was pinned) it read the
-- whole primary key index once per decision (an ack of 256 took 27 s in chaos
-- scenario 10).  The fence array is searched once per row found: an ack of
-- 1,000 took 13 ms prepared and 12 ms planned each time (the planning of the
-- partitions, 0.7 ms, cost more than the hash lookup saved at 64 rows).
(m.id::text || '/' || m.lease::text) = ANY(%(fences)s::text[])

-- fragment: claim_update --
-- The update of claim, claim_prioritized, claim_keyed and claim_queues (which
-- joins its rows to their queue by queue_name): the rows of their candidates CTE
-- become this consumer's, under a fresh lease, attempts charged (see claim).
UPDATE {schema}.messages AS m
SET state = 'processing',
    attempts = m.attempts + 1,
    lease = %(lease)s,
    owner = %(owner)s,
    acquired_at = now()
WHERE m.id = ANY (ARRAY(SELECT id FROM candidates))
RETURNING m.queue_name, m.id, m.attempts, m.payload, m.priority,
          m.next_attempt_at AS due_at, m.concurrency_key IS NOT NULL AS keyed

-- fragment: claim_from --
-- The watermark bound of claim and claim_prioritized (see claim): only rows
-- after (%(from_at)s, %(from_id)s) in claim order, a range condition of
-- messages_ready_idx; both NULL for a sweep, which reads the queue's index
-- range from its start.
(next_attempt_at, id) > (coalesce(%(from_at)s::timestamptz, '-infinity'::timestamptz),
                         coalesce(%(from_id)s::bigint, 0))

-- fragment: claim_clock --
-- The clock row of claim and claim_prioritized (see claim): when to claim
-- next, the database clock, and whether the queue has prioritized rows
-- pending (in the statement's snapshot: rows it claims still count, so the
-- claim after the last prioritized ones is one more claim_prioritized).
SELECT (extract(epoch FROM coalesce(
            (SELECT at
             FROM (SELECT next_attempt_at AS at
                   FROM {schema}.messages
                   WHERE queue_name = %(queue_name)s
                     AND state = 'pending'
                     AND next_attempt_at > now()
                   ORDER BY next_attempt_at
                   LIMIT %(look_ahead)s) AS upcoming
             WHERE floor(extract(epoch FROM at) * 1000)::bigint %% %(consumers)s::bigint = %(rank)s
             LIMIT 1),
            (SELECT next_attempt_at
             FROM {schema}.messages
             WHERE queue_name = %(queue_name)s
               AND state = 'pending'
               AND next_attempt_at > now()
             ORDER BY next_attempt_at
             OFFSET %(look_ahead)s - 1
             LIMIT 1)
        ) - now()) * 1000)::float8 AS next_due_in_ms,
       (extract(epoch FROM now()) * 1000)::float8 AS db_now_ms,
       EXISTS (SELECT 1 FROM {schema}.messages
               WHERE queue_name = %(queue_name)s AND state = 'pending' AND priority > 0) AS prioritized,
       -- Whether the queue has messages with a concurrency key pending (a probe of the
       -- partial index messages_keyed_idx, which holds only those): then claim_keyed.
       EXISTS (SELECT 1 FROM {schema}.messages
               WHERE queue_name = %(queue_name)s AND state = 'pending' AND concurrency_key IS NOT NULL) AS keyed

-- name: enqueue --
-- Inserts any number of messages in one statement (one row per array element)
-- and wakes the listeners of every queue that got a message: the payload is the
-- queue name for a message due now, or "<queue>@<due>" (due = epoch
-- milliseconds, database clock) for the earliest delayed message of a queue,
-- when it is due within %(notify_within)s ms (later ones are seen by the
-- consumers' own polls, which learn the next due time from every claim);
-- "<queue>!" or "<queue>!@<due>" when a message has a broker_priority: its
-- consumers claim with claim_prioritized from then on.
-- Result rows (payload, notified, key, id, message_id), each row filling one part:
-- one per wake-up payload (sent by pg_notify only if %(notify)s; otherwise the
-- caller sends it after commit); in this keyed form, one per idempotency key
-- actually inserted, so that Dramatiq's after_enqueue runs only for messages
-- that were stored; with %(return_ids)s, one per inserted row (the outbox
-- checks at commit which rows written inside a savepoint survived).
-- pg_notify is transactional: inside an application transaction the
-- notification is delivered at commit, never before; Postgres folds identical
-- notifications of one transaction, so there is one per queue at most.  The
-- payload is the queue name only (NOTIFY payloads are limited to 8000 bytes).
-- Idempotency: of the messages with one key, only the first of the batch may
-- be stored, and only if this statement inserts the key's row in
-- idempotency_keys (migration 0014), which it does ON CONFLICT DO NOTHING.
-- That row is the key's one arbiter: written with the key's first message and
-- never deleted while the message is in messages or history (the ack moves the
-- message and leaves the row alone), so a later send meets it whenever it
-- runs.  Under READ COMMITTED a send that meets a row another transaction is
-- inserting waits for it and skips the key if it commits; under REPEATABLE
-- READ and SERIALIZABLE it fails with a serialization error when that row
-- committed after its snapshot: never both stored.  The keys are inserted in
-- key order, so two batches of the same keys never deadlock.  The history
-- check and the ON CONFLICT on messages refuse the keys an older version of
-- the package stored without a row (during a rolling upgrade): a key that has
-- a row is never stored twice without them.  Rows without a key never conflict.
-- Partitions (migration 0013): keyed rows and rows due more than
-- %(park_after_ms)s after now go to messages_vacuumed (slot -1), where the
-- key's unique index on (idempotency_key, slot) holds across the table (no
-- ring partition may hold a key); the others to the ring's current partition.
-- The insert keeps the order of the arrays (ORDER BY n): ids follow the sends.
WITH batch AS (
    SELECT t.*, row_number() OVER (PARTITION BY t.k ORDER BY t.n) = 1 AS first
    FROM unnest(%(queue_names)s::text[], %(actor_names)s::text[], %(message_ids)s::text[],
                %(delays)s::bigint[], %(payloads)s::bytea[], %(idempotency_keys)s::text[],
                %(priorities)s::smallint[], %(concurrency_keys)s::text[], %(concurrency_limits)s::integer[])
        WITH ORDINALITY AS t(q, a, m, d, p, k, pr, ck, cl, n)
),
claimed AS (
    INSERT INTO {schema}.idempotency_keys (idempotency_key)
    SELECT b.k FROM batch AS b
    WHERE b.k IS NOT NULL AND b.first
      AND NOT EXISTS (SELECT 1 FROM {schema}.history AS h WHERE h.idempotency_key = b.k)
    ORDER BY b.k
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
),
inserted AS (
    INSERT INTO {schema}.messages
        (queue_name, actor_name, message_id, next_attempt_at, payload, idempotency_key, priority, slot,
         concurrency_key, concurrency_limit)
    SELECT q, a, m, now() + d * interval '1 millisecond', p, k, pr,
           CASE WHEN k IS NOT NULL OR d > %(park_after_ms)s::bigint THEN -1
                ELSE (SELECT {schema}.message_slot()) END,
           ck, cl
    FROM batch AS t
    WHERE k IS NULL OR (t.first AND k IN (SELECT idempotency_key FROM claimed))
    ORDER BY n
    ON CONFLICT (idempotency_key, slot) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, message_id, queue_name, next_attempt_at, idempotency_key, priority
),
woken AS (
    SELECT queue_name || CASE WHEN max(priority) > 0 THEN '!' ELSE '' END
           || CASE WHEN min(next_attempt_at) <= now() THEN ''
                   ELSE '@' || floor(extract(epoch FROM min(next_attempt_at)) * 1000)::bigint
              END AS payload
    FROM inserted
    WHERE next_attempt_at <= now() + %(notify_within)s::bigint * interval '1 millisecond'
    GROUP BY queue_name
)
SELECT payload, CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, payload) END,
       NULL::text, NULL::bigint, NULL::text
FROM woken
UNION ALL
SELECT NULL, NULL, idempotency_key, NULL, NULL FROM inserted WHERE idempotency_key IS NOT NULL
UNION ALL
SELECT NULL, NULL, NULL, id, message_id FROM inserted WHERE %(return_ids)s::boolean;

-- name: enqueue_unkeyed --
-- The enqueue above for a batch in which no message has an idempotency key
-- (the common case): same rows and notifications, without the history check
-- and the ON CONFLICT arbiter.  Postgres makes a custom plan at every
-- execution of these statements (the array lengths are only known then), and
-- planning the history subquery doubled the cost of a one-message enqueue
-- (measured ~190 -> ~90 us per statement inside a transaction).
WITH inserted AS (
    INSERT INTO {schema}.messages (queue_name, actor_name, message_id, next_attempt_at, payload, priority, slot)
    SELECT q, a, m, now() + d * interval '1 millisecond', p, pr,
           CASE WHEN d > %(park_after_ms)s::bigint THEN -1 ELSE (SELECT {schema}.message_slot()) END
    FROM unnest(%(queue_names)s::text[], %(actor_names)s::text[], %(message_ids)s::text[],
                %(delays)s::bigint[], %(payloads)s::bytea[], %(priorities)s::smallint[])
        AS t(q, a, m, d, p, pr)
    RETURNING id, message_id, queue_name, next_attempt_at, priority
)
SELECT payload, CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, payload) END,
       NULL::text, NULL::bigint, NULL::text
FROM (
    SELECT queue_name || CASE WHEN max(priority) > 0 THEN '!' ELSE '' END
           || CASE WHEN min(next_attempt_at) <= now() THEN ''
                   ELSE '@' || floor(extract(epoch FROM min(next_attempt_at)) * 1000)::bigint
              END AS payload
    FROM inserted
    WHERE next_attempt_at <= now() + %(notify_within)s::bigint * interval '1 millisecond'
    GROUP BY queue_name
) AS woken
UNION ALL
SELECT NULL, NULL, NULL, id, message_id FROM inserted WHERE %(return_ids)s::boolean;

-- name: enqueue_one --
-- enqueue_unkeyed for exactly one message (one send() per transaction, the
-- outbox's common case): scalar parameters instead of arrays.  Adapting six
-- one-element arrays cost ~60 us of client CPU and unnest() ~35 us of server
-- time per statement.
WITH inserted AS (
    INSERT INTO {schema}.messages (queue_name, actor_name, message_id, next_attempt_at, payload, priority, slot)
    VALUES (%(queue_name)s::text, %(actor_name)s::text, %(message_id)s::text,
            now() + %(delay)s::bigint * interval '1 millisecond', %(payload)s::bytea,
            %(priority)s::smallint,
            CASE WHEN %(delay)s::bigint > %(park_after_ms)s::bigint THEN -1 ELSE {schema}.message_slot() END)
    RETURNING id, message_id, queue_name, next_attempt_at, priority
)
SELECT payload, CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, payload) END,
       NULL::text, NULL::bigint, NULL::text
FROM (
    SELECT queue_name || CASE WHEN priority > 0 THEN '!' ELSE '' END
           || CASE WHEN next_attempt_at <= now() THEN ''
                   ELSE '@' || floor(extract(epoch FROM next_attempt_at) * 1000)::bigint
              END AS payload
    FROM inserted
    WHERE next_attempt_at <= now() + %(notify_within)s::bigint * interval '1 millisecond'
) AS woken
UNION ALL
SELECT NULL, NULL, NULL, id, message_id FROM inserted WHERE %(return_ids)s::boolean;

-- name: notify --
-- Wakes the listeners of the given queues (used after commit, or after a requeue).
-- The values are NOTIFY payloads: "<queue>" or "<queue>@<due>" (see enqueue).
SELECT pg_notify(%(channel)s, q) FROM unnest(%(queue_names)s::text[]) AS q;

-- name: pin_read_committed --
-- Run once on each new autocommit connection of the package (_isolation.py): on a
-- direct connection (the backend's pid is the one the server announced at connect),
-- makes READ COMMITTED the session's default, which then holds for every statement
-- of the session; through a pooler that runs the client's transactions on shared
-- server connections (PgBouncer's transaction pooling: the announced pid is its
-- own), sets nothing and returns no row: each statement then says its level.
SELECT set_config('default_transaction_isolation', 'read committed', false)
WHERE pg_backend_pid() = %(backend_pid)s::integer;

-- name: begin_read_committed --
-- Opens the transaction of a statement run alone on an autocommit connection
-- whose session default could not be set (pin_read_committed), sent as one query
-- with the statement and commit (_isolation.py): every statement of the package is
-- written for READ COMMITTED, whatever the session's default.
BEGIN ISOLATION LEVEL READ COMMITTED;

-- name: commit --
COMMIT;

-- name: listen --
-- Subscribes a connection to a broker's or results' channel ({channel}: names.channel_for).
LISTEN {channel};

-- name: unlisten --
-- Ends the LISTEN of the listener's pooling probe (_runtime/listener.py, probe_listen).
UNLISTEN {channel};

-- name: session_settings --
-- Set on each connection of a broker's pool (unless prepare_threshold is None,
-- PgBouncer's transaction pooling, where a session setting would reach other
-- clients of the server connection).
-- jit = off: the planner's estimates for the worker's statements grow with the
-- table, not with the rows they touch (an id array from an InitPlan, a table
-- with no statistics yet), and past jit_above_cost (100,000) PostgreSQL
-- compiled each execution's expressions with LLVM: the rescuer's statement,
-- which found nothing to do in 0.1 ms, took 72 ms a pass with 1,000,000 rows
-- pending (benchmarks/README.md, section 33: the backlog scenario's printout of
-- the statements' times, JIT included).  Statements that touch a few rows by
-- index gain nothing from JIT.
-- plan_cache_mode: its prepared statements run one generic plan, never a custom plan per
-- execution.  Postgres chose custom plans for the claim, and planning it over
-- the partitions of messages (migration 0013) cost 1.6 ms of a 1.6 ms claim of
-- 64: with generic plans a claim took 0.83 ms (300 claims on one connection;
-- 1.0 ms on the table before it was partitioned).  Every statement of the hot
-- path has the same best plan whatever its parameters (index scans bounded by
-- queue, due time and watermark; probes by id).
SELECT set_config('plan_cache_mode', 'force_generic_plan', false), set_config('jit', 'off', false);

-- name: current_xact_id --
-- The transaction's id (the outbox sends a prepared transaction's wake-ups after its commit).
SELECT pg_current_xact_id()::text;

-- name: surviving_ids --
-- Which of these rows, written earlier in this transaction, still exist.
SELECT id FROM {schema}.messages WHERE id = ANY(%(ids)s::bigint[]);

-- name: notify_committed --
-- notify="after_commit" for a Connection bind, which has no after-commit hook:
-- the enqueueing transaction recorded its id; the payloads are sent once
-- pg_xact_status says it committed, dropped if it aborted, and kept for the
-- next flush while it is still in progress.
WITH t AS (
    SELECT xid, payload, pg_xact_status(xid::xid8) AS status
    FROM unnest(%(xids)s::text[], %(payloads)s::text[]) AS t(xid, payload)
),
sent AS (
    SELECT pg_notify(%(channel)s, payload) FROM (SELECT DISTINCT payload FROM t WHERE status = 'committed') AS d
)
SELECT xid, payload, status FROM t WHERE (SELECT count(*) FROM sent) >= 0;

-- name: claim --
-- Claims up to %(limit)s due messages of one queue for this consumer, and
-- tells it when to claim next.
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
-- The clock row tells the consumer when to claim next without converting
-- clocks: next_due_in_ms is how long, from this statement's now(), until the
-- earliest pending row of the queue that is not due yet and whose due time d
-- (epoch ms, floored: the number a "<queue>@<due>" notification carries) is
-- this consumer's, d mod %(consumers)s = %(rank)s (see consumer_rank): one
-- consumer, not every worker process, wakes for each due time.  The first
-- subquery reads upcoming rows in order (an index-only scan of
-- messages_ready_idx from (queue_name, now())) until one is ours, about
-- %(consumers)s entries, at most %(look_ahead)s; if none of those is ours, the
-- second returns the due time of the last one read (COALESCE evaluates it only
-- then), so a row of ours further on is never missed and many rows due at the
-- same instant wake everyone.  NULL: nothing of ours is upcoming.  db_now_ms is now() in epoch milliseconds: the
-- consumer estimates from it the offset that turns the due times of
-- notifications into its own clock.  The clock columns are on every returned
-- row; a claim of nothing returns one row whose id is NULL.  Rows just claimed
-- are due (<= now()), so the probe never returns them.
-- The watermark (claim_from, issue 20): a claimed row leaves a dead entry in
-- messages_ready_idx, which vacuum removes, and which a later scan marks dead
-- so that the next one skips it, only once no transaction can still see the
-- row.  While a long transaction, a replication slot or hot_standby_feedback
-- pins that horizon, every entry claimed since stays, and a claim that starts
-- at the queue's first entry visits all of them and their heap tuples before
-- it finds a pending row: 38,000 buffers and 217 ms per claim after ten
-- minutes at 2,000 msg/s (docs/chaos.md, scenario 10).  So the consumer
-- passes (%(from_at)s, %(from_id)s), the claim-order key of the latest row
-- it had claimed a second ago (_runtime/watermark.py), and the scan
-- starts there: it passes over the entries claimed in the last second, not
-- over every entry claimed since the horizon was pinned.  About once a
-- second, and soon after a notification, it passes NULLs
-- instead: a sweep from the start, which finds the rows a watermark passes
-- over (committed by a transaction that inserted them before that latest row
-- was claimed, or released back to pending by requeue or the rescuer).
-- due_at is each claimed row's due time, from which the consumer keeps its
-- watermark.
-- Priorities (broker_priority, migration 0010): this claim ignores them, as
-- every claim did before them: prioritized is whether the queue has pending
-- rows of priority > 0 (one probe of the partial index messages_priority_idx,
-- which holds only those rows), and while it has, the consumer claims with
-- claim_prioritized instead.  Each row returns its priority: the consumer
-- hands them to the worker by priority, then id (Dramatiq's worker runs the
-- messages of one actor priority in the order they were handed to it).
WITH candidates AS (
    SELECT id
    FROM {schema}.messages
    WHERE queue_name = %(queue_name)s
      AND state = 'pending'
      AND next_attempt_at <= now()
      AND {claim_from}
      -- Messages with a concurrency key are claimed by claim_keyed only.
      AND concurrency_key IS NULL
      -- A paused queue (queue_pauses) is not claimed: a one-time primary-key probe.
      AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses WHERE queue_name = %(queue_name)s)
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
claimed AS {claim_update},
clock AS {claim_clock}
SELECT claimed.id, claimed.attempts, claimed.payload, clock.next_due_in_ms, clock.db_now_ms, claimed.priority,
       clock.prioritized, claimed.due_at, clock.keyed, claimed.keyed AS row_keyed
FROM clock LEFT JOIN claimed ON true;

-- name: claim_prioritized --
-- The claim of a queue that has prioritized rows (see claim, which says when):
-- the due rows of priority > 0 first, highest first, then in due order, from
-- messages_priority_idx; the rows of priority 0 from messages_ready_idx, as
-- claim reads them, for the rest of the batch.  Same columns as claim.
WITH prioritized AS (
    SELECT id
    FROM {schema}.messages
    WHERE queue_name = %(queue_name)s
      AND state = 'pending'
      AND priority > 0
      AND next_attempt_at <= now()
      AND concurrency_key IS NULL
      AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses WHERE queue_name = %(queue_name)s)
    ORDER BY priority DESC, next_attempt_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
),
unprioritized AS (
    SELECT id
    FROM {schema}.messages
    WHERE queue_name = %(queue_name)s
      AND state = 'pending'
      AND next_attempt_at <= now()
      AND priority = 0
      AND {claim_from}
      AND concurrency_key IS NULL
      AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses WHERE queue_name = %(queue_name)s)
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s - (SELECT count(*) FROM prioritized)
    FOR UPDATE SKIP LOCKED
),
candidates AS (
    SELECT id FROM prioritized UNION ALL SELECT id FROM unprioritized
),
claimed AS {claim_update},
clock AS {claim_clock}
SELECT claimed.id, claimed.attempts, claimed.payload, clock.next_due_in_ms, clock.db_now_ms, claimed.priority,
       clock.prioritized, claimed.due_at, clock.keyed, claimed.keyed AS row_keyed
FROM clock LEFT JOIN claimed ON true;

-- name: claim_queues --
-- The plain claim (see claim) of several queues of one worker process in one
-- statement (issue 37, part 3): one element of the arrays per queue, each
-- with its own limit, watermark and rank, so no queue takes another's slots.
-- Each queue's rows are its own LATERAL index scan of messages_ready_idx,
-- the same as claim's (due order, FOR UPDATE SKIP LOCKED, no concurrency
-- key, the pause probe); the consumers of keyed or prioritized queues claim
-- alone.  The queue names must be distinct (a row locked by this statement
-- is not skipped by its next LATERAL).  One row per queue carries the
-- queue's clock columns (claim_clock's, per queue: the consumer's next due
-- time, prioritized and keyed pending), with the claimed rows of that queue
-- or one row whose id is NULL.  All rows take one lease: the lease fences a
-- delivery by row id, and a row is claimed once.
WITH q AS (
    SELECT *
    FROM unnest(%(queue_names)s::text[], %(limits)s::bigint[], %(from_ats)s::timestamptz[],
                %(from_ids)s::bigint[], %(consumers)s::bigint[], %(ranks)s::bigint[])
         AS q(queue_name, lim, from_at, from_id, consumers, rank)
),
candidates AS (
    SELECT c.id
    FROM q CROSS JOIN LATERAL (
        SELECT id
        FROM {schema}.messages
        WHERE queue_name = q.queue_name
          AND state = 'pending'
          AND next_attempt_at <= now()
          AND (next_attempt_at, id) > (coalesce(q.from_at, '-infinity'::timestamptz), coalesce(q.from_id, 0))
          AND concurrency_key IS NULL
          AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses p WHERE p.queue_name = q.queue_name)
        ORDER BY next_attempt_at, id
        LIMIT q.lim
        FOR UPDATE SKIP LOCKED
    ) AS c
),
claimed AS {claim_update},
-- Materialized: inlined into the join below, its probes ran once per claimed row.
clock AS MATERIALIZED (
    SELECT q.queue_name,
           (extract(epoch FROM coalesce(
                (SELECT at
                 FROM (SELECT next_attempt_at AS at
                       FROM {schema}.messages
                       WHERE queue_name = q.queue_name
                         AND state = 'pending'
                         AND next_attempt_at > now()
                       ORDER BY next_attempt_at
                       LIMIT %(look_ahead)s) AS upcoming
                 WHERE floor(extract(epoch FROM at) * 1000)::bigint %% q.consumers = q.rank
                 LIMIT 1),
                (SELECT next_attempt_at
                 FROM {schema}.messages
                 WHERE queue_name = q.queue_name
                   AND state = 'pending'
                   AND next_attempt_at > now()
                 ORDER BY next_attempt_at
                 OFFSET %(look_ahead)s - 1
                 LIMIT 1)
            ) - now()) * 1000)::float8 AS next_due_in_ms,
           EXISTS (SELECT 1 FROM {schema}.messages
                   WHERE queue_name = q.queue_name AND state = 'pending' AND priority > 0) AS prioritized,
           EXISTS (SELECT 1 FROM {schema}.messages
                   WHERE queue_name = q.queue_name AND state = 'pending'
                     AND concurrency_key IS NOT NULL) AS keyed
    FROM q
)
SELECT clock.queue_name, claimed.id, claimed.attempts, claimed.payload, clock.next_due_in_ms,
       (extract(epoch FROM now()) * 1000)::float8 AS db_now_ms, claimed.priority,
       clock.prioritized, claimed.due_at, clock.keyed, claimed.keyed AS row_keyed
FROM clock LEFT JOIN claimed ON claimed.queue_name = clock.queue_name;

-- name: claim_keys --
-- The first statement of a keyed claim (claim_keyed, in one READ COMMITTED
-- transaction): up to %(keys)s concurrency keys of the queue that have a due
-- pending message, in key order after %(after_key)s (NULL: from the first; the
-- consumer passes the last key of its previous claim, so that its claims
-- rotate over the keys: a key with a million messages waiting and a key with
-- ten both progress), each locked for this transaction with a transaction-level
-- advisory lock (%(lock_space)s, hashtext(key)).  A key that another claim
-- holds is skipped: that claim decides for it.  The walk reads the key's first
-- entry in messages_keyed_idx and jumps to the next key (a loose index scan,
-- one probe per key, at most %(walk)s keys).  Returns the key and the limit its
-- first message carries.
WITH RECURSIVE walk AS (
    (SELECT m.concurrency_key AS key, m.next_attempt_at AS head, m.concurrency_limit AS lim, 1 AS n
     FROM {schema}.messages AS m
     WHERE m.queue_name = %(queue_name)s AND m.state = 'pending' AND m.concurrency_key IS NOT NULL
       AND m.concurrency_key > coalesce(%(after_key)s::text, '')
     ORDER BY m.concurrency_key, m.next_attempt_at, m.id
     LIMIT 1)
    UNION ALL
    SELECT nxt.key, nxt.head, nxt.lim, walk.n + 1
    FROM walk, LATERAL (
        SELECT m.concurrency_key AS key, m.next_attempt_at AS head, m.concurrency_limit AS lim
        FROM {schema}.messages AS m
        WHERE m.queue_name = %(queue_name)s AND m.state = 'pending' AND m.concurrency_key IS NOT NULL
          AND m.concurrency_key > walk.key
        ORDER BY m.concurrency_key, m.next_attempt_at, m.id
        LIMIT 1) AS nxt
    WHERE walk.n < %(walk)s
)
SELECT due.key, due.lim
FROM (SELECT key, lim FROM walk WHERE head <= statement_timestamp() LIMIT %(keys)s) AS due
WHERE pg_try_advisory_xact_lock(%(lock_space)s::integer, hashtext(due.key));

-- name: claim_keyed --
-- The second statement of a keyed claim, after claim_keys locked %(keys)s in
-- this transaction: a new snapshot (READ COMMITTED), so that it sees every
-- claim of these keys that committed before their locks were free.  Only
-- claims make a key's messages processing, and every claim of a key holds its
-- lock until it commits, so the count of processing messages per key is exact
-- here (an ack committed since can only make it smaller: a slot seen late,
-- never one too many).  The limit of a key: the run-time one of its longest
-- prefix among the queue's own limits, else among those of every queue
-- (concurrency_limits, queue_name ''), else the one its first message carries
-- (%(limits)s, NULL: 1).  Each key gives at most %(per_key)s messages, its
-- due ones by priority, then oldest first (FIFO within a priority of a key):
-- the prioritized ones from messages_priority_idx (a probe of an empty range
-- when the queue has none), whatever the consumer last learnt, since a key's
-- slot may free before the notification of a prioritized message reaches it;
-- messages without a key fill the rest of the batch as claim_prioritized (while
-- %(prioritized)s: the queue had some pending, see claim) or claim takes them.
-- Due means due at statement_timestamp(), not now(): now() is when claim_keys
-- began the transaction, and a message stored since, visible to this statement,
-- would wait for the next claim (a prioritized one behind older ones).  The messages without a key are looked for only if
-- %(unkeyed)s: their scan of messages_ready_idx passes over every due keyed
-- entry of the queue (20 ms a claim behind 43,000 waiting keyed messages,
-- benchmarks/README.md section 21b), so the consumer skips it after one found
-- none, until a message is stored (a notification), one of its due times comes,
-- or a second passed.  Same columns as claim.
WITH keys AS (
    SELECT k.key,
           greatest(coalesce(
               (SELECT l.max_running FROM {schema}.concurrency_limits AS l
                WHERE l.queue_name IN (%(queue_name)s, '') AND starts_with(k.key, l.prefix)
                ORDER BY l.queue_name = '', length(l.prefix) DESC LIMIT 1),
               k.lim, 1)
             - (SELECT count(*) FROM {schema}.messages AS r
                WHERE r.concurrency_key = k.key AND r.state = 'processing'), 0) AS free
    FROM unnest(%(keys)s::text[], %(limits)s::integer[]) AS k(key, lim)
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses WHERE queue_name = %(queue_name)s)
),
keyed_prioritized AS (
    SELECT keys.key, picked.id
    FROM keys, LATERAL (
        SELECT m.id
        FROM {schema}.messages AS m
        WHERE m.queue_name = %(queue_name)s AND m.state = 'pending' AND m.priority > 0
          AND m.concurrency_key = keys.key AND m.next_attempt_at <= statement_timestamp()
        ORDER BY m.priority DESC, m.next_attempt_at, m.id
        LIMIT least(keys.free, %(per_key)s)
        FOR UPDATE SKIP LOCKED
    ) AS picked
),
keyed_rest AS (
    SELECT picked.id
    FROM keys, LATERAL (
        SELECT m.id
        FROM {schema}.messages AS m
        WHERE m.queue_name = %(queue_name)s AND m.state = 'pending' AND m.concurrency_key = keys.key
          AND m.next_attempt_at <= statement_timestamp() AND m.priority = 0
        ORDER BY m.next_attempt_at, m.id
        LIMIT greatest(least(keys.free, %(per_key)s)
                       - (SELECT count(*) FROM keyed_prioritized AS p WHERE p.key = keys.key), 0)
        FOR UPDATE SKIP LOCKED
    ) AS picked
),
keyed AS (
    SELECT id FROM (SELECT id FROM keyed_prioritized UNION ALL SELECT id FROM keyed_rest) AS both_tiers
    LIMIT %(limit)s
),
unkeyed_prioritized AS (
    SELECT id
    FROM {schema}.messages
    WHERE %(prioritized)s::boolean AND %(unkeyed)s::boolean
      AND queue_name = %(queue_name)s
      AND state = 'pending'
      AND priority > 0
      AND next_attempt_at <= statement_timestamp()
      AND concurrency_key IS NULL
      AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses WHERE queue_name = %(queue_name)s)
    ORDER BY priority DESC, next_attempt_at, id
    LIMIT %(limit)s - (SELECT count(*) FROM keyed)
    FOR UPDATE SKIP LOCKED
),
unkeyed AS (
    SELECT id
    FROM {schema}.messages
    WHERE %(unkeyed)s::boolean
      AND queue_name = %(queue_name)s
      AND state = 'pending'
      AND next_attempt_at <= statement_timestamp()
      AND {claim_from}
      AND concurrency_key IS NULL
      AND (NOT %(prioritized)s::boolean OR priority = 0)
      AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses WHERE queue_name = %(queue_name)s)
    ORDER BY next_attempt_at, id
    LIMIT %(limit)s - (SELECT count(*) FROM keyed) - (SELECT count(*) FROM unkeyed_prioritized)
    FOR UPDATE SKIP LOCKED
),
candidates AS (
    SELECT id FROM keyed UNION ALL SELECT id FROM unkeyed_prioritized UNION ALL SELECT id FROM unkeyed
),
claimed AS {claim_update},
clock AS {claim_clock}
SELECT claimed.id, claimed.attempts, claimed.payload, clock.next_due_in_ms, clock.db_now_ms, claimed.priority,
       clock.prioritized, claimed.due_at, clock.keyed, claimed.keyed AS row_keyed
FROM clock LEFT JOIN claimed ON true;

-- name: consumer_rank --
-- Which due times a consumer wakes for (see the claim and docs/design.md,
-- "Delays"), for each of %(queue_names)s (one queue, or the consumers of one
-- process that claimed together, see claim_queues): of the live worker
-- processes that consume the queue, how many there are and how many have a
-- smaller id than %(worker_id)s.  The consumer wakes for a due time d (epoch
-- ms) only when d mod consumers = rank, so one process, not all of them,
-- claims at each due time; the others find the row at their next poll if that
-- one could not.  listed is false until this process's heartbeat names the
-- queue; the consumer then wakes for every due time.  One row per queue name.
SELECT q.queue_name,
       count(w.id)::int AS consumers,
       count(w.id) FILTER (WHERE w.id < %(worker_id)s::uuid)::int AS rank,
       coalesce(bool_or(w.id = %(worker_id)s::uuid), false) AS listed
FROM unnest(%(queue_names)s::text[]) AS q(queue_name)
LEFT JOIN {schema}.workers AS w
       ON q.queue_name = ANY (w.queues)
      AND {worker_alive}
GROUP BY q.queue_name;

-- name: ack --
-- Archives completed messages: the DELETE and the INSERT into history are one
-- statement.  Fenced by lease: a row that was released and claimed again
-- elsewhere (new lease) is not touched; the caller counts those as stale.
-- A row has a lease exactly while it is processing (messages_lease_check), so
-- the lease match is the match of a processing row; ack, archive and requeue
-- name no state on purpose: with "state = 'processing'" the planner may read
-- the partial index messages_owner_idx (WHERE state = 'processing') in full
-- and hash-join it with the ids, and does once an ANALYZE saw few processing
-- rows; while the MVCC horizon is pinned that index holds an entry for every
-- row claimed since, and the ack took seconds (docs/chaos.md, scenario 10).
-- Without it the only index for m.id = a.id is the primary key.
-- Returns the (id, lease) of each row archived: the flusher writes a message's
-- follow-ups (retry, next pipeline step, callbacks, result) in the same
-- transaction, for the deliveries of these leases only (a stale delivery of the
-- same row in the same batch has another lease, and its follow-ups are dropped).
-- The ids come from the DELETE, not from "INSERT ... RETURNING", which would need
-- SELECT on history (docs/security.md grants the worker role INSERT only); a
-- data-modifying CTE runs to completion whether or not its rows are read.
-- Counted as it archives (finished_counts, migration 0018): one upsert per
-- (queue, actor) of the batch, not per message.
WITH done AS (
    DELETE FROM {schema}.messages AS m
    WHERE m.id = ANY(%(ids)s::bigint[]) AND {fenced}
    RETURNING m.*
),
archived AS (
    INSERT INTO {schema}.history
        (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at, payload,
         idempotency_key, priority)
    SELECT id, queue_name, actor_name, message_id, 'completed', attempts, enqueued_at, acquired_at, payload,
           idempotency_key, priority
    FROM done
),
counted AS (
    INSERT INTO {schema}.finished_counts AS c (queue_name, actor_name, state, shard, n)
    SELECT queue_name, actor_name, 'completed', pg_backend_pid() %% 16, count(*)
    FROM done GROUP BY queue_name, actor_name ORDER BY queue_name, actor_name
    ON CONFLICT (queue_name, actor_name, state, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT id, lease FROM done;

-- name: archive --
-- Moves messages to history in state %(state)s with their error: failed for a
-- dead letter (nack), completed for an acked delivery whose actor raised
-- (Retries enqueued its retry), canceled for a delivery an operator canceled
-- while it ran (its error ends with the operator's reason, cancel_reason of
-- migration 0022).  Fenced like ack (by lease alone, see ack).
-- Returns the (id, lease) of each row archived, as ack does.
WITH failed AS (
    DELETE FROM {schema}.messages AS m
    WHERE m.id = ANY(%(ids)s::bigint[]) AND {fenced}
    RETURNING m.*,
        (%(error_types)s::text[])[array_position(%(fences)s::text[], m.id::text || '/' || m.lease::text)]
            AS failure_type,
        (%(errors)s::text[])[array_position(%(fences)s::text[], m.id::text || '/' || m.lease::text)]
            AS failure
),
archived AS (
    INSERT INTO {schema}.history
        (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at,
         error_type, error, payload, idempotency_key, priority, concurrency_key, concurrency_limit)
    SELECT id, queue_name, actor_name, message_id, %(state)s, attempts, enqueued_at, acquired_at,
           failure_type,
           CASE WHEN %(state)s = 'canceled' THEN concat_ws(E'\n', failure, cancel_reason) ELSE failure END,
           payload, idempotency_key, priority, concurrency_key, concurrency_limit
    FROM failed
),
-- Dead letters are counted where they are made (dead_letter_counts, migration 0012):
-- the shard of this connection, summed by the exporter.
counted AS (
    INSERT INTO {schema}.dead_letter_counts AS c (queue_name, shard, n)
    SELECT queue_name, pg_backend_pid() %% 16, count(*) FROM failed WHERE %(state)s = 'failed' GROUP BY queue_name
    ON CONFLICT (queue_name, shard) DO UPDATE SET n = c.n + excluded.n
),
-- And by actor and outcome (finished_counts, migration 0018): failed, canceled, or
-- retried for a completed row with an error type (the actor raised; its retry is enqueued).
finished AS (
    INSERT INTO {schema}.finished_counts AS c (queue_name, actor_name, state, shard, n)
    SELECT queue_name, actor_name,
           CASE WHEN %(state)s <> 'completed' THEN %(state)s WHEN failure_type IS NULL THEN 'completed'
                ELSE 'retried' END,
           pg_backend_pid() %% 16, count(*)
    FROM failed GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
    ON CONFLICT (queue_name, actor_name, state, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT id, lease FROM failed;

-- name: requeue --
-- Hands claimed but unstarted messages back at once, without charging them
-- the attempt their claim took.  Fenced like ack (by lease alone, see ack).  Wakes the listeners of
-- those queues in the same statement (unless %(notify)s is false) and returns
-- the released count per queue.  A row an operator asked to cancel is not
-- handed back (it would run again): it stays this process's claim, and the
-- orphan check or, once this process is gone, the rescuer archives it as
-- canceled.
WITH released AS (
    UPDATE {schema}.messages AS m
    SET state = 'pending', attempts = greatest(m.attempts - 1, 0), lease = NULL, owner = NULL
    WHERE m.id = ANY(%(ids)s::bigint[]) AND {fenced} AND m.cancel_requested_at IS NULL
    RETURNING m.queue_name
),
per_queue AS (
    SELECT queue_name, count(*) AS n FROM released GROUP BY queue_name
)
SELECT queue_name, n, CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, queue_name) END AS notified
FROM per_queue;

-- name: heartbeat --
-- A worker process is alive; running: the rows whose actor it runs now
-- (migration 0011), so that the dashboard tells running from prefetched;
-- actors: the actors its broker declares (migration 0020, the Spark check).
INSERT INTO {schema}.workers (id, hostname, pid, queues, running, actors)
VALUES (%(id)s, %(hostname)s, %(pid)s, %(queues)s::text[], %(running)s::bigint[], %(actors)s::text[])
ON CONFLICT (id) DO UPDATE
SET heartbeat_at = now(), queues = excluded.queues, running = excluded.running, actors = excluded.actors;

-- name: unregister_worker --
DELETE FROM {schema}.workers WHERE id = %(id)s;

-- name: rescue --
-- Releases messages whose owner stopped heartbeating (crashed, killed,
-- partitioned away) or whose claim is older than the optional hard bound,
-- and quarantines those already delivered max_deliveries times: they go to
-- history as failed and never run again.  Liveness, not task length, decides,
-- so a long task of a live worker is never taken away.  SKIP LOCKED keeps
-- concurrent rescuers (one per worker process) and flushes out of each
-- other's way.  Dead worker rows are dropped in the same statement.  A row
-- an operator asked to cancel (cancel_requested_at, migration 0022) is not
-- released: it goes to history as canceled (its worker died before it could
-- stop it).  The rescuing process (%(worker_id)s) is alive: its own claims and
-- row are left to it (its orphans: release_orphans).  Its heartbeat runs on the
-- thread that runs this statement, and now() can be read after a wait: psycopg
-- prepares a statement in a transaction of its own, and a Parse that waited on a
-- lock (the history table, held by an operator) left this statement a now()
-- later than its process's last heartbeat by that wait, which released the
-- process's running messages (tests/test_flush_window.py, with prepare_threshold 0).
-- The rows are then found by "m.id = ANY (ARRAY(SELECT id FROM stuck))", an
-- InitPlan and a primary-key probe of each partition, not by a join with the
-- CTE: on a table with no statistics (freshly filled, not yet analyzed) the
-- join was a hash join that reads its outer side, a sequential scan of
-- messages, before it looks at the (empty) CTE; with nothing stuck, the usual
-- case, every pass read the whole table: 25,542 pages for a backlog of
-- 1,000,000 rows, each dirtied and written out by the first pass, during the
-- drain (benchmarks/README.md, section 33).  release_orphans is written the
-- same way.
WITH stuck AS (
    SELECT m.id
    FROM {schema}.messages AS m
    WHERE m.state = 'processing'
      AND (
        (m.owner IS DISTINCT FROM %(worker_id)s::uuid
         AND NOT EXISTS (
            SELECT 1 FROM {schema}.workers AS w
            WHERE w.id = m.owner AND {worker_alive}
         ))
        OR m.acquired_at < now() - %(max_lease_ms)s::bigint * interval '1 millisecond'
      )
    FOR UPDATE OF m SKIP LOCKED
),
canceled AS (
    DELETE FROM {schema}.messages AS m
    WHERE m.id = ANY (ARRAY(SELECT id FROM stuck)) AND m.cancel_requested_at IS NOT NULL
    RETURNING m.*
),
canceled_archived AS (
    INSERT INTO {schema}.history
        (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at,
         error_type, error, payload, idempotency_key, priority)
    SELECT id, queue_name, actor_name, message_id, 'canceled', attempts, enqueued_at, acquired_at,
           'Canceled', concat_ws(E'\n', 'canceled while its worker was gone (archived by the rescuer)',
                                 cancel_reason),
           payload, idempotency_key, priority
    FROM canceled
),
canceled_counted AS (
    INSERT INTO {schema}.finished_counts AS c (queue_name, actor_name, state, shard, n)
    SELECT queue_name, actor_name, 'canceled', pg_backend_pid() %% 16, count(*)
    FROM canceled GROUP BY queue_name, actor_name ORDER BY queue_name, actor_name
    ON CONFLICT (queue_name, actor_name, state, shard) DO UPDATE SET n = c.n + excluded.n
),
quarantined AS (
    DELETE FROM {schema}.messages AS m
    WHERE m.id = ANY (ARRAY(SELECT id FROM stuck)) AND m.attempts >= %(max_deliveries)s
      AND m.cancel_requested_at IS NULL
    RETURNING m.*
),
archived AS (
    INSERT INTO {schema}.history
        (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at,
         error_type, error, payload, idempotency_key, priority, concurrency_key, concurrency_limit)
    SELECT id, queue_name, actor_name, message_id, 'failed', attempts, enqueued_at, acquired_at,
           'MaxDeliveriesExceeded',
           format('quarantined: delivered %%s times without an ack (max_deliveries=%%s); '
                  'its worker probably died while running it', attempts, %(max_deliveries)s),
           payload, idempotency_key, priority, concurrency_key, concurrency_limit
    FROM quarantined
    RETURNING queue_name
),
counted AS (
    INSERT INTO {schema}.dead_letter_counts AS c (queue_name, shard, n)
    SELECT queue_name, pg_backend_pid() %% 16, count(*) FROM quarantined GROUP BY queue_name
    ON CONFLICT (queue_name, shard) DO UPDATE SET n = c.n + excluded.n
),
finished AS (
    INSERT INTO {schema}.finished_counts AS c (queue_name, actor_name, state, shard, n)
    SELECT queue_name, actor_name, 'failed', pg_backend_pid() %% 16, count(*)
    FROM quarantined GROUP BY queue_name, actor_name ORDER BY queue_name, actor_name
    ON CONFLICT (queue_name, actor_name, state, shard) DO UPDATE SET n = c.n + excluded.n
),
released AS (
    UPDATE {schema}.messages AS m
    SET state = 'pending', lease = NULL, owner = NULL
    WHERE m.id = ANY (ARRAY(SELECT id FROM stuck)) AND m.attempts < %(max_deliveries)s
      AND m.cancel_requested_at IS NULL
    RETURNING m.queue_name
),
dead_workers AS (
    DELETE FROM {schema}.workers AS w
    WHERE NOT ({worker_alive}) AND w.id <> %(worker_id)s::uuid
    RETURNING id
),
woken AS (
    SELECT pg_notify(%(channel)s, queue_name) FROM (SELECT DISTINCT queue_name FROM released) AS q
)
SELECT (SELECT count(*) FROM released),
       (SELECT count(*) FROM archived),
       (SELECT count(*) FROM dead_workers),
       (SELECT count(*) FROM woken),
       (SELECT count(*) FROM canceled);

-- name: release_orphans --
-- Releases rows this live process holds in the database but not in memory:
-- a claim whose reply was lost with the connection.  They never reached an
-- actor, so their attempt is given back.  The grace period keeps claims that
-- are still on their way to memory out of reach.  One an operator asked to
-- cancel (a claim its requeue left marked, see requeue) goes to history as
-- canceled instead; counted apart.
WITH orphans AS (
    SELECT m.id
    FROM {schema}.messages AS m
    WHERE m.owner = %(owner)s
      AND m.state = 'processing'
      AND m.acquired_at < now() - %(grace_ms)s * interval '1 millisecond'
      AND NOT (m.id = ANY(%(known_ids)s::bigint[]))
    FOR UPDATE OF m SKIP LOCKED
),
released AS (
    UPDATE {schema}.messages AS m
    SET state = 'pending', attempts = greatest(m.attempts - 1, 0), lease = NULL, owner = NULL
    WHERE m.id = ANY (ARRAY(SELECT id FROM orphans)) AND m.cancel_requested_at IS NULL
    RETURNING m.queue_name
),
canceled AS (
    DELETE FROM {schema}.messages AS m
    WHERE m.id = ANY (ARRAY(SELECT id FROM orphans)) AND m.cancel_requested_at IS NOT NULL
    RETURNING m.*
),
archived AS (
    INSERT INTO {schema}.history
        (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at,
         error_type, error, payload, idempotency_key, priority)
    SELECT id, queue_name, actor_name, message_id, 'canceled', attempts, enqueued_at, NULL,
           'Canceled', concat_ws(E'\n', 'canceled before it started', cancel_reason),
           payload, idempotency_key, priority
    FROM canceled
),
counted AS (
    INSERT INTO {schema}.finished_counts AS c (queue_name, actor_name, state, shard, n)
    SELECT queue_name, actor_name, 'canceled', pg_backend_pid() %% 16, count(*)
    FROM canceled GROUP BY queue_name, actor_name ORDER BY queue_name, actor_name
    ON CONFLICT (queue_name, actor_name, state, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT (SELECT count(*) FROM released), (SELECT count(*) FROM canceled);

-- name: cancel_requests --
-- Which of this process's claims (%(ids)s, in memory) an operator asked to
-- cancel: the maintenance loop's poll, the fallback of the "cancel:<row id>"
-- notifications.  By primary key, one probe per id and partition (the owner's
-- partial index is the one a pinned horizon fills, see ack).
SELECT m.id
FROM {schema}.messages AS m
WHERE m.id = ANY(%(ids)s::bigint[]) AND m.owner = %(owner)s AND m.cancel_requested_at IS NOT NULL;

-- name: retry_failed --
-- Puts dead letters back on their queues (the CLI's retry-failed and the
-- dashboard's Retry): moves them from history to messages, due now, with a
-- fresh attempts count, in one statement (nothing is lost or doubled if it
-- fails).  Selected by ids and by the failed page's filters (NULL: any), the
-- oldest first, at most %(limit)s (NULL: all).
-- Wakes the workers of each queue (unless %(notify)s is false) and returns,
-- per queue, the count and the history ids moved.
WITH picked AS (
    SELECT id
    FROM {schema}.history
    WHERE state = 'failed'
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND {dead_letter_filter}
    ORDER BY finished_at, id
    LIMIT %(limit)s::bigint
),
moved AS (
    DELETE FROM {schema}.history
    WHERE state = 'failed' AND id = ANY (ARRAY(SELECT id FROM picked))
    RETURNING id, queue_name, actor_name, message_id, payload, idempotency_key, priority, concurrency_key,
              concurrency_limit
),
inserted AS (
    INSERT INTO {schema}.messages
        (queue_name, actor_name, message_id, payload, idempotency_key, priority, slot, concurrency_key,
         concurrency_limit)
    SELECT queue_name, actor_name, message_id, payload, idempotency_key, priority,
           CASE WHEN idempotency_key IS NOT NULL THEN -1 ELSE (SELECT {schema}.message_slot()) END,
           concurrency_key, concurrency_limit
    FROM moved
),
per_queue AS (
    SELECT queue_name, count(*) AS n, array_agg(id ORDER BY id) AS ids FROM moved GROUP BY queue_name
)
SELECT queue_name, n AS moved, ids,
       CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, queue_name) END AS notified
FROM per_queue ORDER BY queue_name;

-- name: reclaim_messages --
-- One pass of a process's reclaim loop (_runtime/reclaimer.py): turns the ring of
-- message partitions, moves the few pending rows left in older ones and empties
-- those left with none by TRUNCATE, never waiting for a lock (migration 0013).
-- No row when another process holds the ring.
SELECT slot, rotated, moved, truncated, busy
FROM {schema}.reclaim_messages(%(rotate_ms)s::bigint, %(park_after_ms)s::bigint,
                               %(max_slots)s::integer, %(channel)s::text, %(max_moved)s::integer);

-- name: queue_size --
-- One statement, hence one snapshot: pending, delayed and in-flight rows of a
-- queue and of its delay queue are counted atomically.
SELECT count(*) FROM {schema}.messages WHERE queue_name = ANY(%(queue_names)s::text[]);

-- name: purge --
-- broker.flush: deletes every stored row of the queues, or those of them whose id
-- is in %(ids)s (NULL: all).  Returns the ids the statement's snapshot saw but did
-- not delete: rows changed under it, e.g. moved to another partition by
-- reclaim_messages() (DELETE ... RETURNING into INSERT with the same id: a DELETE
-- that waited on the row finds it deleted and does not see the new one); the
-- broker runs it again for those, with a new snapshot.
WITH seen AS (
    SELECT id FROM {schema}.messages
    WHERE queue_name = ANY(%(queue_names)s::text[])
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
), purged AS (
    DELETE FROM {schema}.messages
    WHERE queue_name = ANY(%(queue_names)s::text[])
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
    RETURNING id
)
SELECT ARRAY(SELECT id FROM seen EXCEPT SELECT id FROM purged);

-- name: schema_revision --
SELECT to_regclass(%(table)s) IS NOT NULL, obj_description(to_regclass(%(table)s), 'pg_class');

-- Results backend (dramatiq_pg_outbox/results.py; table: alembic/versions/0004_results.py).

-- name: results_store --
-- Stores (or replaces) one result for %(ttl)s milliseconds and, when
-- %(notify)s, wakes the readers blocked on it: the NOTIFY is delivered at
-- commit, so a woken reader always finds the row.  The INSERT runs even when
-- the outer SELECT returns nothing (a data-modifying CTE always runs to
-- completion).
WITH stored AS (
    INSERT INTO {schema}.results (message_key, result, expires_at)
    VALUES (%(message_key)s, %(result)s, now() + %(ttl)s::bigint * interval '1 millisecond')
    ON CONFLICT (message_key) DO UPDATE SET result = excluded.result, expires_at = excluded.expires_at
    RETURNING message_key
)
SELECT pg_notify(%(channel)s, %(payload)s) FROM stored WHERE %(notify)s::boolean;

-- name: results_get --
-- An expired row is invisible at once, whether or not the cleanup has run.
SELECT result FROM {schema}.results WHERE message_key = %(message_key)s AND expires_at > now();

-- name: results_delete_expired --
-- One batch of the cleanup: the oldest expired rows, read from
-- results_expires_at_idx.  SKIP LOCKED lets the cleanups of several processes
-- run at once without waiting for each other.
WITH doomed AS (
    SELECT message_key FROM {schema}.results
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.results AS r USING doomed WHERE r.message_key = doomed.message_key;

-- Periodic jobs (dramatiq_pg_outbox/periodic/; table: alembic/versions/0006_periodic.py).
-- A scheduler passes the schedules it declares as parallel arrays (name,
-- cron, every_ms, tz: the rule).  A row belongs to a scheduler when its name
-- AND its rule are the declared ones: during a rolling deploy that changed a
-- rule, processes of the old and of the new version leave each other's
-- version of the schedule alone (the one that started last wrote the rule).

-- name: periodic_begin --
-- First statement of a scheduler's transaction: the database clock, and a
-- bound on how long the transaction may sit idle.  A scheduler whose host
-- vanishes mid-pass (power loss, partition: no FIN reaches the server) would
-- otherwise hold its schedules' row locks until TCP keepalive notices, two
-- hours by default; this way the server ends the session and another
-- scheduler takes the tick after %(idle_timeout)s ms.
SELECT now(), set_config('idle_in_transaction_session_timeout', %(idle_timeout)s::text, true);

-- name: periodic_declare --
-- Upserts the declared schedules and marks them seen.  A new schedule starts
-- at %(first_runs)s (its first tick after now(), computed by the caller from
-- periodic_begin in the same transaction), and so does one whose rule changed
-- or that had been removed; otherwise next_run_at is kept, so the ticks
-- missed while no scheduler ran follow the schedule's missed policy.  With
-- %(define)s (a scheduler starting) the declaration overwrites the stored
-- definition.  Without it (the periodic refresh) a row whose rule matches is
-- marked seen, and a row with another rule is left to the schedulers that
-- declare that rule, unless none of them marked it seen since %(stale)s
-- (two sync intervals ago): then they are gone (an old process restarted
-- during a rolling deploy, wrote its rule, and stopped) and this rule takes over.
-- Returns
-- (name, inserted, rule changed, revived) for each row written; the "before"
-- CTE reads the rows as they were (one snapshot for the whole statement).
WITH declared AS (
    SELECT *
    FROM unnest(%(names)s::text[], %(actor_names)s::text[], %(queue_names)s::text[],
                %(crons)s::text[], %(every_ms)s::bigint[], %(tzs)s::text[],
                %(missed)s::text[], %(grace_ms)s::bigint[], %(first_runs)s::timestamptz[])
        AS d(name, actor_name, queue_name, cron, every_ms, tz, missed, grace_ms, first_run_at)
),
before AS (
    SELECT s.name,
           (s.cron, s.every_ms, s.tz) IS DISTINCT FROM (d.cron, d.every_ms, d.tz) AS changed,
           s.removed_at IS NOT NULL AS revived
    FROM {schema}.schedules AS s JOIN declared AS d USING (name)
),
upserted AS (
    INSERT INTO {schema}.schedules AS s
        (name, actor_name, queue_name, cron, every_ms, tz, missed, grace_ms, next_run_at)
    SELECT name, actor_name, queue_name, cron, every_ms, tz, missed, grace_ms, first_run_at FROM declared
    ON CONFLICT (name) DO UPDATE SET
        actor_name = CASE WHEN %(define)s::boolean OR s.seen_at < %(stale)s::timestamptz THEN excluded.actor_name
                          ELSE s.actor_name END,
        queue_name = CASE WHEN %(define)s::boolean OR s.seen_at < %(stale)s::timestamptz THEN excluded.queue_name
                          ELSE s.queue_name END,
        missed = CASE WHEN %(define)s::boolean OR s.seen_at < %(stale)s::timestamptz THEN excluded.missed ELSE s.missed END,
        grace_ms = CASE WHEN %(define)s::boolean OR s.seen_at < %(stale)s::timestamptz THEN excluded.grace_ms
                        ELSE s.grace_ms END,
        cron = excluded.cron,
        every_ms = excluded.every_ms,
        tz = excluded.tz,
        next_run_at = CASE
            WHEN (s.cron, s.every_ms, s.tz) IS DISTINCT FROM (excluded.cron, excluded.every_ms, excluded.tz)
              OR s.removed_at IS NOT NULL
            THEN excluded.next_run_at ELSE s.next_run_at END,
        updated_at = CASE
            WHEN (s.cron, s.every_ms, s.tz) IS DISTINCT FROM (excluded.cron, excluded.every_ms, excluded.tz)
            THEN now() ELSE s.updated_at END,
        seen_at = now(),
        removed_at = NULL
    WHERE %(define)s::boolean
       OR (s.cron, s.every_ms, s.tz) IS NOT DISTINCT FROM (excluded.cron, excluded.every_ms, excluded.tz)
       OR s.seen_at < %(stale)s::timestamptz
    RETURNING name
)
SELECT u.name, b.name IS NULL AS added, coalesce(b.changed, false) AS changed,
       coalesce(b.revived, false) AS revived
FROM upserted AS u LEFT JOIN before AS b USING (name);

-- name: periodic_remove --
-- Marks removed the schedules that no running scheduler declared for
-- %(removed_after)s ms (no scheduler enqueues them any more: the claim only
-- takes declared schedules), and deletes those removed %(retention)s ms ago.
-- A schedule declared again is revived by periodic_declare, at its next tick.
WITH marked AS (
    UPDATE {schema}.schedules SET removed_at = now()
    WHERE removed_at IS NULL AND seen_at < now() - %(removed_after)s::bigint * interval '1 millisecond'
    RETURNING name
),
deleted AS (
    DELETE FROM {schema}.schedules
    WHERE removed_at < now() - %(retention)s::bigint * interval '1 millisecond'
    RETURNING name
)
SELECT (SELECT count(*) FROM marked), (SELECT count(*) FROM deleted);

-- name: periodic_claim --
-- The due schedules of this scheduler, most overdue first, each locked until
-- this transaction ends; the caller enqueues their due ticks and advances
-- next_run_at past now() (periodic_advance) in this same transaction, so a
-- tick is enqueued if and only if next_run_at moves past it.  SKIP LOCKED
-- passes over the rows another scheduler holds right now; a schedule disabled
-- from the dashboard (disabled_at, migration 0011) is not claimed (the LockRows node
-- sits below the LIMIT, so skipped rows do not count against it).  Under READ
-- COMMITTED, a row that another scheduler advanced and committed after this
-- statement's snapshot is re-checked against its newest version
-- (EvalPlanQual) and dropped because next_run_at > now(): no tick is ever
-- claimed twice.
SELECT s.name, s.next_run_at, now()
FROM {schema}.schedules AS s
JOIN unnest(%(names)s::text[], %(crons)s::text[], %(every_ms)s::bigint[], %(tzs)s::text[])
    AS d(name, cron, every_ms, tz)
  ON d.name = s.name
 AND d.cron IS NOT DISTINCT FROM s.cron
 AND d.every_ms IS NOT DISTINCT FROM s.every_ms
 AND d.tz = s.tz
WHERE s.next_run_at <= now() AND s.removed_at IS NULL AND s.disabled_at IS NULL
ORDER BY s.next_run_at
LIMIT %(limit)s
FOR UPDATE OF s SKIP LOCKED;

-- name: periodic_advance --
-- After periodic_claim, in its transaction: the next tick, the newest tick
-- enqueued (NULL: none this time) and the counters of each claimed schedule.
UPDATE {schema}.schedules AS s
SET next_run_at = a.next_run_at,
    last_run_at = coalesce(a.last_run_at, s.last_run_at),
    last_enqueued_at = CASE WHEN a.last_run_at IS NULL THEN s.last_enqueued_at ELSE now() END,
    runs = s.runs + a.runs,
    missed_ticks = s.missed_ticks + a.missed
FROM unnest(%(names)s::text[], %(next_runs)s::timestamptz[], %(last_runs)s::timestamptz[],
            %(runs)s::bigint[], %(missed)s::bigint[])
    AS a(name, next_run_at, last_run_at, runs, missed)
WHERE s.name = a.name;

-- name: periodic_next_due --
-- Milliseconds from the server's clock_timestamp() to the earliest next tick
-- of this scheduler's schedules (<= 0: one is due, most likely held by
-- another scheduler that is enqueueing it now), or NULL when it has none.
-- Relative to the server's clock, so no clock conversion is needed.
SELECT (extract(epoch FROM min(s.next_run_at) - clock_timestamp()) * 1000)::float8
FROM {schema}.schedules AS s
JOIN unnest(%(names)s::text[], %(crons)s::text[], %(every_ms)s::bigint[], %(tzs)s::text[])
    AS d(name, cron, every_ms, tz)
  ON d.name = s.name
 AND d.cron IS NOT DISTINCT FROM s.cron
 AND d.every_ms IS NOT DISTINCT FROM s.every_ms
 AND d.tz = s.tz
WHERE s.removed_at IS NULL AND s.disabled_at IS NULL;

-- name: periodic_list --
-- "dramatiq-pg-outbox schedules": every schedule, active ones first.
SELECT name, actor_name, queue_name, cron, every_ms, tz, missed, grace_ms, last_run_at, next_run_at,
       runs, missed_ticks, extract(epoch FROM now() - next_run_at)::float8 AS late_s,
       extract(epoch FROM now() - removed_at)::float8 AS removed_s, disabled_at
FROM {schema}.schedules
ORDER BY removed_at IS NOT NULL, name;

-- name: create_history_partitions --
-- The maintenance loop's hourly call: the day partitions of history for today
-- and the next %(days)s days (migration 0007; a SECURITY DEFINER function).
SELECT {schema}.create_history_partitions(%(days)s);

-- Rate limits (dramatiq_pg_outbox/rate_limits.py; tables: alembic/versions/0008_rate_limits.py).
-- One statement per operation of Dramatiq's RateLimiterBackend, atomic under
-- concurrency: a missing key takes the INSERT path, an existing one the
-- ON CONFLICT path, which locks the row and re-checks its condition against
-- the newest version of it.  A row past expires_at counts as 0 (absent).  Each
-- returns one true row when the operation was applied; none, or a false row,
-- when it was not.

-- name: rate_limit_add --
-- Adds the key with the value unless it exists (an expired row is replaced).
INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
VALUES (%(key)s, %(value)s, now() + %(ttl)s::bigint * interval '1 millisecond')
ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at
    WHERE r.expires_at <= now()
RETURNING true;

-- name: rate_limit_incr --
-- Adds %(amount)s unless the result would exceed %(maximum)s; renews the TTL.
-- A missing key that may not take the amount is inserted already expired
-- (absent for every statement; the cleanup deletes it): only the RETURNING
-- value, false then, tells the caller.
INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
SELECT %(key)s, %(amount)s::bigint,
       CASE WHEN %(amount)s::bigint <= %(maximum)s::bigint
            THEN now() + %(ttl)s::bigint * interval '1 millisecond' ELSE '-infinity' END
ON CONFLICT (key) DO UPDATE
    SET value = CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + excluded.value,
        expires_at = now() + %(ttl)s::bigint * interval '1 millisecond'
    WHERE CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + excluded.value <= %(maximum)s::bigint
RETURNING r.expires_at > now();

-- name: rate_limit_decr --
-- Subtracts %(amount)s unless the result would fall below %(minimum)s; renews
-- the TTL (a missing key is 0, handled as in rate_limit_incr).
INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
SELECT %(key)s, -%(amount)s::bigint,
       CASE WHEN -%(amount)s::bigint >= %(minimum)s::bigint
            THEN now() + %(ttl)s::bigint * interval '1 millisecond' ELSE '-infinity' END
ON CONFLICT (key) DO UPDATE
    SET value = CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + excluded.value,
        expires_at = now() + %(ttl)s::bigint * interval '1 millisecond'
    WHERE CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + excluded.value >= %(minimum)s::bigint
RETURNING r.expires_at > now();

-- name: group_barrier_count_down --
-- A group member's count-down of its completion barrier (rate_limits.JoinedGroupCallbacks),
-- run in the transaction of the member's ack: Dramatiq's Barrier.wait, i.e.
-- rate_limit_decr with an amount of 1 and a minimum of 1.  Returns true when the
-- barrier opens (this member is the last: the value is 1, or the key is missing or
-- expired), and the ack then writes the group's callbacks.  The row lock of the
-- upsert orders the count-downs of concurrent acks; each sees the value committed
-- before it.
WITH counted AS (
    INSERT INTO {schema}.rate_limits AS r (key, value, expires_at)
    VALUES (%(key)s, -1, '-infinity')
    ON CONFLICT (key) DO UPDATE
        SET value = r.value - 1, expires_at = now() + %(ttl)s::bigint * interval '1 millisecond'
        WHERE r.expires_at > now() AND r.value - 1 >= 1
    RETURNING r.expires_at > now() AS counted
)
SELECT NOT coalesce((SELECT counted FROM counted), false);

-- name: rate_limit_lock_keys --
-- Takes the window limiter's lock of each of %(keys)s for the transaction, in key
-- order, as rate_limit_incr_and_sum() does (migration 0008, lock class 0x726C =
-- 29292).  The backend takes them first, then asks the limiter for its window
-- again and runs rate_limit_incr_and_sum() with that one in the same transaction:
-- a window computed before a wait for these locks may end before a second that
-- began during the wait, whose bucket another call filled meanwhile (one call
-- over the limit, tests/test_rate_limits.py).  The later window's new buckets
-- come after every key held here, so the locks are still taken in one order.
SELECT count(*)
FROM (SELECT pg_advisory_xact_lock(29292, hashtext(k))
      FROM (SELECT DISTINCT k FROM unnest(%(keys)s::text[]) AS k ORDER BY k) AS ordered) AS locked;

-- name: rate_limit_incr_and_sum --
-- Adds %(amount)s to the key unless the key's new value, or %(amount)s plus the
-- sum of the live %(keys)s, would exceed %(maximum)s (a window limiter: the key
-- is the current bucket, the keys the buckets of the window).  A function of
-- migration 0008: it locks the window's keys, then sums them as committed.
SELECT true
WHERE {schema}.rate_limit_incr_and_sum(
    %(key)s, %(keys)s::text[], %(amount)s::bigint, %(maximum)s::bigint, %(ttl)s::bigint
);

-- name: rate_limit_notify --
-- Publishes an event on the key for %(ttl)s ms (kept until then: a late waiter
-- still sees it) and wakes the waiters (payload: the key).
WITH event AS (
    INSERT INTO {schema}.rate_limit_events AS e (key, expires_at)
    VALUES (%(key)s, now() + %(ttl)s::bigint * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE SET expires_at = greatest(e.expires_at, excluded.expires_at)
    RETURNING key
)
SELECT pg_notify(%(channel)s, key) FROM event;

-- name: rate_limit_event --
-- Whether an event was published on the key and has not expired.
SELECT EXISTS (
    SELECT 1 FROM {schema}.rate_limit_events WHERE key = %(key)s AND expires_at > now()
);

-- name: rate_limit_delete_expired --
-- The cleanup: expired keys and events, at most %(limit)s of each per call.
WITH keys AS (
    DELETE FROM {schema}.rate_limits WHERE key IN (
        SELECT key FROM {schema}.rate_limits WHERE expires_at <= now()
        LIMIT %(limit)s FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
), events AS (
    DELETE FROM {schema}.rate_limit_events WHERE key IN (
        SELECT key FROM {schema}.rate_limit_events WHERE expires_at <= now()
        LIMIT %(limit)s FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT (SELECT count(*) FROM keys) + (SELECT count(*) FROM events);

-- Queue pauses (dramatiq-pg-outbox pause/resume, the dashboard; table: alembic/versions/0009_queue_pauses.py).

-- name: pause_queues --
-- Pauses the queues (each with its delay queue, in %(queue_names)s): consumers
-- and relays stop claiming them at their next claim; sends still store.
-- Returns the queues that were not paused yet.
INSERT INTO {schema}.queue_pauses (queue_name)
SELECT unnest(%(queue_names)s::text[])
ON CONFLICT (queue_name) DO NOTHING
RETURNING queue_name;

-- name: known_queues --
-- Which of %(queue_names)s some message, worker or schedule has named: a live message
-- (of the queue or its delay queue), a finished one in history, a worker that consumes
-- it, a schedule, a pause.  `pause` refuses the others unless --create (a typo would
-- pause a queue nobody uses).  History has no index on queue_name alone: for a name
-- found nowhere else, its EXISTS reads history until a match (all of it for a typo).
SELECT q.name
  FROM unnest(%(queue_names)s::text[]) AS q(name)
 WHERE EXISTS (SELECT 1 FROM {schema}.messages WHERE queue_name IN (q.name, q.name || '.DQ'))
    OR EXISTS (SELECT 1 FROM {schema}.workers WHERE q.name = ANY (queues))
    OR EXISTS (SELECT 1 FROM {schema}.schedules WHERE queue_name = q.name)
    OR EXISTS (SELECT 1 FROM {schema}.queue_pauses WHERE queue_name = q.name)
    OR EXISTS (SELECT 1 FROM {schema}.history WHERE queue_name = q.name);

-- name: resume_queues --
-- Resumes the queues and wakes their consumers (they claim at once).  Returns
-- the queues that were paused.
WITH resumed AS (
    DELETE FROM {schema}.queue_pauses WHERE queue_name = ANY (%(queue_names)s::text[])
    RETURNING queue_name
)
SELECT queue_name, pg_notify(%(channel)s, queue_name) FROM resumed;

-- name: paused_queues --
-- The paused queues and since when (database clock), oldest first.
SELECT queue_name, paused_at FROM {schema}.queue_pauses ORDER BY paused_at, queue_name;

-- name: limit_set --
-- Sets the run-time limit of the concurrency keys that start with %(prefix)s
-- in queue %(queue_name)s ('': every queue; migrations 0021, 0023): the keyed
-- claim takes a queue's own limit, then one of every queue, before the limit
-- a message carries.  Wakes the workers of the queues concerned with keyed
-- messages waiting (a raised limit frees slots at once; unless %(notify)s is
-- false).  Returns the previous limit (NULL: none) and the queues woken.
WITH previous AS (
    SELECT max_running FROM {schema}.concurrency_limits
    WHERE queue_name = %(queue_name)s AND prefix = %(prefix)s
),
set AS (
    INSERT INTO {schema}.concurrency_limits AS l (queue_name, prefix, max_running)
    VALUES (%(queue_name)s, %(prefix)s, %(max_running)s)
    ON CONFLICT (queue_name, prefix) DO UPDATE SET max_running = excluded.max_running, updated_at = now()
    RETURNING prefix
),
woken AS (
    SELECT q.queue_name, CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, q.queue_name) END
    FROM (SELECT DISTINCT queue_name FROM {schema}.messages
          WHERE state = 'pending' AND concurrency_key IS NOT NULL
            AND (%(queue_name)s = '' OR queue_name = %(queue_name)s)) AS q
    WHERE (SELECT count(*) FROM set) > 0
)
SELECT (SELECT max_running FROM previous), array(SELECT queue_name FROM woken ORDER BY 1);

-- name: limit_unset --
-- Removes the run-time limit of %(prefix)s in queue %(queue_name)s ('': the
-- one of every queue); the keys fall back to another limit or to the ones
-- their messages carry.  Wakes the workers as limit_set does.  Returns the
-- limit removed (no row: there was none).
WITH gone AS (
    DELETE FROM {schema}.concurrency_limits
    WHERE queue_name = %(queue_name)s AND prefix = %(prefix)s
    RETURNING max_running
),
woken AS (
    SELECT CASE WHEN %(notify)s::boolean THEN pg_notify(%(channel)s, q.queue_name) END
    FROM (SELECT DISTINCT queue_name FROM {schema}.messages
          WHERE state = 'pending' AND concurrency_key IS NOT NULL
            AND (%(queue_name)s = '' OR queue_name = %(queue_name)s)) AS q
    WHERE (SELECT count(*) FROM gone) > 0
)
SELECT max_running FROM gone WHERE (SELECT count(*) FROM woken) >= 0;

-- name: limits --
-- The run-time limits (of queue %(queue_name)s and of every queue; NULL: all),
-- with the messages of their keys processing and waiting now (in their queue,
-- for a queue's own limit).  queue_name '' is a limit of every queue.
SELECT nullif(l.queue_name, '') AS queue_name, l.prefix, l.max_running, l.updated_at,
       (SELECT count(*) FROM {schema}.messages AS m
        WHERE m.state = 'processing' AND starts_with(m.concurrency_key, l.prefix)
          AND (l.queue_name = '' OR m.queue_name = l.queue_name)) AS processing,
       (SELECT count(*) FROM {schema}.messages AS m
        WHERE m.state = 'pending' AND starts_with(m.concurrency_key, l.prefix)
          AND (l.queue_name = '' OR m.queue_name = l.queue_name)) AS waiting
FROM {schema}.concurrency_limits AS l
WHERE %(queue_name)s::text IS NULL OR l.queue_name IN (%(queue_name)s::text, '')
ORDER BY l.queue_name, l.prefix;

-- name: busiest_keys --
-- The concurrency keys with messages now, per queue (keys that start with
-- %(prefix)s, NULL: any; of queue %(queue_name)s, NULL: any), the most waiting
-- first, at most %(limit)s: messages processing and waiting in the queue, and
-- the limit its claim applies (as claim_keyed: the queue's own run-time limit
-- of the longest prefix, else one of every queue, else the one the oldest
-- waiting message carries, else 1) and where it comes from.  The claim counts
-- a key's processing messages in every queue: see processing_everywhere.
SELECT k.queue_name, k.key, k.processing, k.waiting, lim.max_running, lim.limited_by, lim.limit_queue,
       (SELECT count(*) FROM {schema}.messages AS r
        WHERE r.concurrency_key = k.key AND r.state = 'processing') AS processing_everywhere
FROM (
    SELECT queue_name, concurrency_key AS key,
           count(*) FILTER (WHERE state = 'processing') AS processing,
           count(*) FILTER (WHERE state = 'pending') AS waiting,
           (array_agg(concurrency_limit ORDER BY next_attempt_at, id) FILTER (WHERE state = 'pending'))[1] AS carried
    FROM {schema}.messages
    WHERE concurrency_key IS NOT NULL
      AND (%(prefix)s::text IS NULL OR starts_with(concurrency_key, %(prefix)s::text))
      AND (%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s::text)
    GROUP BY queue_name, concurrency_key
) AS k
LEFT JOIN LATERAL (
    SELECT l.max_running AS run_time, l.prefix, nullif(l.queue_name, '') AS queue_name
    FROM {schema}.concurrency_limits AS l
    WHERE l.queue_name IN (k.queue_name, '') AND starts_with(k.key, l.prefix)
    ORDER BY l.queue_name = '', length(l.prefix) DESC
    LIMIT 1
) AS rt ON true
CROSS JOIN LATERAL (
    SELECT coalesce(rt.run_time, k.carried, 1) AS max_running, rt.prefix AS limited_by,
           rt.queue_name AS limit_queue
) AS lim
ORDER BY k.waiting DESC, k.processing DESC, k.queue_name, k.key
LIMIT %(limit)s;
