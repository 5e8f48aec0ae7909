-- The operator statements, one query per "-- name: <name> --" header (loaded by
-- dramatiq_pg_outbox/_queries.py, the same namespace as queries.sql): the
-- CLI's reports, history partitions, the Prometheus gauges, the migration
-- environment's helpers and the throwaway test servers.  {schema} is the
-- quoted schema; other {identifiers} are filled by _queries.with_identifiers.

-- name: table_exists --
-- Whether table %(table)s of schema %(schema)s exists (names unquoted).
SELECT to_regclass(format('%%I.%%I', %(schema)s::text, %(table)s::text)) IS NOT NULL;

-- name: applied_revisions --
-- The revisions recorded in our alembic version table ({table}: migrations.VERSION_TABLE).
SELECT version_num FROM {schema}.{table} ORDER BY 1;

-- name: create_schema --
-- Creates the schema only if it does not exist yet.  CREATE SCHEMA IF NOT
-- EXISTS checks the CREATE privilege on the database even when the schema
-- exists; this does not, so a migration role may run in a schema a DBA created
-- for it (docs/security.md) without any privilege on the database.
DO $$ BEGIN IF to_regnamespace('{schema}') IS NULL THEN CREATE SCHEMA {schema}; END IF; END $$;

-- name: set_schema_revision --
-- Records the revision in the comment of messages (read by schema_revision);
-- {revision} is an integer filled in by migrations.set_schema_revision.
COMMENT ON TABLE {schema}.messages IS 'dramatiq-pg-outbox schema revision {revision}';

-- name: status_messages --
-- `dramatiq-pg-outbox status`: live rows per queue and state, delayed ones, the
-- age of the oldest (seconds).
SELECT queue_name, state, count(*) AS messages,
       count(*) FILTER (WHERE next_attempt_at > now()) AS delayed,
       extract(epoch FROM now() - min(enqueued_at)) AS oldest_s
  FROM {schema}.messages GROUP BY 1, 2 ORDER BY 1, 2;

-- name: status_failed --
-- Dead letters per queue: in the last hour, and all still in history.
SELECT queue_name, count(*) FILTER (WHERE finished_at > now() - interval '1 hour') AS last_hour,
       count(*) AS in_history
  FROM {schema}.history WHERE state = 'failed' GROUP BY 1 ORDER BY 1;

-- name: status_workers --
-- The registered consumer processes and the age of their heartbeat (seconds).
SELECT hostname, pid, queues, extract(epoch FROM now() - heartbeat_at) AS heartbeat_age_s
  FROM {schema}.workers ORDER BY hostname, pid;

-- name: failed_list --
-- `dramatiq-pg-outbox failed`: the newest dead letters, of one queue or all.
SELECT id, queue_name, actor_name, attempts, finished_at, error_type, error
  FROM {schema}.history
 WHERE state = 'failed' AND (%(queue)s::text IS NULL OR queue_name = %(queue)s)
 ORDER BY finished_at DESC, id DESC
 LIMIT %(limit)s;

-- name: default_partition_rows --
-- Rows that fell into history_default (no day partition existed for them).
SELECT count(*) FROM {schema}.history_default;

-- name: day_partitions --
-- The partitions of history (day partitions are named history_pYYYYMMDD).
SELECT c.relname
  FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
 WHERE i.inhparent = to_regclass(%(table)s);

-- name: prune_cutoff --
-- The database clock's cutoff of a prune.
SELECT now() - %(older_than)s::interval;

-- name: set_lock_timeout --
-- lock_timeout for the rest of this transaction, in milliseconds (as text).
SELECT set_config('lock_timeout', %(lock_timeout)s, true);

-- name: estimated_rows --
-- The planner's row estimate of a table (names unquoted): dropping a partition must not count it.
SELECT greatest(reltuples, 0)::bigint FROM pg_class
 WHERE oid = to_regclass(format('%%I.%%I', %(schema)s::text, %(table)s::text));

-- name: drop_partition --
-- Drops one day partition of history (ACCESS EXCLUSIVE: run under set_lock_timeout).
DROP TABLE {schema}.{partition};

-- name: delete_history_before --
-- Deletes the rows of one partition of history that finished before the cutoff.
DELETE FROM {schema}.{partition} WHERE finished_at < %(cutoff)s;

-- name: count_history_before --
-- The rows of one partition of history that finished before the cutoff (prune --dry-run).
SELECT count(*) FROM {schema}.{partition} WHERE finished_at < %(cutoff)s;

-- name: prune_idempotency_keys --
-- After prune removed the old history rows: frees the idempotency keys
-- (idempotency_keys, migration 0014) that no row of messages or history holds
-- any more, in one snapshot (a message moves between the two tables in one
-- transaction, so a key that has a row is seen in one of them).  Also frees
-- the keys of messages purged from their queue or of dead letters discarded
-- since the last prune.  A send of a freed key is stored again.
DELETE FROM {schema}.idempotency_keys AS k
 WHERE NOT EXISTS (SELECT 1 FROM {schema}.messages AS m WHERE m.idempotency_key = k.idempotency_key)
   AND NOT EXISTS (SELECT 1 FROM {schema}.history AS h WHERE h.idempotency_key = k.idempotency_key);

-- name: count_idempotency_keys_before --
-- The keys prune would free (--dry-run): those of no live message and of no
-- history row that finished at or after the cutoff.
SELECT count(*) FROM {schema}.idempotency_keys AS k
 WHERE NOT EXISTS (SELECT 1 FROM {schema}.messages AS m WHERE m.idempotency_key = k.idempotency_key)
   AND NOT EXISTS (SELECT 1 FROM {schema}.history AS h
                    WHERE h.idempotency_key = k.idempotency_key AND h.finished_at >= %(cutoff)s);

-- name: metrics_gauges --
-- Every Prometheus gauge in one statement: (kind, queue_name, state, value, actor_name)
-- rows (kinds: messages, oldest, running (age of the oldest claim), dead, workers,
-- queue_workers (live workers that consume the queue), paused, dead_total: dead
-- letters so far, schedule_late (seconds an enabled schedule's next tick is overdue;
-- the schedule's name in state), finished: messages finished so far by actor and
-- outcome (completed, retried, failed in state; migration 0018)).  actor_name is
-- NULL but for finished.
SELECT 'messages' AS kind, queue_name,
       CASE WHEN state = 'processing' THEN 'processing'
            WHEN next_attempt_at <= now() THEN 'due' ELSE 'delayed' END AS state,
       count(*)::float8 AS value, NULL::text AS actor_name
  FROM {schema}.messages GROUP BY 2, 3
UNION ALL
SELECT 'oldest', queue_name, NULL,
       coalesce(extract(epoch FROM now() - min(next_attempt_at)
                FILTER (WHERE state = 'pending' AND next_attempt_at <= now())), 0)::float8, NULL
  FROM {schema}.messages GROUP BY 2
UNION ALL
SELECT 'running', queue_name, NULL,
       extract(epoch FROM now() - min(acquired_at))::float8, NULL
  FROM {schema}.messages WHERE state = 'processing' GROUP BY 2
UNION ALL
SELECT 'dead', queue_name, NULL, count(*)::float8, NULL
  FROM {schema}.history WHERE state = 'failed' AND finished_at > now() - interval '1 hour' GROUP BY 2
UNION ALL
SELECT 'workers', NULL, NULL, count(*)::float8, NULL
  FROM {schema}.workers AS w WHERE {worker_alive}
UNION ALL
SELECT 'queue_workers', q.queue_name, NULL, count(*)::float8, NULL
  FROM {schema}.workers AS w, unnest(w.queues) AS q(queue_name) WHERE {worker_alive} GROUP BY 2
UNION ALL
SELECT 'schedule_late', queue_name, name,
       greatest(extract(epoch FROM now() - next_run_at), 0)::float8, NULL
  FROM {schema}.schedules WHERE disabled_at IS NULL AND removed_at IS NULL
UNION ALL
SELECT 'paused', queue_name, NULL, 1::float8, NULL
  FROM {schema}.queue_pauses
UNION ALL
SELECT 'dead_total', queue_name, NULL, sum(n)::float8, NULL
  FROM {schema}.dead_letter_counts GROUP BY 2
UNION ALL
SELECT 'finished', queue_name, state, sum(n)::float8, actor_name
  FROM {schema}.finished_counts GROUP BY 2, 3, 5;

-- name: ping --
-- Whether a server answers (the test servers' readiness probe).
SELECT 1;

-- name: create_database --
CREATE DATABASE {database};

-- name: drop_database --
DROP DATABASE IF EXISTS {database} WITH (FORCE);

-- The audit trail (migration 0017): operator actions from the dashboard and the CLI.

-- name: audit_record --
-- One operator action, after it committed (count: rows it changed).
INSERT INTO {schema}.audit (operator, source, action, target, count, detail)
VALUES (%(operator)s, %(source)s, %(action)s, %(target)s, %(count)s, %(detail)s);

-- name: audit_list --
-- The newest actions first (the Audit page, `dramatiq-pg-outbox audit`).
SELECT id, at, operator, source, action, target, count, detail
  FROM {schema}.audit
 ORDER BY id DESC
 LIMIT %(limit)s;

-- Streaming replication: the test servers' standbys (testing/throwaway.py) and the readers
-- of a read_url (the dashboard, status, the metrics exporter, the Spark history reader).

-- name: wal_position --
-- On a primary: its current WAL write position, and how many bytes of WAL lie between
-- it and a standby's replay position (NULL when none is given).  Raises
-- ObjectNotInPrerequisiteState on a server in recovery.
SELECT pg_current_wal_lsn()::text AS lsn,
       pg_wal_lsn_diff(pg_current_wal_lsn(), %(replay_lsn)s::pg_lsn)::float8 AS behind_bytes;

-- name: replica_position --
-- Where a server's data stands: in recovery (a standby) or not, the WAL position replayed
-- and the commit time of the last transaction replayed (both NULL on a primary, and the
-- time NULL on a standby that has replayed no commit yet), whether replay is paused, and
-- the server's clock.
SELECT pg_is_in_recovery() AS in_recovery,
       pg_last_wal_replay_lsn()::text AS replay_lsn,
       pg_last_xact_replay_timestamp() AS replayed_at,
       CASE WHEN pg_is_in_recovery() THEN pg_is_wal_replay_paused() ELSE false END AS paused,
       now() AS now;

-- name: replayed_up_to --
-- On a standby: whether it has replayed the WAL up to a position of its primary.
SELECT coalesce(pg_last_wal_replay_lsn() >= %(lsn)s::pg_lsn, false);

-- name: sync_state --
-- On a primary: how a standby (by its application_name) replicates: sync, async, potential,
-- quorum; no row while it is not connected.
SELECT sync_state FROM pg_stat_replication WHERE application_name = %(name)s;

-- name: pause_replay --
SELECT pg_wal_replay_pause();

-- name: resume_replay --
SELECT pg_wal_replay_resume();
