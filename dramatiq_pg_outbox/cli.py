"""``dramatiq-pg-outbox``: the operators' command line.

Subcommands::

    migrate       create or upgrade the tables (alembic); --sql prints the SQL instead
    status        messages per queue and state, live workers
    failed        the newest dead letters with their errors
    retry-failed  put dead letters back on their queue (fresh attempts)
    prune         delete history rows older than a given age

The database URL comes from ``--url`` or ``$DATABASE_URL``; the schema from
``--schema`` (default ``dramatiq``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import psycopg

from .migrations import DEFAULT_SCHEMA, libpq_url, quote_ident, upgrade, upgrade_sql


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dramatiq-pg-outbox", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", default=os.environ.get("DATABASE_URL"), help="PostgreSQL URL ($DATABASE_URL)"
    )
    common.add_argument("--schema", default=DEFAULT_SCHEMA, help="schema of the tables (default: dramatiq)")
    sub = parser.add_subparsers(dest="command", required=True)
    migrate = sub.add_parser("migrate", parents=[common], help="create or upgrade the tables")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    sub.add_parser("status", parents=[common], help="messages per queue and state, live workers")
    failed = sub.add_parser("failed", parents=[common], help="newest dead letters")
    failed.add_argument("--queue", help="only this queue")
    failed.add_argument("--limit", type=int, default=20, help="rows to show (default: 20)")
    retry = sub.add_parser("retry-failed", parents=[common], help="re-enqueue dead letters")
    retry.add_argument("--queue", help="only this queue")
    retry.add_argument(
        "--id", type=int, action="append", dest="ids", help="only this history id (repeatable)"
    )
    prune = sub.add_parser("prune", parents=[common], help="delete old history rows")
    prune.add_argument("--older-than", type=float, required=True, metavar="DAYS", help="age in days")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dramatiq-pg-outbox`` console script.  Returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "migrate" and args.sql:
        upgrade_sql(args.schema, args.revision)
        return 0
    if not args.url:
        print("error: no database URL: pass --url or set DATABASE_URL", file=sys.stderr)
        return 2
    if args.command == "migrate":
        upgrade(args.url, schema=args.schema, revision=args.revision)
        print(f"schema {args.schema!r} is at revision {args.revision}")
        return 0
    s = quote_ident(args.schema)
    with psycopg.connect(libpq_url(args.url), autocommit=True) as conn:
        handler = {"status": _status, "failed": _failed, "retry-failed": _retry_failed, "prune": _prune}
        return handler[args.command](conn, s, args)


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[str(h) for h in header]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _status(conn: psycopg.Connection[Any], s: str, args: argparse.Namespace) -> int:
    rows = conn.execute(
        f"SELECT queue_name, state, count(*), count(*) FILTER (WHERE next_attempt_at > now()) AS delayed, "  # noqa: S608
        f"min(enqueued_at) FROM {s}.messages GROUP BY 1, 2 ORDER BY 1, 2"
    ).fetchall()
    _table(rows, ["queue", "state", "messages", "delayed", "oldest"])
    workers = conn.execute(
        f"SELECT hostname, pid, queues, now() - heartbeat_at FROM {s}.workers ORDER BY hostname, pid"  # noqa: S608
    ).fetchall()
    print()
    _table(workers, ["host", "pid", "queues", "since heartbeat"])
    return 0


def _failed(conn: psycopg.Connection[Any], s: str, args: argparse.Namespace) -> int:
    rows = conn.execute(
        f"SELECT id, queue_name, actor_name, message_id, attempts, finished_at, error_type, "  # noqa: S608
        f"split_part(error, E'\\n', 1) FROM {s}.history WHERE state = 'failed' "
        f"AND (%(queue)s::text IS NULL OR queue_name = %(queue)s) ORDER BY finished_at DESC LIMIT %(limit)s",
        {"queue": args.queue, "limit": args.limit},
    ).fetchall()
    _table(rows, ["id", "queue", "actor", "message_id", "attempts", "finished", "error", "first line"])
    return 0


def _retry_failed(conn: psycopg.Connection[Any], s: str, args: argparse.Namespace) -> int:
    row = conn.execute(
        f"""WITH moved AS (
                DELETE FROM {s}.history
                WHERE state = 'failed'
                  AND (%(queue)s::text IS NULL OR queue_name = %(queue)s)
                  AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
                RETURNING queue_name, actor_name, message_id, payload, idempotency_key
            ), inserted AS (
                INSERT INTO {s}.messages (queue_name, actor_name, message_id, payload, idempotency_key)
                SELECT queue_name, actor_name, message_id, payload, idempotency_key FROM moved RETURNING 1
            ) SELECT count(*) FROM inserted""",  # noqa: S608
        {"queue": args.queue, "ids": args.ids},
    ).fetchone()
    print(f"re-enqueued {row[0] if row else 0} failed message(s)")
    return 0


def _prune(conn: psycopg.Connection[Any], s: str, args: argparse.Namespace) -> int:
    cur = conn.execute(
        f"DELETE FROM {s}.history WHERE finished_at < now() - %(days)s * interval '1 day'",  # noqa: S608
        {"days": args.older_than},
    )
    print(f"deleted {cur.rowcount} history row(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
