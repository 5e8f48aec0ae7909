"""``dramatiq-pg-outbox scheduler`` and ``schedules``: run and list the periodic jobs."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
from typing import Any

import dramatiq.broker as _dramatiq_broker
import psycopg
from dramatiq.errors import BrokerConnectionError

from ..broker import PostgresBroker
from ..formats import format_age, format_time
from ..periodic import (
    Periodic,
    Scheduler,
)
from ..store.periodic import PeriodicStore, ScheduleListRow
from .common import (
    EXIT_USAGE,
    CliError,
    Database,
    checked_connection,
    common_options,
    database_from,
    one_line,
    open_connection,
    print_json,
    print_table,
)

# -- the command line: ``scheduler`` and ``schedules`` ------------------------------------

#: A URL in an error message (``scheme://...``), to mask its password.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def add_parser(sub: Any) -> None:
    """Register the ``scheduler`` and ``schedules`` subcommands (see ``cli.main._parser``)."""

    scheduler = sub.add_parser(
        "scheduler",
        parents=[common_options()],
        help="enqueue an application's periodic jobs (run any number of them)",
        description="Enqueue the ticks of the schedules of an application (@periodic on its actors, "
        "Periodic(schedules=...) on its broker), each exactly once however many schedulers run, "
        "until SIGTERM or Ctrl-C. The database is the application's broker's; --url and --schema, "
        "if given, must name the same.",
    )
    scheduler.add_argument(
        "--app",
        required=True,
        metavar="MODULE[:BROKER]",
        help="module that sets up the broker and imports the actors (as for the dramatiq command); "
        "BROKER: the module attribute holding the broker (default: the global broker)",
    )
    scheduler.set_defaults(run=run_scheduler, schema=None)
    schedules = sub.add_parser(
        "schedules", parents=[common_options()], help="periodic jobs with their last and next run"
    )
    schedules.add_argument("--json", action="store_true", help="print JSON instead of a table")
    schedules.add_argument(
        "action",
        nargs="?",
        choices=("enable", "disable", "run-now"),
        help="enable or disable the schedule NAME, or make its next tick due now (as the dashboard's "
        "buttons); without: list them",
    )
    schedules.add_argument("name", nargs="?", metavar="NAME", help="the schedule to act on")
    schedules.add_argument(
        "--dry-run", action="store_true", help="with an action: say what it would change, change nothing"
    )
    schedules.set_defaults(run=run_schedules)


def run_scheduler(args: argparse.Namespace) -> int:
    """``dramatiq-pg-outbox scheduler --app MODULE[:BROKER]``: schedule until SIGTERM (exit 0) or Ctrl-C.

    The database and the schema are checked with one direct connection before
    the broker's pool is used, so that an unreachable server, refused
    credentials or a missing or old schema are one line (as for every
    subcommand); logging is configured only once the scheduler has synced.
    """
    from ..migrations import check_schema

    given = database_from(args) if args.url is not None else None
    broker, middleware = _load_app(args.app)
    try:
        if given is not None and given.conninfo != broker.conninfo:
            raise CliError(
                f"--url names another database than the broker of --app {args.app} ({broker.safe_url}): "
                "the scheduler writes where the application's broker does; drop --url",
                EXIT_USAGE,
            )
        if args.schema is not None and args.schema != broker.schema:
            raise CliError(
                f"--schema {args.schema} is not the schema of the broker of --app {args.app} "
                f"({broker.schema!r}); drop --schema",
                EXIT_USAGE,
            )
        db = given or _broker_database(broker, args.app)
        with open_connection(db) as conn:
            check_schema(conn, broker.schema, url=db.shown, fix_url=db.fix_url)
        try:
            if middleware is not None:
                scheduler = Scheduler(broker, middleware.schedules, **middleware.options)
            else:
                scheduler = Scheduler(broker)
        except ValueError as e:
            raise CliError(f"{e} (in --app {args.app})") from e
        try:
            scheduler.sync(define=True)
        except BrokerConnectionError as e:
            raise CliError(
                f"cannot reach PostgreSQL at {broker.safe_url}: {e}. Check that it runs and the URL of "
                "the application's broker"
            ) from e
        if not logging.getLogger().handlers:
            logging.basicConfig(
                level=logging.INFO,
                format="[%(asctime)s] [PID %(process)d] [%(threadName)s] [%(name)s] [%(levelname)s] "
                "%(message)s",
            )
        print(
            f"scheduling {len(scheduler.schedules)} schedule(s) of {args.app} in schema "
            f"{broker.schema!r} of {broker.safe_url}: {', '.join(scheduler.schedules) or 'none'}",
            flush=True,
        )
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: scheduler.request_stop())
        try:
            scheduler.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        broker.close()
    return 0


def _broker_database(broker: PostgresBroker, app: str) -> Database:
    """The CLI's view (``cli.common._Database``) of the database of the broker of ``--app``."""
    import shlex

    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(broker.conninfo)
    except psycopg.ProgrammingError as e:
        raise CliError(
            f"cannot use the database URL of the broker of --app {app} ({broker.safe_url}): {one_line(e)}. "
            "Fix the application's configuration"
        ) from None
    return Database(broker.conninfo, broker.safe_url, shlex.quote(broker.safe_url), params)


def _load_app(spec: str) -> tuple[PostgresBroker, Periodic | None]:
    """(broker, its Periodic middleware or None) of ``--app MODULE[:BROKER]``.

    Raises:
      CliError: If the module cannot be imported, raises while it is imported, or holds no
        PostgresBroker.
    """
    from ..urls import mask_password

    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CliError(
            f"cannot import --app {spec}: {e}. Run from the directory that holds it, or set PYTHONPATH",
            EXIT_USAGE,
        ) from e
    except Exception as e:
        # The application's own code failed (a bad URL or option of its broker, a missing
        # environment variable...): its message, with any URL's password masked.
        text = _URL_IN_TEXT.sub(lambda found: mask_password(found.group(0)), one_line(e))
        raise CliError(
            f"--app {spec} failed while it was imported: {type(e).__name__}: {text}. "
            "Fix the application's configuration (--debug shows where it failed)"
        ) from e
    if attribute:
        broker = getattr(module, attribute, None)
        where = f"{module_name}.{attribute}"
    else:
        broker = _dramatiq_broker.global_broker
        where = f"the global broker after importing {module_name} (dramatiq.set_broker)"
    if not isinstance(broker, PostgresBroker):
        found = "nothing" if broker is None else f"a {type(broker).__name__}"
        raise CliError(
            f"--app {spec}: {where} is {found}, not a PostgresBroker; point --app at the module that "
            "creates it (MODULE:ATTRIBUTE to name it)",
            EXIT_USAGE,
        )
    middleware = next((m for m in broker.middleware if isinstance(m, Periodic)), None)
    return broker, middleware


def run_schedules(args: argparse.Namespace) -> int:
    """``dramatiq-pg-outbox schedules``: one table, active schedules first; or act on one."""
    if args.action is not None:
        return _schedule_action(args)
    with checked_connection(args) as (conn, _store, _db):
        rows = PeriodicStore(args.schema).list_schedules(conn)
    if args.json:
        print_json({"schema": args.schema, "schedules": [_schedule_json(row) for row in rows]})
        return 0
    if not rows:
        print(f"no schedules in schema {args.schema!r}: declare them with @periodic and run a scheduler")
        return 0
    table = []
    for row in rows:
        if row.removed_s is not None:
            status = f"removed {format_age(row.removed_s)} ago"
        elif row.disabled_at is not None:
            status = f"disabled since {format_time(row.disabled_at)} (enable it in the dashboard)"
        elif _late(row):
            status = f"late {format_age(row.late_s)}: is a scheduler running?"
        else:
            status = "ok"
        table.append(
            (
                row.name,
                row.actor_name,
                row.queue_name,
                row.cron if row.cron is not None else f"every {row.every_ms} ms",
                row.tz,
                row.missed,
                format_time(row.last_run_at),
                "" if row.removed_s is not None else format_time(row.next_run_at),
                row.runs,
                row.missed_ticks,
                status,
            )
        )
    header = ["name", "actor", "queue", "schedule", "tz", "if missed", "last run", "next run"]
    print_table(table, [*header, "runs", "missed ticks", "status"], numeric=(8, 9))
    return 0


def _schedule_action(args: argparse.Namespace) -> int:
    """``schedules enable|disable|run-now NAME [--dry-run]``: the dashboard's statements (``cli.actions``)."""
    from .actions import with_store

    if args.name is None:
        raise CliError(f"schedules {args.action} needs the schedule's NAME", EXIT_USAGE)

    def would_change(row: Any) -> bool:
        if row.removed_at is not None:
            return False
        if args.action == "run-now":
            return bool(row.disabled_at is None and row.next_in_s > 0)
        return bool((row.disabled_at is not None) == (args.action == "enable"))

    async def use(store: Any) -> tuple[bool, bool]:
        found = [row for row in (await store.schedules() or []) if row.name == args.name]
        if not found or args.dry_run:
            return bool(found), bool(found) and would_change(found[0])
        if args.action == "run-now":
            return True, bool(await store.run_schedule_now(args.name))
        return True, bool(await store.set_schedule_enabled(args.name, args.action == "enable"))

    def audited(done: tuple[bool, bool]) -> dict[str, Any] | None:
        exists, changed = done
        return (
            {"action": f"schedule-{args.action}", "target": args.name, "count": int(changed)}
            if exists
            else None
        )

    exists, changed = with_store(args, use, audited)
    if not exists:
        raise CliError(
            f"no schedule {args.name!r} in schema {args.schema!r} (see: dramatiq-pg-outbox schedules)"
        )
    done = {"enable": "enabled", "disable": "disabled", "run-now": "due now"}[args.action]
    if args.dry_run:
        print(
            f"schedule {args.name!r} would be {done}"
            if changed
            else f"schedule {args.name!r} would not change"
        )
        print("dry run: nothing changed")
    elif args.action == "run-now":
        print(
            f"schedule {args.name!r} is due now: a running scheduler enqueues it within its poll interval"
            if changed
            else f"schedule {args.name!r} was not changed: disabled, removed, or due already"
        )
    else:
        print(f"{done} schedule {args.name!r}" if changed else f"schedule {args.name!r} was already {done}")
    return 0


def _late(row: ScheduleListRow) -> bool:
    """Whether the schedule's next tick is overdue by more than its grace."""
    return row.late_s * 1000 > row.grace_ms


def _schedule_json(row: ScheduleListRow) -> dict[str, Any]:
    state = "removed" if row.removed_s is not None else "disabled" if row.disabled_at is not None else None
    return {
        "name": row.name,
        "actor": row.actor_name,
        "queue": row.queue_name,
        "cron": row.cron,
        "every_ms": row.every_ms,
        "tz": row.tz,
        "missed": row.missed,
        "grace_ms": row.grace_ms,
        "last_run_at": row.last_run_at,
        "next_run_at": None if row.removed_s is not None else row.next_run_at,
        "runs": row.runs,
        "missed_ticks": row.missed_ticks,
        "status": state or ("late" if _late(row) else "ok"),
        "late_seconds": max(row.late_s, 0.0),
    }
