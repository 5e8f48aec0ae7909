-- The live messages as a Spark table: spark.read.format("dramatiq_backlog")
-- (dramatiq_pg_outbox/spark/backlog.py), one query per "-- name: <name> --"
-- header, in the namespace of queries.sql.  The reader takes the id range from
-- spark.sql's backlog_id_range and reads it in slices, one per Spark partition.

-- name: backlog_range_messages --
-- One Spark partition of format("dramatiq_backlog"): the live messages whose id
-- is in [%(lo)s, %(hi)s), without their payloads.  Named columns only (the
-- table may gain columns); times as epoch milliseconds, acquired_ms NULL
-- unless the message is being processed.
SELECT id, queue_name, actor_name, message_id, state, attempts, priority,
       (extract(epoch FROM enqueued_at) * 1000)::bigint,
       (extract(epoch FROM next_attempt_at) * 1000)::bigint,
       (extract(epoch FROM acquired_at) * 1000)::bigint,
       idempotency_key
  FROM {schema}.messages
 WHERE id >= %(lo)s::bigint AND id < %(hi)s::bigint;
