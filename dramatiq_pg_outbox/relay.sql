-- The outbox relay's statements (dramatiq_pg_outbox/relay/), one query per
-- "-- name: <name> --" header, in the namespace of queries.sql.  The relay
-- archives what it published with the broker's own "archive" statement.

-- name: relay_claim --
-- Like a consumer's claim, under a new lease, but charging no attempt: the
-- relay publishes, it does not run the actor.
WITH picked AS (
    SELECT m.id FROM {schema}.messages AS m
    WHERE m.queue_name = ANY(%(queues)s::text[]) AND m.state = 'pending' AND m.next_attempt_at <= now()
      AND m.queue_name <> ALL (ARRAY(SELECT queue_name FROM {schema}.queue_pauses))
    ORDER BY m.next_attempt_at, m.id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.messages AS m
SET state = 'processing', lease = %(lease)s, owner = %(owner)s, acquired_at = now()
FROM picked WHERE m.id = picked.id
RETURNING m.id, m.queue_name, m.next_attempt_at, m.payload;

-- name: relay_release --
-- Hands back unpublished rows (no attempt was charged, none is refunded).
UPDATE {schema}.messages AS m
SET state = 'pending', lease = NULL, owner = NULL
FROM unnest(%(ids)s::bigint[], %(leases)s::uuid[]) AS a(id, lease)
WHERE m.id = a.id AND m.lease = a.lease AND m.state = 'processing';

-- name: relay_next_due --
-- Milliseconds until the earliest delayed row of the relayed queues (NULL: none).
SELECT (extract(epoch FROM min(d.next_attempt_at) - now()) * 1000)::float8
FROM unnest(%(queues)s::text[]) AS q(name)
CROSS JOIN LATERAL (
    SELECT m.next_attempt_at FROM {schema}.messages AS m
    WHERE m.queue_name = q.name AND m.state = 'pending'
    ORDER BY m.next_attempt_at LIMIT 1
) AS d;

-- name: relay_lag --
-- Per relayed queue: age of the oldest due row (seconds) and how many are due.
SELECT q.name, coalesce(extract(epoch FROM now() - min(m.next_attempt_at)), 0)::float8, count(m.id)
FROM unnest(%(queues)s::text[]) AS q(name)
LEFT JOIN {schema}.messages AS m
  ON m.queue_name = q.name AND m.state = 'pending' AND m.next_attempt_at <= now()
GROUP BY q.name ORDER BY q.name;
