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

-- name: spark_insert --
-- What is new becomes messages: a key already in history (processed) or in
-- the hot table (waiting or running) is skipped.
INSERT INTO {schema}.messages
    (queue_name, actor_name, message_id, next_attempt_at, payload, idempotency_key, priority)
SELECT %(queue_name)s, %(actor_name)s, st.message_id,
       now() + %(delay)s * interval '1 millisecond',
       coalesce(st.payload, convert_to(st.payload_text, 'UTF8')), st.idempotency_key,
       %(priority)s::smallint
FROM dpo_stage AS st
WHERE NOT EXISTS (
    SELECT 1 FROM {schema}.history AS h WHERE h.idempotency_key = st.idempotency_key
)
ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING;

-- name: spark_drop_twins --
-- A twin whose archiving committed while spark_insert ran is not in that
-- statement's snapshot of history; this statement's newer snapshot sees it,
-- and the row this transaction wrote for it goes.
DELETE FROM {schema}.messages AS m
USING dpo_stage AS st
WHERE m.idempotency_key = st.idempotency_key
  AND m.xmin = pg_current_xact_id()::xid
  AND EXISTS (
    SELECT 1 FROM {schema}.history AS h WHERE h.idempotency_key = st.idempotency_key
  );

-- name: history_id_range --
-- The id range of history (since a time, if given): Spark splits its read by it.
SELECT min(id), max(id) FROM {schema}.history
 WHERE %(since)s::timestamptz IS NULL OR finished_at >= %(since)s::timestamptz;

-- name: history_rows --
-- One Spark partition of history (no payloads, no error texts), times in epoch ms.
SELECT id, queue_name, actor_name, message_id, state, attempts, error_type,
       (extract(epoch FROM enqueued_at) * 1000)::bigint,
       (extract(epoch FROM started_at) * 1000)::bigint,
       (extract(epoch FROM finished_at) * 1000)::bigint
  FROM {schema}.history
 WHERE id >= %(lo)s AND id < %(hi)s
   AND (%(since)s::timestamptz IS NULL OR finished_at >= %(since)s::timestamptz);

-- name: backlog_id_range --
-- The id range of the live messages: Spark splits its read by it.
SELECT min(id), max(id) FROM {schema}.messages;

-- name: backlog_rows --
-- One Spark partition of the live messages: queue, actor, state, due, age of due rows in ms.
SELECT queue_name, actor_name, state, next_attempt_at <= now(),
       (extract(epoch FROM now() - next_attempt_at) * 1000)::bigint
  FROM {schema}.messages
 WHERE id >= %(lo)s AND id < %(hi)s;
