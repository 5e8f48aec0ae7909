-- The Spark integration's statements (dramatiq_pg_outbox/spark/ and
-- spark_analytics.py), one query per "-- name: <name> --" header, in the
-- namespace of queries.sql.

-- name: spark_stage --
-- One executor partition's rows are staged first: a payload arrives either as
-- text (CSV, payloads encoded in the JVM) or as bytes (binary COPY, encoded in Python).
CREATE TEMP TABLE dpo_stage (message_id text, idempotency_key text, payload_text text, payload bytea)
    ON COMMIT DROP;

-- name: spark_copy_text --
COPY dpo_stage (message_id, idempotency_key, payload_text) FROM STDIN (FORMAT csv);

-- name: spark_copy_binary --
COPY dpo_stage (message_id, idempotency_key, payload) FROM STDIN (FORMAT BINARY);

-- name: spark_copy_claims --
-- The direct write (spark/write.py's _write_direct): a task whose rows all fit
-- in memory claims every key by a plain COPY first.  The primary key refuses a
-- key already claimed (its message waits, runs or is in history), claimed by a
-- twin task, or that the partition holds twice: the whole attempt is then
-- rolled back and the task writes through dpo_stage instead.
COPY {schema}.idempotency_keys (idempotency_key) FROM STDIN (FORMAT BINARY);

-- name: spark_copy_stage_keys --
-- ... and stages the same keys alone, for spark_drop_in_history.
COPY dpo_stage (idempotency_key) FROM STDIN (FORMAT BINARY);

-- name: spark_drop_in_history --
-- The staged keys that history holds (keys an older version of the package
-- stored without their row in idempotency_keys): the direct write goes through
-- dpo_stage if there is one.  The second statement of spark_drop_known, so that
-- the planner makes the same choice (an EXISTS planned a nested loop probing
-- each day partition's index for every staged key: 1.1 s for 250,000 keys
-- against a history of one row, against 0.2 s for the DELETE's merge join).
DELETE FROM dpo_stage AS st USING {schema}.history AS h
 WHERE h.idempotency_key = st.idempotency_key;

-- name: spark_copy_messages --
-- ... then COPYs the messages straight into the table, in the partition of keyed
-- messages (slot -1), enqueued_at and next_attempt_at now() by their defaults
-- (the direct write runs only without a delay).  The unique key index refuses a
-- key whose message an older version of the package stored without its row in
-- idempotency_keys: rolled back, through dpo_stage too.
COPY {schema}.messages (queue_name, actor_name, message_id, idempotency_key, payload, priority, slot)
FROM STDIN (FORMAT BINARY);

-- name: spark_drop_known --
-- The staged rows whose key is already taken (its row in idempotency_keys,
-- migration 0014: the message is waiting, running or in history) go before
-- the insert, so that the insert of what is left is a plain one.  The join with
-- history refuses the keys an older version of the package stored without a
-- row (during a rolling upgrade).  Two joins, not an OR of two EXISTS (which
-- runs a subplan per staged row): the planner hashes an empty or small side
-- and probes the key indexes of a large one.
DELETE FROM dpo_stage AS st USING {schema}.idempotency_keys AS k
 WHERE k.idempotency_key = st.idempotency_key;
DELETE FROM dpo_stage AS st USING {schema}.history AS h
 WHERE h.idempotency_key = st.idempotency_key;

-- name: spark_stage_repeats --
-- Staged rows whose key an earlier staged row has (the data holds the key twice
-- in this partition), and the first such key: the writer counts them, or fails
-- the task with on_duplicate_key=error.
SELECT coalesce(sum(n - 1), 0)::bigint, min(idempotency_key)
FROM (SELECT idempotency_key, count(*) AS n FROM dpo_stage GROUP BY idempotency_key HAVING count(*) > 1) AS d;

-- name: spark_insert_new --
-- The staged rows left by spark_drop_known become messages, each key claimed
-- by a plain INSERT of its row in idempotency_keys in the same statement.  The
-- primary key refuses a key that a twin task (speculative execution, a retried
-- task still running) claimed since, or a key the partition holds twice; the
-- writer then rolls this statement back and runs spark_insert.  If it
-- succeeds, this task claimed every staged key: none can be anyone else's.
-- About 2/3 of the cost of an ON CONFLICT insert per row (no speculative
-- insertion).
WITH claimed AS (
    INSERT INTO {schema}.idempotency_keys (idempotency_key)
    SELECT idempotency_key FROM dpo_stage
)
INSERT INTO {schema}.messages
    (queue_name, actor_name, message_id, next_attempt_at, payload, idempotency_key, priority, slot)
SELECT %(queue_name)s, %(actor_name)s, st.message_id,
       now() + %(delay)s * interval '1 millisecond',
       coalesce(st.payload, convert_to(st.payload_text, 'UTF8')), st.idempotency_key,
       %(priority)s::smallint, -1
FROM dpo_stage AS st;

-- name: spark_insert --
-- The writer's fallback when spark_insert_new meets a key claimed since: each
-- staged key is claimed ON CONFLICT DO NOTHING (as enqueue does; in key order,
-- so twin tasks never deadlock), and only the keys this statement claimed
-- become messages, the first staged row of a key the partition repeats.  A
-- twin that claimed a key and whose message was archived since is refused by
-- the key's row, which the archive leaves alone (no twin check is needed).
-- Under REPEATABLE READ or SERIALIZABLE a key claimed after the task's snapshot
-- is a serialization error: the task fails, and Spark's retry skips the key.
WITH staged AS (
    SELECT st.*, row_number() OVER (PARTITION BY st.idempotency_key ORDER BY st.ctid) = 1 AS first
    FROM dpo_stage AS st
),
claimed AS (
    INSERT INTO {schema}.idempotency_keys (idempotency_key)
    SELECT s.idempotency_key FROM staged AS s
    WHERE s.first
      AND NOT EXISTS (SELECT 1 FROM {schema}.history AS h WHERE h.idempotency_key = s.idempotency_key)
    ORDER BY s.idempotency_key
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING idempotency_key
)
INSERT INTO {schema}.messages
    (queue_name, actor_name, message_id, next_attempt_at, payload, idempotency_key, priority, slot)
SELECT %(queue_name)s, %(actor_name)s, s.message_id,
       now() + %(delay)s * interval '1 millisecond',
       coalesce(s.payload, convert_to(s.payload_text, 'UTF8')), s.idempotency_key,
       %(priority)s::smallint, -1
FROM staged AS s JOIN claimed AS c ON c.idempotency_key = s.idempotency_key
WHERE s.first
ON CONFLICT (idempotency_key, slot) WHERE idempotency_key IS NOT NULL DO NOTHING;

-- name: backlog_id_range --
-- The id range of the live messages: Spark splits its read by it.
SELECT min(id), max(id) FROM {schema}.messages;

-- name: backlog_rows --
-- One Spark partition of the live messages: queue, actor, state, due, age of due rows in ms.
SELECT queue_name, actor_name, state, next_attempt_at <= now(),
       (extract(epoch FROM now() - next_attempt_at) * 1000)::bigint
  FROM {schema}.messages
 WHERE id >= %(lo)s AND id < %(hi)s;

-- name: history_days --
-- The UTC days that may hold history (format("dramatiq_history") reads one
-- Spark partition per day): the day of every day partition (migration 0007,
-- history_pYYYYMMDD) and the days of the rows in history_default.
SELECT to_date(substr(c.relname, 10), 'YYYYMMDD')
  FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
 WHERE i.inhparent = '{schema}.history'::regclass AND c.relname ~ '^history_p[0-9]{8}$'
UNION
SELECT DISTINCT (finished_at AT TIME ZONE 'UTC')::date FROM {schema}.history_default
ORDER BY 1;

-- name: history_range_rows --
-- One Spark partition of format("dramatiq_history"): the rows finished in
-- [%(lo)s, %(hi)s) epoch ms, of the queues, actors and states given (NULL:
-- any).  finished_ms is compared exactly as the column is computed (Spark does
-- not check pushed filters again); the range on finished_at, 1 ms wider, lets
-- PostgreSQL read only the partitions of those days.
SELECT id, queue_name, actor_name, message_id, state, attempts, error_type,
       (extract(epoch FROM enqueued_at) * 1000)::bigint,
       (extract(epoch FROM started_at) * 1000)::bigint,
       (extract(epoch FROM finished_at) * 1000)::bigint
  FROM {schema}.history
 WHERE finished_at >= to_timestamp((%(lo)s::bigint - 1) / 1000.0)
   AND finished_at < to_timestamp((%(hi)s::bigint + 1) / 1000.0)
   AND (extract(epoch FROM finished_at) * 1000)::bigint >= %(lo)s::bigint
   AND (extract(epoch FROM finished_at) * 1000)::bigint < %(hi)s::bigint
   AND (%(queues)s::text[] IS NULL OR queue_name = ANY (%(queues)s::text[]))
   AND (%(actors)s::text[] IS NULL OR actor_name = ANY (%(actors)s::text[]))
   AND (%(states)s::text[] IS NULL OR state = ANY (%(states)s::text[]));

-- name: spark_write_record --
-- What one committed write of format("dramatiq") did (migration 0019), from the
-- commit messages of its tasks.
INSERT INTO {schema}.spark_writes (batch_id, spark_batch, tasks, rows, enqueued, skipped, repeated, seconds)
VALUES (%(batch_id)s, %(spark_batch)s, %(tasks)s, %(rows)s, %(enqueued)s, %(skipped)s, %(repeated)s,
        %(seconds)s);

-- name: spark_write_counts --
-- The recorded writes of one batch id, oldest first.
SELECT batch_id, spark_batch, tasks, rows, enqueued, skipped, repeated, seconds, committed_at
FROM {schema}.spark_writes
WHERE batch_id = %(batch_id)s
ORDER BY id;

-- name: spark_live_workers --
-- The check_actor option (migration 0020): the queues and the actors of each
-- live worker process, on the database clock.
SELECT w.queues, w.actors FROM {schema}.workers AS w WHERE {worker_alive};
