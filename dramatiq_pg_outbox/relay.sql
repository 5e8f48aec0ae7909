-- The outbox relay's statements (dramatiq_pg_outbox/relay/), one query per
-- "-- name: <name> --" header, in the namespace of queries.sql.  The relay
-- archives what it published with the broker's own "archive" statement.

-- name: relay_claim --
-- Like a consumer's claim, under a new lease, but charging no attempt: the
-- relay publishes, it does not run the actor.  Each relayed queue is read by
-- its own index scan of messages_ready_idx in claim order (LATERAL), and the
-- earliest %(limit)s of them are taken: with "queue_name = ANY (...)" the
-- planner sorts every due row of the queues on every claim, which a backlog
-- (or, with the horizon pinned, the dead rows of a sequential scan) makes as
-- slow as the table is large.  A queue's scan may lock up to %(limit)s rows
-- that the outer LIMIT does not take; they stay pending and are unlocked at
-- the end of the statement.  Each scan starts after the relay's watermark,
-- (%(from_at)s, %(from_id)s), or at the queue's first entry for a sweep
-- (both NULL): see claim_from and the claim in queries.sql.
WITH picked AS (
    SELECT c.id
    FROM unnest(%(queues)s::text[]) AS q(name)
    CROSS JOIN LATERAL (
        SELECT m.id, m.next_attempt_at FROM {schema}.messages AS m
        WHERE m.queue_name = q.name AND m.state = 'pending' AND m.next_attempt_at <= now()
          AND {claim_from}
          AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses AS p WHERE p.queue_name = q.name)
        ORDER BY m.next_attempt_at, m.id
        LIMIT %(limit)s
        FOR UPDATE OF m SKIP LOCKED
    ) AS c
    ORDER BY c.next_attempt_at, c.id
    LIMIT %(limit)s
)
UPDATE {schema}.messages AS m
SET state = 'processing', lease = %(lease)s, owner = %(owner)s, acquired_at = now()
WHERE m.id = ANY (ARRAY(SELECT id FROM picked))
RETURNING m.id, m.queue_name, m.next_attempt_at, m.payload;

-- name: relay_release --
-- Hands back unpublished rows (no attempt was charged, none is refunded).
-- Fenced by lease alone, like ack (see it in queries.sql).
UPDATE {schema}.messages AS m
SET state = 'pending', lease = NULL, owner = NULL
WHERE m.id = ANY(%(ids)s::bigint[]) AND {fenced};

-- name: relay_next_due --
-- Milliseconds until the earliest delayed row of the relayed queues (NULL: none).
-- Only rows not due yet: the index range starts at now(), past the entries of
-- the rows claimed so far, which a pinned MVCC horizon keeps (see claim_from).
SELECT (extract(epoch FROM min(d.next_attempt_at) - now()) * 1000)::float8 AS due_in_ms
FROM unnest(%(queues)s::text[]) AS q(name)
CROSS JOIN LATERAL (
    SELECT m.next_attempt_at FROM {schema}.messages AS m
    WHERE m.queue_name = q.name AND m.state = 'pending' AND m.next_attempt_at > now()
    ORDER BY m.next_attempt_at LIMIT 1
) AS d;

-- name: relay_lag --
-- Per relayed queue: age of the oldest due row (seconds) and how many are due.
SELECT q.name AS queue_name, coalesce(extract(epoch FROM now() - min(m.next_attempt_at)), 0)::float8 AS age_s,
       count(m.id) AS due
FROM unnest(%(queues)s::text[]) AS q(name)
LEFT JOIN {schema}.messages AS m
  ON m.queue_name = q.name AND m.state = 'pending' AND m.next_attempt_at <= now()
GROUP BY q.name ORDER BY q.name;
