"""``dramatiq-pg-outbox``: the operators' command line.

Subcommands::

    migrate       create or upgrade the tables (alembic), print the revision reached;
                  --sql prints the SQL instead
    status        messages per queue and state, dead letters per queue, workers
    failed        the newest dead letters with their exception lines
    retry-failed  put dead letters back on their queue (fresh attempts)
    pause         stop claiming queues (messages keep arriving and wait)
    resume        claim paused queues again (their workers are woken)
    limits        run-time limits of concurrency keys: list, set PREFIX N, unset PREFIX
    prune         drop the history partitions (and delete the rows) older than a given age
    maintain      create the history partitions of the next days (workers do it hourly)
    dashboard     serve the web dashboard (extra: dashboard)
    metrics       serve the database gauges to Prometheus (extra: metrics)
    relay         move the messages of chosen queues to RabbitMQ or Redis (outbox relay)

The database URL comes from ``--url`` or ``$DATABASE_URL``; the schema from
``--schema`` (default ``dramatiq``).

Errors.  An expected failure (server unreachable, credentials refused, unknown
database, bad URL or argument, schema missing or older than this package needs)
is reported as one line on standard error that says what went wrong and what
to do, never as a traceback; no password is ever printed.  ``--debug`` (on the
command or on any subcommand) or ``DRAMATIQ_PG_OUTBOX_DEBUG=1`` prints the
traceback as well.

Exit codes::

    0    success
    1    runtime failure: the server, the credentials, the database or its schema
    2    usage error: a bad or missing argument or URL (argparse's code)
    130  interrupted (Ctrl-C)

A subcommand defined in another module registers with one line in
:func:`_parser`: ``module.add_parser(sub)`` adds a parser with
``parents=[common_options()]`` and ``set_defaults(run=module.run)``, where
``run(args) -> int`` returns the exit code; its errors are reported like the
built-in ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ..options import HEARTBEAT_INTERVAL_MS, HEARTBEAT_TIMEOUT_MS
from . import actions, dashboard, limits, periodic
from .commands import (
    audit_command,
    failed_command,
    maintain_command,
    metrics_command,
    migrate_command,
    pause_command,
    prune_command,
    relay_command,
    resume_command,
    retry_failed_command,
    status_command,
    workers_command,
)
from .common import (
    DEBUG_ENV_VAR,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PROG,
    READ_URL_ENV_VAR,
    URL_ENV_VAR,
    CliError,
    Parser,
    add_read_url,
    common_options,
    explain,
    package_version,
    parse_age,
    parse_non_negative_float,
    parse_non_negative_int,
    parse_port,
    parse_positive_int,
    parse_queue_name,
    report_error,
    scrub,
    secrets_in,
)


def _heartbeat_timeout(parser: argparse.ArgumentParser) -> None:
    """``--heartbeat-timeout MS``: when a worker counts as live (status, workers, metrics)."""
    parser.add_argument(
        "--heartbeat-timeout",
        type=parse_positive_int,
        default=HEARTBEAT_TIMEOUT_MS,
        metavar="MS",
        help="a worker is live if it heartbeat within this many ms (default: %(default)s, the broker's)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="exit codes: 0 success, 1 runtime failure (server, credentials, database, schema), "
        "2 usage error, 3 status --check found something that needs attention, 130 interrupted, "
        "141 the reader of the output went away (as after ... | head)",
    )
    parser.add_argument("--debug", action="store_true", help="on errors, print the traceback too")
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    common: Any = common_options()  # argparse's stubs want the subparsers' own class here
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = sub.add_parser("migrate", parents=[common], help="create or upgrade the tables")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    migrate.set_defaults(run=migrate_command)

    status = sub.add_parser("status", parents=[common], help="messages, dead letters and workers")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_read_url(status, "every figure")
    status.add_argument(
        "--check",
        action="store_true",
        help="print only what needs attention (dead letters in the last hour, a queue with due "
        "messages and no live worker, a late schedule) and exit 3 if anything does: for cron or a "
        "health probe",
    )
    _heartbeat_timeout(status)
    status.set_defaults(run=status_command)

    workers = sub.add_parser("workers", parents=[common], help="worker processes and their heartbeats")
    workers.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _heartbeat_timeout(workers)
    workers.set_defaults(run=workers_command)

    audit = sub.add_parser("audit", parents=[common], help="operator actions, newest first (audit trail)")
    audit.add_argument("--json", action="store_true", help="print JSON instead of a table")
    audit.add_argument("--limit", type=parse_positive_int, default=50, help="rows to show (default: 50)")
    audit.set_defaults(run=audit_command)

    failed = sub.add_parser("failed", parents=[common], help="newest dead letters")
    failed.add_argument("--queue", type=parse_queue_name, help="only this queue")
    failed.add_argument("--json", action="store_true", help="print JSON instead of a table")
    failed.add_argument("--limit", type=parse_positive_int, default=20, help="rows to show (default: 20)")
    failed.set_defaults(run=failed_command)

    retry = sub.add_parser("retry-failed", parents=[common], help="re-enqueue dead letters")
    retry.add_argument("--queue", type=parse_queue_name, help="only this queue")
    retry.add_argument("--actor", help="only this actor")
    retry.add_argument("--limit", type=parse_positive_int, help="at most this many, the oldest first")
    retry.add_argument("--dry-run", action="store_true", help="say what would be re-enqueued, change nothing")
    retry.add_argument(
        "--id",
        type=parse_positive_int,
        action="append",
        dest="ids",
        metavar="ID",
        help="only this history id (repeatable)",
    )
    retry.set_defaults(run=retry_failed_command)

    pause = sub.add_parser("pause", parents=[common], help="stop claiming queues (sends still store)")
    pause.add_argument("queues", nargs="+", type=parse_queue_name, metavar="QUEUE", help="a queue name")
    pause.add_argument(
        "--create",
        action="store_true",
        help="pause a queue that no message, worker or schedule has named yet (a typo otherwise)",
    )
    pause.set_defaults(run=pause_command)
    resume = sub.add_parser("resume", parents=[common], help="claim paused queues again")
    resume.add_argument("queues", nargs="+", type=parse_queue_name, metavar="QUEUE", help="a queue name")
    resume.set_defaults(run=resume_command)

    prune = sub.add_parser("prune", parents=[common], help="drop history older than an age")
    prune.add_argument(
        "--older-than",
        type=parse_age,
        required=True,
        metavar="AGE",
        help="age in days (30), or with a unit: 12h, 90m, 45s",
    )
    prune.add_argument(
        "--lock-timeout",
        type=parse_positive_int,
        default=2_000,
        metavar="MS",
        help="how long each partition DROP may wait for its lock (default: 2000)",
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would go, change nothing")
    prune.set_defaults(run=prune_command)
    maintain = sub.add_parser(
        "maintain", parents=[common], help="create the history partitions of the next days"
    )
    maintain.add_argument(
        "--days-ahead",
        type=parse_non_negative_int,
        default=7,
        metavar="N",
        help="create the partitions of today and the next N days (default: 7; 3660 at most)",
    )
    maintain.set_defaults(run=maintain_command)
    actions.add_parsers(sub, common)
    limits.add_parser(sub, parents=[common])
    dashboard.add_parser(sub, parents=[common])
    metrics = sub.add_parser(
        "metrics", parents=[common], help="serve the database gauges to Prometheus (extra: metrics)"
    )
    metrics.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    metrics.add_argument(
        "--port", type=parse_port, default=9192, help="port to bind (default: 9192; Dramatiq's own is 9191)"
    )
    metrics.add_argument(
        "--cache-seconds",
        type=parse_non_negative_float,
        default=5.0,
        help="seconds a reading is reused by later scrapes (default: 5; 0: read at every scrape)",
    )
    add_read_url(metrics, "the gauges")
    _heartbeat_timeout(metrics)
    metrics.set_defaults(run=metrics_command)
    relay = sub.add_parser(
        "relay", parents=[common], help="move the messages of chosen queues to RabbitMQ or Redis"
    )
    relay.add_argument(
        "--to", required=True, metavar="URL", help="amqp://... (RabbitMQ) or redis://... (Redis)"
    )
    relay.add_argument(
        "--queues",
        required=True,
        metavar="Q1,Q2",
        help="comma-separated queues to relay (the others stay local)",
    )
    relay.add_argument(
        "--batch-size", type=parse_positive_int, default=500, help="messages per claim (default: 500)"
    )
    relay.add_argument(
        "--report-every",
        type=parse_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="log the relayed count and the lag this often (default: 10; 0: never)",
    )
    relay.add_argument(
        "--metrics-port",
        type=parse_port,
        default=None,
        metavar="PORT",
        help="serve the relay's Prometheus metrics on this port of --metrics-host (extra: metrics)",
    )
    relay.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of --metrics-port (default: 127.0.0.1)"
    )
    relay.add_argument(
        "--heartbeat-interval",
        type=parse_positive_int,
        default=HEARTBEAT_INTERVAL_MS,
        metavar="MS",
        help="(default: %(default)s, the broker's)",
    )
    relay.add_argument(
        "--heartbeat-timeout",
        type=parse_positive_int,
        default=HEARTBEAT_TIMEOUT_MS,
        metavar="MS",
        help="a dead relay's claims are released after this (default: %(default)s, the broker's)",
    )
    relay.set_defaults(run=relay_command)
    periodic.add_parser(sub)
    return parser


# -- the entry point --------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dramatiq-pg-outbox`` console script.

    Parameters:
      argv(Sequence[str]|None): The arguments; default ``sys.argv[1:]``.

    Returns:
      int: The exit code: 0, 1 (runtime failure), 2 (usage error) or 130 (interrupted).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    secrets = secrets_in(argv, os.environ.get(URL_ENV_VAR), os.environ.get(READ_URL_ENV_VAR))
    debug = os.environ.get(DEBUG_ENV_VAR, "") not in ("", "0") or "--debug" in argv
    prog = PROG
    try:
        args = _parser().parse_args(argv)
        prog = f"{PROG} {args.command}"
        debug = debug or bool(getattr(args, "debug", False))
        run: Callable[[argparse.Namespace], int] = args.run
        code = run(args)
        # After the command's own output (an error stays one line): the warning of a password
        # on the command line, which every user of the machine sees in ps while it runs.
        for option, env_var in (("url", URL_ENV_VAR), ("read_url", READ_URL_ENV_VAR)):
            given = getattr(args, option, None)
            if given is not None and secrets_in(["--url", given]):
                report_error(
                    prog,
                    f"warning: a password given with --{option.replace('_', '-')} can be read by every "
                    f"user of this machine (ps); set ${env_var} instead, or keep the password in "
                    "~/.pgpass or $PGPASSWORD",
                    secrets,
                )
        return code
    except KeyboardInterrupt:
        report_error(prog, "interrupted", secrets)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (... | head): end quietly, with the status of a process that
        # SIGPIPE ended (as cat's), and keep Python from failing again on the final flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as e:
        error = explain(e)
        if debug and not (isinstance(e, CliError) and e.exit_code == EXIT_USAGE):
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            print(scrub(text, secrets), end="", file=sys.stderr)
        report_error(error.prog or prog, error.message, secrets)
        return error.exit_code
