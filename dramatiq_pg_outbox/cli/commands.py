"""The subcommands that read and repair the broker's tables: migrate, status, failed, retry-failed,
prune, maintain, metrics, relay."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from dramatiq.common import dq_name, q_name

from ..formats import exception_line, format_age, format_time
from ..migrations import VERSION_TABLE, script_location, upgrade, upgrade_sql
from ..names import channel_for
from ..store.admin import AdminStore, read_lag
from ..urls import mask_password
from .common import (
    EXIT_ATTENTION,
    EXIT_USAGE,
    MIN_ERROR_WIDTH,
    PROG,
    URL_ENV_VAR,
    CliError,
    checked_connection,
    clip,
    database_from,
    format_queue_list,
    open_connection,
    open_read_connection,
    print_json,
    print_table,
    read_database_from,
    record_action,
    selection_text,
    server_down,
)


def migrate_command(args: argparse.Namespace) -> int:
    if args.sql:
        return _migration_sql(args)
    db = database_from(args)
    with open_connection(db) as conn:
        before = _applied_revisions(conn, args.schema)
        if before is None:
            if AdminStore(args.schema).table_exists(conn, table="messages"):
                raise CliError(
                    f"schema {args.schema!r} already holds the tables, but not our version table "
                    f"{VERSION_TABLE}: your application's alembic history manages them; "
                    "run `alembic upgrade heads` there instead"
                )
        with _migration_progress():
            upgrade(db.conninfo, schema=args.schema, revision=args.revision)
        after = _applied_revisions(conn, args.schema) or []
    from alembic.script import ScriptDirectory

    heads = set(ScriptDirectory(script_location()).get_heads())
    reached = ", ".join(after) or "base"
    head = " (head)" if after and set(after) == heads else ""
    if not before:
        change = "created" if after else "nothing to do"
    elif before == after:
        change = "already current" if args.revision == "head" else f"already at or past {args.revision}"
    else:
        change = f"upgraded from {', '.join(before)}"
    print(f"schema {args.schema!r} is at revision {reached}{head}, {change}")
    return 0


def _migration_sql(args: argparse.Namespace) -> int:
    """``migrate --sql``: the SQL from the database's revision when a URL is given, else from base."""
    start = None
    db = database_from(args) if args.url is not None or os.environ.get(URL_ENV_VAR) else None
    try:
        conn = open_connection(db) if db is not None else None
    except CliError as e:
        # Unreachable: the SQL of the whole history, as without a URL (said on stderr).
        print(f"{PROG} migrate: warning: {e.message}; printing the SQL from an empty schema", file=sys.stderr)
        conn = None
    if conn is not None:
        with conn:
            applied = _applied_revisions(conn, args.schema)
            if applied is None and AdminStore(args.schema).table_exists(conn, table="messages"):
                raise CliError(
                    f"schema {args.schema!r} holds the tables but not our version table {VERSION_TABLE}: "
                    "your application's alembic history manages them; run `alembic upgrade heads "
                    "--sql` there instead"
                )
        if applied and len(applied) > 1:
            raise CliError(f"schema {args.schema!r} is at several revisions ({', '.join(applied)})")
        start = applied[0] if applied else None
        print(
            f"-- {PROG} migrate --sql: from revision {start or 'base'}, the database's (schema {args.schema})"
        )
    elif db is not None:
        print(f"-- {PROG} migrate --sql: from an empty schema (the database could not be reached)")
    else:
        print(
            f"-- {PROG} migrate --sql: from an empty schema (pass --url to start at the database's revision)"
        )
    upgrade_sql(args.schema, args.revision, start)
    return 0


@contextmanager
def _migration_progress() -> Iterator[None]:
    """Print what a long migration step will do, then its progress (logger dramatiq_pg_outbox.migrations)."""
    logger = logging.getLogger("dramatiq_pg_outbox.migrations")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _applied_revisions(conn: psycopg.Connection[Any], schema: str) -> list[str] | None:
    """Revisions recorded in our version table, or ``None`` if it does not exist."""
    store = AdminStore(schema)
    if not store.table_exists(conn, table=VERSION_TABLE):
        return None
    return store.applied_revisions(conn, version_table=VERSION_TABLE)


def attention(conn: psycopg.Connection[Any], store: AdminStore, heartbeat_timeout_ms: int) -> list[str]:
    """What needs an operator's attention, one line each (``status --check``).

    The queue conditions come from the statement of the Prometheus exporter and mirror the
    example alerting rules (docs/prometheus-alerts.yml), paused queues exempt: dead letters
    in the last hour; due messages in a queue that no live worker consumes.  A schedule is
    late as the ``schedules`` command says: its next tick is overdue by more than its grace.
    """
    from ..store.periodic import PeriodicStore

    due: dict[str, float] = {}
    dead: dict[str, float] = {}
    consumed: set[str] = set()
    paused: set[str] = set()
    for gauge in store.metrics_gauges(conn, heartbeat_timeout_ms=heartbeat_timeout_ms):
        queue = q_name(str(gauge.queue_name))
        if gauge.kind == "messages" and gauge.state == "due":
            due[queue] = due.get(queue, 0) + gauge.value
        elif gauge.kind == "dead":
            dead[queue] = dead.get(queue, 0) + gauge.value
        elif gauge.kind == "queue_workers" and gauge.value > 0:
            consumed.add(queue)
        elif gauge.kind == "paused":
            paused.add(queue)
    found = [
        f"queue {queue!r}: {int(n)} dead letter(s) in the last hour (see: {PROG} failed --queue {queue})"
        for queue, n in sorted(dead.items())
        if queue not in paused
    ]
    found += [
        f"queue {queue!r}: {int(n)} due message(s) and no live worker consumes it"
        for queue, n in sorted(due.items())
        if queue not in paused and queue not in consumed
    ]
    found += [
        f"schedule {row.name!r}: its tick is {format_age(row.late_s)} overdue: is a scheduler running?"
        for row in PeriodicStore(store.schema).list_schedules(conn)
        if row.removed_s is None and row.disabled_at is None and row.late_s * 1000 > row.grace_ms
    ]
    return found


def status_command(args: argparse.Namespace) -> int:
    """``status``: every figure read on ``--read-url``'s server when given (then its lag is shown
    first, and in the JSON as ``read_lag``), else on ``--url``'s."""
    read_db = read_database_from(args)
    with checked_connection(args) as (conn, store, db), contextlib.ExitStack() as stack:
        reads = conn
        if read_db is not None:
            reads = stack.enter_context(open_read_connection(read_db, args.schema, db))
        messages = store.status_messages(reads)
        failed = store.status_failed(reads)
        workers = store.status_workers(reads)
        paused = [p for p in store.paused_queues(reads) if p.queue_name == q_name(p.queue_name)]
        needs = attention(reads, store, args.heartbeat_timeout) if args.check else []
        # After the reads: the lag is never understated for what they showed.
        lag = read_lag(reads, conn) if read_db is not None else None
    if args.check and not args.json:
        if lag is not None:
            print(lag.describe())
        for line in needs:
            print(line)
        if not needs:
            print(f"ok: nothing needs attention in schema {args.schema!r}")
        return EXIT_ATTENTION if needs else 0
    if args.json:
        print_json(
            {
                "schema": args.schema,
                **({"read_lag": lag.as_json()} if lag is not None else {}),
                **({"attention": needs} if args.check else {}),
                "messages": [
                    {
                        "queue": m.queue_name,
                        "state": m.state,
                        "messages": m.messages,
                        "delayed": m.delayed,
                        "oldest_seconds": m.oldest_s,
                    }
                    for m in messages
                ],
                "dead_letters": [
                    {
                        "queue": f.queue_name,
                        "failed_last_hour": f.last_hour,
                        "failed_in_history": f.in_history,
                    }
                    for f in failed
                ],
                "paused": [{"queue": p.queue_name, "paused_at": p.paused_at} for p in paused],
                "workers": [_worker_json(w, args.heartbeat_timeout) for w in workers],
            }
        )
        return EXIT_ATTENTION if needs else 0
    if lag is not None:
        print(lag.describe())
        print()
    if messages:
        print_table(
            [(m.queue_name, m.state, m.messages, m.delayed, format_age(m.oldest_s)) for m in messages],
            ["queue", "state", "messages", "delayed", "oldest"],
            numeric=(2, 3, 4),
        )
    else:
        print(f"no messages waiting or running in schema {args.schema!r}")
    print()
    if failed:
        print_table(
            [(f.queue_name, f.last_hour, f.in_history) for f in failed],
            ["queue", "failed last hour", "failed in history"],
            numeric=(1, 2),
        )
    else:
        print("no dead letters")
    print()
    if paused:
        since = ", ".join(f"{p.queue_name} (since {format_time(p.paused_at)})" for p in paused)
        print(f"paused: {since}")
        print()
    if workers:
        print_table(
            [
                (w.hostname, w.pid, format_queue_list(w.queues), f"{format_age(w.heartbeat_age_s)} ago")
                for w in workers
            ],
            ["host", "pid", "queues", "last heartbeat"],
            numeric=(1, 3),
        )
    else:
        print("no workers")
    return 0


def _worker_json(worker: Any, heartbeat_timeout_ms: int) -> dict[str, Any]:
    return {
        "host": worker.hostname,
        "pid": worker.pid,
        "queues": list(worker.queues),
        "heartbeat_age_seconds": worker.heartbeat_age_s,
        "live": worker.heartbeat_age_s * 1000 < heartbeat_timeout_ms,
    }


def workers_command(args: argparse.Namespace) -> int:
    with checked_connection(args) as (conn, store, _):
        workers = store.status_workers(conn)
    if args.json:
        print_json(
            {"schema": args.schema, "workers": [_worker_json(w, args.heartbeat_timeout) for w in workers]}
        )
        return 0
    if not workers:
        print(f"no workers in schema {args.schema!r}")
        return 0
    print_table(
        [
            (
                w.hostname,
                w.pid,
                format_queue_list(w.queues),
                f"{format_age(w.heartbeat_age_s)} ago",
                "live" if w.heartbeat_age_s * 1000 < args.heartbeat_timeout else "silent: counted dead",
            )
            for w in workers
        ],
        ["host", "pid", "queues", "last heartbeat", "status"],
        numeric=(1,),
    )
    return 0


def pause_command(args: argparse.Namespace) -> int:
    names = _queue_names(args.queues)
    with checked_connection(args) as (conn, store, _):
        if not args.create:
            known = set(store.known_queues(conn, queue_names=args.queues))
            unknown = [queue for queue in args.queues if queue not in known]
            if unknown:
                raise CliError(
                    f"no message, worker or schedule has named queue {', '.join(map(repr, unknown))} in "
                    f"schema {args.schema!r} (a typo?); to pause it before its first message, add --create",
                    EXIT_USAGE,
                )
        paused = store.pause_queues(conn, queue_names=names)
        for queue in args.queues:
            record_action(conn, args.schema, action="pause", target=queue, count=int(queue in paused))
    _say_each(
        args.queues,
        paused,
        "paused queue {!r}: workers stop claiming it at their next claim; sends still store",
        "queue {!r} was already paused",
    )
    return 0


def resume_command(args: argparse.Namespace) -> int:
    names = _queue_names(args.queues)
    with checked_connection(args) as (conn, store, _):
        resumed = store.resume_queues(conn, queue_names=names, channel=channel_for(args.schema))
        for queue in args.queues:
            record_action(conn, args.schema, action="resume", target=queue, count=int(queue in resumed))
    _say_each(args.queues, resumed, "resumed queue {!r}: its workers were woken", "queue {!r} was not paused")
    return 0


def _say_each(queues: list[str], changed_queues: list[str], changed: str, unchanged: str) -> None:
    """One line per queue: ``changed`` if the statement returned it, else ``unchanged``."""
    returned = set(changed_queues)
    for queue in queues:
        print((changed if queue in returned else unchanged).format(queue))


def _queue_names(queues: list[str]) -> list[str]:
    """Each queue and its delay queue (both are paused and resumed together)."""
    for queue in queues:
        if queue != q_name(queue):
            raise CliError(f"{queue!r} is a delay queue: pause or resume {q_name(queue)!r}", EXIT_USAGE)
    return [name for queue in queues for name in (queue, dq_name(queue))]


def metrics_command(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise CliError(
            "the metrics command needs prometheus_client: pip install 'dramatiq-pg-outbox[metrics]'"
        ) from None
    import signal
    import threading

    from ..metrics import PREFIX, DatabaseCollector

    db = database_from(args)
    read_db = read_database_from(args)
    try:
        with checked_connection(args):
            pass  # the server, the credentials and the schema are fine: serve
    except CliError as e:
        if not server_down(e.__cause__):
            raise  # a rejection or a schema to migrate: waiting cannot fix it
        # Down at start, as a database can be at any scrape: serve database_up 0 until it answers.
        down = "the lag is measured without it" if read_db else f"serving {PREFIX}_database_up 0"
        print(f"{PROG} metrics: warning: {e.message}; {down} until it answers", file=sys.stderr, flush=True)
    if read_db is not None:
        try:
            open_read_connection(read_db, args.schema, db).close()
        except CliError as e:
            if not server_down(e.__cause__):
                raise
            print(
                f"{PROG} metrics: warning: {e.message}; serving {PREFIX}_database_up 0 until it answers",
                file=sys.stderr,
                flush=True,
            )
    collector = DatabaseCollector(
        db.conninfo,
        args.schema,
        cache_seconds=args.cache_seconds,
        heartbeat_timeout=args.heartbeat_timeout,
        read_url=None if read_db is None else read_db.conninfo,
    )
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        server, thread = start_http_server(args.port, args.host, registry)
    except OSError as e:
        raise CliError(
            f"cannot listen on {args.host}:{args.port}: {e.strerror or e}. Choose another --port"
        ) from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    reads = "" if read_db is None else f", read from {read_db.shown}"
    print(
        f"metrics of {db.shown} schema {args.schema!r}{reads} on http://{args.host}:{args.port}/metrics "
        f"(cached {args.cache_seconds:g} s)",
        flush=True,
    )
    try:
        while not stop.wait(1):
            pass
    finally:
        server.shutdown()
        thread.join(5)
        collector.close()
    return 0


def relay_command(args: argparse.Namespace) -> int:
    import logging
    import signal

    from ..broker import PostgresBroker
    from ..names import validate_queue_name
    from ..relay import Relay, TargetUnusable, check_target, target_broker

    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    try:
        queues = [validate_queue_name(q) for q in queues]
    except ValueError as e:
        raise CliError(f"--queues: {e}", EXIT_USAGE) from None
    if not queues:
        raise CliError("--queues names no queue", EXIT_USAGE)
    try:
        target = target_broker(args.to)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except ImportError as e:
        extra = "rabbitmq" if args.to.lower().startswith("amqp") else "redis"
        raise CliError(f"the relay to {extra} needs {e.name}: pip install 'dramatiq[{extra}]'") from None
    with checked_connection(args):
        pass  # the server, the credentials and the schema are fine
    db = database_from(args)
    try:
        check_target(target, mask_password(args.to))
    except TargetUnusable as e:
        raise CliError(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Alembic logs its plugin set-up at INFO when first imported: not the relay's business.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        broker = PostgresBroker(
            url=args.url or os.environ[URL_ENV_VAR],
            schema=args.schema,
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
        )
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    relay = Relay(broker, target, queues, batch_size=args.batch_size)
    server = None
    if args.metrics_port is not None:
        server = _serve_relay_metrics(relay, args.metrics_host, args.metrics_port)
    signal.signal(signal.SIGTERM, lambda *_: relay.stop())
    print(
        f"relaying {', '.join(queues)} of {db.shown} schema {args.schema!r} to {mask_password(args.to)}",
        flush=True,
    )
    try:
        relay.run(report_every=args.report_every)
    except TargetUnusable as e:
        raise CliError(str(e)) from None
    finally:
        if server is not None:
            server.shutdown()
        broker.close()
        target.close()
    print(f"relayed {relay.stats.relayed} message(s)", flush=True)
    return 0


def _serve_relay_metrics(relay: Any, host: str, port: int) -> Any:
    """Serve :class:`~dramatiq_pg_outbox.relay.RelayCollector` over HTTP; the server (``shutdown()``)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise CliError(
            "--metrics-port needs prometheus_client: pip install 'dramatiq-pg-outbox[metrics]'"
        ) from None
    from ..relay import RelayCollector

    registry = CollectorRegistry()
    registry.register(RelayCollector(relay))
    try:
        server, _ = start_http_server(port, host, registry)
    except OSError as e:
        raise CliError(
            f"cannot listen on {host}:{port}: {e.strerror or e}. Choose another --metrics-port"
        ) from None
    return server


def failed_command(args: argparse.Namespace) -> int:
    with checked_connection(args) as (conn, store, _):
        rows = store.failed_list(conn, queue=args.queue, limit=args.limit)
    if args.json:
        print_json(
            [
                {
                    "id": row.id,
                    "queue": row.queue_name,
                    "actor": row.actor_name,
                    "attempts": row.attempts,
                    "finished_at": row.finished_at,
                    "error_type": row.error_type,
                    "error": row.error,
                }
                for row in rows
            ]
        )
        return 0
    if not rows:
        only = f" of queue {args.queue!r}" if args.queue else ""
        print(f"no dead letters{only} in schema {args.schema!r}")
        return 0
    table = [
        (
            row.id,
            row.queue_name,
            row.actor_name,
            row.attempts,
            format_time(row.finished_at),
            exception_line(row.error_type, row.error),
        )
        for row in rows
    ]
    header = ["id", "queue", "actor", "attempts", "finished", "error"]
    used = sum(max(len(str(r[i])) for r in [header, *table]) + 2 for i in range(len(header) - 1))
    width = max(MIN_ERROR_WIDTH, shutil.get_terminal_size((120, 24)).columns - used)
    print_table([(*line[:-1], clip(line[-1], width)) for line in table], header, numeric=(0, 3))
    return 0


def retry_failed_command(args: argparse.Namespace) -> int:
    # The dashboard's Retry runs the same statement: back on the queue, due now, workers woken.
    # --dry-run runs it too, in a transaction rolled back (and without its NOTIFY): the same
    # selection, nothing changed.
    with checked_connection(args) as (conn, store, db):
        with conn.transaction(force_rollback=args.dry_run):
            rows = store.retry_failed(
                conn,
                ids=args.ids,
                queue_name=args.queue,
                actor_name=args.actor,
                error_type=None,
                search=None,
                limit=args.limit,
                notify=not args.dry_run,
                channel=channel_for(args.schema),
            )
        count = sum(int(row.moved) for row in rows)
        if not args.dry_run:
            target = ", ".join(map(str, args.ids)) if args.ids else selection_text(args)
            record_action(conn, args.schema, action="retry", target=target, count=count)
    moved = {int(i) for row in rows for i in row.ids}
    if args.dry_run:
        per_queue = ", ".join(f"{row.queue_name}: {row.moved}" for row in rows)
        print(f"would re-enqueue {count} failed message(s)" + (f" ({per_queue})" if per_queue else ""))
        print("dry run: nothing changed")
    else:
        print(f"re-enqueued {count} failed message(s)")
    missing = sorted(set(args.ids or ()) - moved)
    if missing and not (args.limit is not None and count >= args.limit):
        only = f" of queue {args.queue!r}" if args.queue else ""
        raise CliError(
            f"no dead letter{only} with id {', '.join(map(str, missing))} in schema {args.schema!r}. "
            f"List them with: {PROG} failed --schema {args.schema} --url {db.command_url()}"
        )
    return 0


def audit_command(args: argparse.Namespace) -> int:
    with checked_connection(args) as (conn, store, _):
        rows = store.audit(conn, limit=args.limit)
    if args.json:
        print_json({"schema": args.schema, "audit": [dataclasses.asdict(row) for row in rows]})
        return 0
    if not rows:
        print(f"no operator action recorded in schema {args.schema!r}")
        return 0
    print_table(
        [(format_time(r.at), r.operator, r.source, r.action, r.target, r.count) for r in rows],
        ["at", "operator", "from", "action", "target", "rows"],
        numeric=(5,),
    )
    return 0


def prune_command(args: argparse.Namespace) -> int:
    from ..partitions import prune

    with checked_connection(args) as (conn, _, _):
        result = prune(
            conn, args.schema, args.older_than, lock_timeout=args.lock_timeout, dry_run=args.dry_run
        )
    age = format_age(args.older_than.total_seconds())
    days = f" ({result.dropped[0].day} to {result.dropped[-1].day})" if result.dropped else ""
    would = "would drop" if args.dry_run else "dropped"
    deleted = "would delete" if args.dry_run else "deleted"
    print(
        f"{would} {len(result.dropped)} day partition(s){days} of about {result.dropped_rows} row(s), "
        f"{deleted} {result.deleted} history row(s) older than {age}, "
        f"{'would free' if args.dry_run else 'freed'} {result.freed_keys} idempotency key(s)"
        + (" (dry run: nothing changed)" if args.dry_run else "")
    )
    if result.kept:
        raise CliError(
            f"{len(result.kept)} partition(s) older than {age} were kept: their lock was not granted within "
            f"{args.lock_timeout} ms (a long query on history?). Run the same prune again later"
        )
    return 0


def maintain_command(args: argparse.Namespace) -> int:
    from ..partitions import create_partitions, day_partitions

    with checked_connection(args) as (conn, store, _):
        created = create_partitions(conn, args.schema, args.days_ahead)
        parts = day_partitions(conn, args.schema)
        in_default = store.default_partition_rows(conn)
    span = f"from {parts[0].day} to {parts[-1].day}" if parts else "none"
    print(
        f"created {created} history partition(s); {len(parts)} day partition(s) {span}; "
        f"{in_default} row(s) in history_default"
    )
    return 0
