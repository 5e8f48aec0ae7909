-- All SQL of the dashboard, one query per "-- name: <name> --" header
-- (loaded by dramatiq_pg_outbox/dashboard/store.py, the same format as the
-- broker's queries.sql).  {schema} is replaced by the quoted schema name;
-- parameters are psycopg named placeholders with explicit casts.  Ages and
-- "now" come from the database clock.  Reads of aggregates go through the
-- analytics views and functions of migration 0003 (queue_backlog,
-- message_stats(), message_errors, message_attempts).

-- name: clock --
SELECT now();

-- name: queues --
-- One row per queue that has live messages or finished any in the last hour:
-- the backlog (queue_backlog is per queue and actor; summed here), finished
-- deliveries of the last hour and all dead letters still in history
-- (history_failed_idx).
WITH backlog AS (
    SELECT queue_name,
           sum(pending)::bigint AS pending,
           sum(delayed)::bigint AS delayed,
           sum(processing)::bigint AS processing,
           max(oldest_due_age_s) AS oldest_due_age_s
    FROM {schema}.queue_backlog
    GROUP BY queue_name
),
recent AS (
    SELECT queue_name,
           -- An acked delivery whose actor raised was retried (its retry was written with
           -- the ack): a failed attempt, not a completed message.
           count(*) FILTER (WHERE state = 'completed' AND error_type IS NULL) AS completed,
           count(*) FILTER (WHERE state = 'failed') AS failed
    FROM {schema}.history
    WHERE finished_at >= now() - interval '1 hour'
    GROUP BY queue_name
),
dead AS (
    SELECT queue_name, count(*) AS dead_letters
    FROM {schema}.history
    WHERE state = 'failed'
    GROUP BY queue_name
)
SELECT q.queue_name,
       coalesce(b.pending, 0) AS pending,
       coalesce(b.delayed, 0) AS delayed,
       coalesce(b.processing, 0) AS processing,
       coalesce(b.oldest_due_age_s, 0) AS oldest_due_age_s,
       coalesce(r.completed, 0) AS completed_last_hour,
       coalesce(r.failed, 0) AS failed_last_hour,
       coalesce(d.dead_letters, 0) AS dead_letters
FROM (SELECT queue_name FROM backlog UNION SELECT queue_name FROM recent UNION SELECT queue_name FROM dead) AS q
LEFT JOIN backlog AS b USING (queue_name)
LEFT JOIN recent AS r USING (queue_name)
LEFT JOIN dead AS d USING (queue_name)
ORDER BY q.queue_name;

-- name: queue_minutes --
-- Finished deliveries per queue and minute over the last hour (the sparklines
-- of the queues page); minutes without any are absent.  Minutes counted from
-- the epoch, as date_bin(interval '1 minute', finished_at, epoch) would
-- (PostgreSQL 13 has no date_bin).
SELECT queue_name, to_timestamp(floor(extract(epoch FROM finished_at) / 60) * 60) AS minute, count(*) AS n
FROM {schema}.history
WHERE finished_at >= now() - interval '1 hour'
GROUP BY 1, 2
ORDER BY 1, 2;

-- name: queue_messages --
-- One page of the live rows of one queue: processing first, then by due time,
-- filtered by actor and by what they wait for (%(status)s: due, delayed or
-- processing; NULL for any).  The caller asks for one row more than a page
-- to know whether there is a next one (no count of a long queue).  payload_head:
-- the first bytes of the payload, for the arguments' preview (never the whole of a
-- large payload).
SELECT id, queue_name, actor_name, message_id, state, attempts, enqueued_at, next_attempt_at,
       acquired_at, owner, extract(epoch FROM next_attempt_at - now())::double precision AS due_in_s,
       NULL::bytea AS payload, NULL::text AS idempotency_key, priority,
       substring(payload FROM 1 FOR %(head_bytes)s) AS payload_head
FROM {schema}.messages
WHERE queue_name = %(queue_name)s
  AND (%(actor_name)s::text IS NULL OR actor_name = %(actor_name)s)
  AND CASE %(status)s::text
        WHEN 'processing' THEN state = 'processing'
        WHEN 'due' THEN state = 'pending' AND next_attempt_at <= now()
        WHEN 'delayed' THEN state = 'pending' AND next_attempt_at > now()
        ELSE true
      END
ORDER BY state = 'processing' DESC, next_attempt_at, id
LIMIT %(limit)s OFFSET %(offset)s;

-- name: queue_actors --
-- The actors that have live rows in a queue (the actor filter of the queue page).
SELECT DISTINCT actor_name FROM {schema}.queue_backlog WHERE queue_name = %(queue_name)s ORDER BY 1;

-- name: running --
-- The rows whose actor a live worker process runs now, by worker, as of its
-- last heartbeat (workers.running, migration 0011); any other processing row
-- is prefetched.
SELECT w.id, w.running FROM {schema}.workers AS w WHERE {worker_alive};

-- name: run_now --
-- "Run now" of a delayed message: due at once, and its queue's workers woken.
-- A row that is due already, claimed or gone is not touched.  One row: the
-- queue (NULL when not touched) and whether the statement's snapshot saw the row
-- delayed: seen and not touched means it changed under the statement (claimed, or
-- moved to another partition by reclaim_messages(), which deletes and re-inserts it
-- with its id, so an UPDATE that waited on it finds it deleted); Store runs the
-- statement again, with a new snapshot.
WITH seen AS (
    SELECT id FROM {schema}.messages
    WHERE id = %(id)s AND state = 'pending' AND next_attempt_at > now()
), moved AS (
    UPDATE {schema}.messages SET next_attempt_at = now()
    WHERE id = %(id)s AND state = 'pending' AND next_attempt_at > now()
    RETURNING queue_name
)
SELECT w.queue_name, s.seen
FROM (SELECT EXISTS (SELECT 1 FROM seen) AS seen) AS s
LEFT JOIN (SELECT queue_name, pg_notify(%(channel)s, queue_name) FROM moved) AS w ON true;

-- name: discard_failed --
-- Deletes dead letters for good, by ids or by the failed page's filters (the
-- selection retry_failed applies); the count per queue.
WITH gone AS (
    DELETE FROM {schema}.history
    WHERE state = 'failed'
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND {dead_letter_filter}
    RETURNING queue_name
)
SELECT queue_name, count(*) FROM gone GROUP BY queue_name ORDER BY queue_name;

-- name: schedules --
-- The periodic jobs (migration 0006; disabled_at: 0011), active ones first;
-- next_in_s < 0: the next tick is late.
SELECT name, actor_name, queue_name, cron, every_ms, tz, missed, grace_ms, last_run_at, next_run_at,
       extract(epoch FROM next_run_at - now())::double precision AS next_in_s, runs, missed_ticks,
       removed_at, disabled_at
FROM {schema}.schedules
ORDER BY removed_at IS NOT NULL, name;

-- name: set_schedule_enabled --
-- Enables or disables one schedule (schedulers skip a disabled one); the row
-- changed, if any.
UPDATE {schema}.schedules
SET disabled_at = CASE WHEN %(enabled)s::boolean THEN NULL ELSE coalesce(disabled_at, now()) END
WHERE name = %(name)s AND removed_at IS NULL
  AND (disabled_at IS NULL) <> %(enabled)s::boolean
RETURNING name;

-- name: message --
-- One live row with the first %(shown_bytes)s bytes of its payload and its size (a
-- page stays small whatever the payload; message_payload gives all of it).
SELECT id, queue_name, actor_name, message_id, state, attempts, enqueued_at, next_attempt_at,
       acquired_at, owner, extract(epoch FROM next_attempt_at - now())::double precision AS due_in_s,
       substring(payload FROM 1 FOR %(shown_bytes)s) AS payload, idempotency_key, priority,
       NULL::bytea AS payload_head, octet_length(payload) AS payload_bytes,
       substring(payload FROM greatest(octet_length(payload) - %(tail_bytes)s + 1, 1)) AS payload_tail
FROM {schema}.messages
WHERE id = %(id)s;

-- name: message_payload --
-- The whole payload of one live row (the raw download of the message page).
SELECT payload FROM {schema}.messages WHERE id = %(id)s;

-- name: workers --
-- Consumer processes by heartbeat, with the rows each one holds now
-- (messages_owner_idx), and whether the rescuer counts them alive.
SELECT w.id, w.hostname, w.pid, w.queues, w.started_at,
       extract(epoch FROM now() - w.heartbeat_at)::double precision AS heartbeat_age_s,
       (SELECT count(*) FROM {schema}.messages AS m WHERE m.owner = w.id AND m.state = 'processing')
           AS processing,
       {worker_alive} AS alive
FROM {schema}.workers AS w
ORDER BY w.hostname, w.pid;

-- name: failed --
-- Dead letters, newest first, filtered by the dead_letter_filter fragment of
-- queries.sql (the selection retry_failed applies).  The
-- exception line is the last line of the traceback.  total is the number of
-- matching rows, for paging.
SELECT id, queue_name, actor_name, message_id, attempts, enqueued_at, finished_at, error_type,
       regexp_replace(rtrim(coalesce(error, ''), E'\n'), '^.*\n', '') AS error_line,
       count(*) OVER () AS total
FROM {schema}.history
WHERE state = 'failed' AND {dead_letter_filter}
ORDER BY finished_at DESC, id DESC
LIMIT %(limit)s OFFSET %(offset)s;

-- name: failed_queues --
SELECT DISTINCT queue_name FROM {schema}.history WHERE state = 'failed' ORDER BY 1;

-- name: error_types --
-- Per actor and error type (message_errors of migration 0003): the filter
-- choices of the failed page and the "top errors" table of the charts page.
SELECT actor_name, error_type, retried, failed, total, rank
FROM {schema}.message_errors
ORDER BY actor_name, rank;

-- name: purge_queue --
-- Deletes the waiting rows (due and delayed) of one queue, or those of them whose
-- id is in %(ids)s (NULL: all).  Rows being processed are left to finish; their
-- acks archive them as usual.  Returns how many, and the ids the statement's
-- snapshot saw waiting but did not delete: rows changed under it (claimed, or
-- moved by reclaim_messages() as in run_now); Store runs it again for those.
WITH seen AS (
    SELECT id FROM {schema}.messages
    WHERE queue_name = %(queue_name)s AND state = 'pending'
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
), purged AS (
    DELETE FROM {schema}.messages
    WHERE queue_name = %(queue_name)s AND state = 'pending'
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
    RETURNING id
)
SELECT (SELECT count(*) FROM purged), ARRAY(SELECT id FROM seen EXCEPT SELECT id FROM purged);

-- name: cancel_message --
-- Cancels a message (the dashboard's Cancel, the CLI's cancel), in one statement:
-- * waiting: it moves to history as canceled (error type Canceled, the reason as
--   its error), counted in finished_counts;
-- * running (processing): it is marked (cancel_requested_at and cancel_reason,
--   migration 0022) and the broker channel is told "cancel:<row id>": the worker
--   holding it interrupts its actor and archives it as canceled; a worker that
--   missed the notification finds the mark at its next heartbeat, and the rescuer
--   archives the row as canceled if that worker died;
-- * finished: nothing changes; its state and time in history are returned.
-- One row: the queue (NULL when neither canceled nor marked), what was done
-- ('canceled', 'canceling' or NULL), the worker holding a marked row (host and pid),
-- whether the statement's snapshot saw the row in messages (seen and neither
-- canceled nor marked: changed under it, claimed or moved, as in run_now; Store
-- runs it again), and for a row not seen, its state and finish time in history.
WITH seen AS (
    SELECT id FROM {schema}.messages WHERE id = %(id)s
), canceled AS (
    DELETE FROM {schema}.messages
    WHERE id = %(id)s AND state = 'pending'
    RETURNING *
), archived AS (
    INSERT INTO {schema}.history
        (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at,
         error_type, error, payload, idempotency_key, priority)
    SELECT id, queue_name, actor_name, message_id, 'canceled', attempts, enqueued_at, NULL,
           'Canceled', %(reason)s::text, payload, idempotency_key, priority
    FROM canceled
), counted AS (
    INSERT INTO {schema}.finished_counts AS c (queue_name, actor_name, state, shard, n)
    SELECT queue_name, actor_name, 'canceled', pg_backend_pid() %% 16, count(*)
    FROM canceled GROUP BY queue_name, actor_name
    ON CONFLICT (queue_name, actor_name, state, shard) DO UPDATE SET n = c.n + excluded.n
), marked AS (
    UPDATE {schema}.messages AS m
    SET cancel_requested_at = coalesce(m.cancel_requested_at, now()),
        cancel_reason = coalesce(m.cancel_reason, %(reason)s::text)
    WHERE m.id = %(id)s AND m.state = 'processing'
    RETURNING m.queue_name, m.owner, pg_notify(%(channel)s, 'cancel:' || m.id::text) AS notified
)
SELECT coalesce((SELECT queue_name FROM canceled), (SELECT queue_name FROM marked)) AS queue_name,
       CASE WHEN EXISTS (SELECT 1 FROM canceled) THEN 'canceled'
            WHEN EXISTS (SELECT 1 FROM marked) THEN 'canceling' END AS outcome,
       (SELECT w.hostname || ' pid ' || w.pid::text
        FROM marked JOIN {schema}.workers AS w ON w.id = marked.owner) AS worker,
       EXISTS (SELECT 1 FROM seen) AS seen,
       h.state AS finished_state, h.finished_at
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT state, finished_at FROM {schema}.history
    WHERE id = %(id)s AND NOT EXISTS (SELECT 1 FROM seen)
    ORDER BY finished_at DESC LIMIT 1
) AS h ON true;

-- name: message_stats --
-- Throughput and latency per actor and time bucket (message_stats() of
-- migration 0003), since a time on the database clock.
SELECT actor_name, bucket_start, deliveries, completed, retried, failed, throughput_per_s,
       wait_p50_ms, wait_p99_ms, run_p50_ms, run_p99_ms
FROM {schema}.message_stats(%(bucket)s::interval, %(since)s::timestamptz)
ORDER BY actor_name, bucket_start;

-- name: message_attempts --
SELECT actor_name, attempts, messages FROM {schema}.message_attempts ORDER BY actor_name, attempts;

-- name: finished_message --
-- One finished row (history) with the first %(shown_bytes)s bytes of its payload
-- and its size, found by its id (the primary key (id, finished_at) of each day
-- partition: one index probe per partition).
SELECT id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at, finished_at,
       error_type, error, substring(payload FROM 1 FOR %(shown_bytes)s) AS payload,
       octet_length(payload) AS payload_bytes, idempotency_key, priority,
       substring(payload FROM greatest(octet_length(payload) - %(tail_bytes)s + 1, 1)) AS payload_tail
FROM {schema}.history
WHERE id = %(id)s;

-- name: finished_payload --
-- The whole payload of one finished row (the raw download of its page).
SELECT payload FROM {schema}.history WHERE id = %(id)s;

-- name: message_deliveries --
-- Every stored delivery of one Dramatiq message, live and finished, oldest
-- first: Retries enqueues a retry as a new row with the same message_id, so
-- each row is one delivery (or several, when a worker died and the row was
-- released: its attempts).  No index of history has message_id (one would be
-- a write on every ack): the finished rows are looked for in the partitions
-- from %(since)s on (the message's own timestamp, which its retries keep, less
-- a day for the clocks of producers), a sequential read of each.  messages has
-- no index on message_id either: a scan of the live rows, which the claims keep
-- few.
SELECT id, state, attempts, enqueued_at, acquired_at AS started_at, NULL::timestamptz AS finished_at,
       NULL::text AS error_type, NULL::text AS error_line, next_attempt_at
FROM {schema}.messages
WHERE message_id = %(message_id)s
UNION ALL
SELECT id, state, attempts, enqueued_at, started_at, finished_at, error_type,
       regexp_replace(rtrim(coalesce(error, ''), E'\n'), '^.*\n', '') AS error_line, NULL
FROM {schema}.history
WHERE message_id = %(message_id)s AND finished_at >= %(since)s
ORDER BY enqueued_at, id
LIMIT 1000;

-- name: find_message --
-- The newest row (live first, then finished from %(since)s on, as in
-- message_deliveries) of one Dramatiq message id: where a follow-up's link
-- (a pipeline's next step) leads.
(SELECT id FROM {schema}.messages WHERE message_id = %(message_id)s ORDER BY id DESC LIMIT 1)
UNION ALL
(SELECT id FROM {schema}.history
 WHERE message_id = %(message_id)s AND finished_at >= %(since)s
 ORDER BY finished_at DESC, id DESC LIMIT 1)
LIMIT 1;

-- name: message_results --
-- The stored result of a message (results backend, migration 0004) under any of
-- the keys Dramatiq's ResultBackend.build_message_key gives it (the MD5 and the
-- readable form); an expired one is not shown.
SELECT message_key, result, expires_at FROM {schema}.results
WHERE message_key = ANY(%(keys)s::text[]) AND expires_at > now();

-- name: search_timeout --
-- The longest a history search may run (this transaction only), in milliseconds.
SELECT set_config('statement_timeout', %(ms)s::text, true);

-- name: history --
-- One page of finished rows, newest first, between %(since)s and %(until)s
-- (partition pruning: only the days of the range are read), filtered by queue,
-- actor, state and message id (each NULL for any) and by %(needle)s, bytes
-- that must appear in the arguments of the payload as Dramatiq's JSONEncoder
-- writes it: between "args": and the "},"options": that closes the keyword
-- arguments (a string value's quotes are escaped, so neither can occur inside
-- one).  The cheap test of the whole payload first, then of that span; no
-- decoding, so no payload (pickle, another encoder) can make the search fail.
-- No index serves the arguments or the order (an index would be a write on
-- every ack): each day of the range is read sequentially, the top rows kept
-- (benchmarks/README.md, "History search", has the cost on 10 million rows).
-- Keyset paging: the page after (%(before_at)s, %(before_id)s).
SELECT id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at, finished_at,
       error_type, regexp_replace(rtrim(coalesce(error, ''), E'\n'), '^.*\n', '') AS error_line,
       substring(payload FROM 1 FOR %(head_bytes)s) AS payload_head, priority
FROM {schema}.history
WHERE finished_at >= %(since)s AND finished_at < %(until)s
  AND (%(queue_name)s::text IS NULL OR queue_name = %(queue_name)s)
  AND (%(actor_name)s::text IS NULL OR actor_name = %(actor_name)s)
  AND (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(message_id)s::text IS NULL OR message_id = %(message_id)s)
  AND (%(before_at)s::timestamptz IS NULL OR (finished_at, id) < (%(before_at)s, %(before_id)s::bigint))
  AND (%(needle)s::bytea IS NULL
       OR (position(%(needle)s::bytea IN payload) > 0
           AND position('"args":'::bytea IN payload) > 0
           AND position(%(needle)s::bytea IN substring(
                   payload
                   FROM position('"args":'::bytea IN payload)
                   FOR greatest(position('},"options":'::bytea IN payload)
                                - position('"args":'::bytea IN payload) + 1, 0)
               )) > 0))
ORDER BY finished_at DESC, id DESC
LIMIT %(limit)s;

-- name: run_schedule_now --
-- "Run now" of a schedule: its next tick is due at once, so the next pass of a
-- scheduler (within its poll_interval) claims and enqueues it as any due tick,
-- exactly once (periodic_claim), and moves next_run_at past now by the rule.  A
-- disabled or removed schedule, or one already due, is not touched.  One row per
-- schedule changed.
UPDATE {schema}.schedules SET next_run_at = now()
WHERE name = %(name)s AND removed_at IS NULL AND disabled_at IS NULL AND next_run_at > now()
RETURNING name;
