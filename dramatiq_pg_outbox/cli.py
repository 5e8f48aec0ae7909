"""``dramatiq-pg-outbox``: the operators' command line.

Subcommands::

    migrate       create or upgrade the tables (alembic), print the revision reached;
                  --sql prints the SQL instead
    status        messages per queue and state, dead letters per queue, workers
    failed        the newest dead letters with their exception lines
    retry-failed  put dead letters back on their queue (fresh attempts)
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
import datetime
import getpass
import math
import os
import re
import shlex
import shutil
import sys
import traceback
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
from dramatiq.common import q_name
from psycopg.conninfo import conninfo_to_dict

from . import dashboard, periodic
from ._urls import mask_password
from .errors import URL_SHAPE, SchemaNotReady, libpq_detail, rejection_reason
from .migrations import (
    DEFAULT_SCHEMA,
    VERSION_TABLE,
    check_schema,
    libpq_url,
    quote_ident,
    script_location,
    upgrade,
    upgrade_sql,
    validate_schema_name,
)

#: Name of the program in messages.
PROG = "dramatiq-pg-outbox"
#: Environment variable that turns ``--debug`` on for every subcommand (any value but ``0`` or empty).
DEBUG_ENV_VAR = "DRAMATIQ_PG_OUTBOX_DEBUG"
#: Environment variable read when ``--url`` is not given.
URL_ENV_VAR = "DATABASE_URL"
#: Seconds to wait for the server to answer, unless the URL sets ``connect_timeout``.
CONNECT_TIMEOUT = 10
#: Exit code of a runtime failure.
EXIT_FAILURE = 1
#: Exit code of a usage error (argparse's).
EXIT_USAGE = 2
#: Exit code after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130
#: Narrowest the error column of ``failed`` gets, in characters.
MIN_ERROR_WIDTH = 40

_URL_SHAPE = URL_SHAPE
_SECRET_PARAMETERS = ("password", "sslpassword")
_AGE = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([smhd]?)\s*$")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400, "": 86_400}


class CliError(Exception):
    """An expected failure, reported as one line on standard error.

    Parameters:
      message(str): What went wrong and what to do, one line.
      exit_code(int): :data:`EXIT_FAILURE` (default) or :data:`EXIT_USAGE`.
      prog(str|None): The (sub)command to name in the report; default: the one that ran.
    """

    def __init__(self, message: str, exit_code: int = EXIT_FAILURE, prog: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors reported on one line (no usage block) by :func:`main`."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message}; see '{self.prog} --help'", EXIT_USAGE, self.prog)


# -- argument types (argparse ``type=``) --------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= 3660:
        raise argparse.ArgumentTypeError(f"must be within 0..3660, got {value}")
    return value


def _port(text: str) -> int:
    port = _positive_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1-65535, got {port}")
    return port


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _age(text: str) -> datetime.timedelta:
    """``30`` (days), ``30d``, ``12h``, ``90m`` or ``45s``: a positive age."""
    found = _AGE.match(text)
    if not found:
        raise argparse.ArgumentTypeError(
            f"expected a number of days, or a number with a unit s, m, h or d (30, 12h), got {text!r}"
        )
    seconds = float(found.group(1)) * _AGE_UNITS[found.group(2)]
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    try:
        return datetime.timedelta(seconds=seconds)
    except OverflowError:
        raise argparse.ArgumentTypeError(f"too large: {text!r}") from None


def _schema(text: str) -> str:
    try:
        return validate_schema_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None


# -- the parser -----------------------------------------------------------------


def common_options() -> argparse.ArgumentParser:
    """The options of every subcommand (``--url``, ``--schema``, ``--debug``), as an argparse parent."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", help=f"PostgreSQL URL, {_URL_SHAPE} (default: ${URL_ENV_VAR})", metavar="URL"
    )
    common.add_argument(
        "--schema", type=_schema, default=DEFAULT_SCHEMA, help="schema of the tables (default: dramatiq)"
    )
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"on errors, print the traceback too (also: {DEBUG_ENV_VAR}=1)",
    )
    return common


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="exit codes: 0 success, 1 runtime failure (server, credentials, database, schema), "
        "2 usage error, 130 interrupted",
    )
    parser.add_argument("--debug", action="store_true", help="on errors, print the traceback too")
    common: Any = common_options()  # argparse's stubs want the subparsers' own class here
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = sub.add_parser("migrate", parents=[common], help="create or upgrade the tables")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    migrate.add_argument("--sql", action="store_true", help="print the SQL instead of running it")
    migrate.set_defaults(run=_migrate)

    status = sub.add_parser("status", parents=[common], help="messages, dead letters and workers")
    status.set_defaults(run=_status)

    failed = sub.add_parser("failed", parents=[common], help="newest dead letters")
    failed.add_argument("--queue", help="only this queue")
    failed.add_argument("--limit", type=_positive_int, default=20, help="rows to show (default: 20)")
    failed.set_defaults(run=_failed)

    retry = sub.add_parser("retry-failed", parents=[common], help="re-enqueue dead letters")
    retry.add_argument("--queue", help="only this queue")
    retry.add_argument(
        "--id",
        type=_positive_int,
        action="append",
        dest="ids",
        metavar="ID",
        help="only this history id (repeatable)",
    )
    retry.set_defaults(run=_retry_failed)

    prune = sub.add_parser("prune", parents=[common], help="drop history older than an age")
    prune.add_argument(
        "--older-than",
        type=_age,
        required=True,
        metavar="AGE",
        help="age in days (30), or with a unit: 12h, 90m, 45s",
    )
    prune.add_argument(
        "--lock-timeout",
        type=_positive_int,
        default=2_000,
        metavar="MS",
        help="how long each partition DROP may wait for its lock (default: 2000)",
    )
    prune.set_defaults(run=_prune)
    maintain = sub.add_parser(
        "maintain", parents=[common], help="create the history partitions of the next days"
    )
    maintain.add_argument(
        "--days-ahead",
        type=_non_negative_int,
        default=7,
        metavar="N",
        help="create the partitions of today and the next N days (default: 7; 3660 at most)",
    )
    maintain.set_defaults(run=_maintain)
    dashboard.add_parser(sub, parents=[common])
    metrics = sub.add_parser(
        "metrics", parents=[common], help="serve the database gauges to Prometheus (extra: metrics)"
    )
    metrics.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    metrics.add_argument(
        "--port", type=_port, default=9192, help="port to bind (default: 9192; Dramatiq's own is 9191)"
    )
    metrics.add_argument(
        "--cache-seconds",
        type=_non_negative_float,
        default=5.0,
        help="seconds a reading is reused by later scrapes (default: 5; 0: read at every scrape)",
    )
    metrics.add_argument(
        "--heartbeat-timeout",
        type=_positive_int,
        default=20_000,
        metavar="MS",
        help="a worker is live if it heartbeat within this many ms (default: 20000, the broker's)",
    )
    metrics.set_defaults(run=_metrics)
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
        "--batch-size", type=_positive_int, default=500, help="messages per claim (default: 500)"
    )
    relay.add_argument(
        "--report-every",
        type=_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="log the relayed count and the lag this often (default: 10; 0: never)",
    )
    relay.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve the relay's Prometheus metrics on this port of --metrics-host (extra: metrics)",
    )
    relay.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of --metrics-port (default: 127.0.0.1)"
    )
    relay.add_argument(
        "--heartbeat-interval", type=_positive_int, default=5_000, metavar="MS", help="(default: 5000)"
    )
    relay.add_argument(
        "--heartbeat-timeout",
        type=_positive_int,
        default=20_000,
        metavar="MS",
        help="a dead relay's claims are released after this (default: 20000)",
    )
    relay.set_defaults(run=_relay)
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
    secrets = _secrets_in(argv, os.environ.get(URL_ENV_VAR))
    debug = os.environ.get(DEBUG_ENV_VAR, "") not in ("", "0") or "--debug" in argv
    prog = PROG
    try:
        args = _parser().parse_args(argv)
        prog = f"{PROG} {args.command}"
        debug = debug or bool(getattr(args, "debug", False))
        run: Callable[[argparse.Namespace], int] = args.run
        return run(args)
    except KeyboardInterrupt:
        _report(prog, "interrupted", secrets)
        return EXIT_INTERRUPTED
    except Exception as e:
        error = _explain(e)
        if debug and not (isinstance(e, CliError) and e.exit_code == EXIT_USAGE):
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            print(_scrub(text, secrets), end="", file=sys.stderr)
        _report(error.prog or prog, error.message, secrets)
        return error.exit_code


def _report(prog: str, message: str, secrets: Sequence[str]) -> None:
    line = " ".join(_scrub(message, secrets).split())
    print(f"{prog}: error: {line}", file=sys.stderr)


def _explain(e: BaseException) -> CliError:
    """The one line (and exit code) that reports ``e``."""
    import sqlalchemy.exc
    from alembic.util import CommandError

    if isinstance(e, CliError):
        return e
    if isinstance(e, sqlalchemy.exc.DBAPIError) and isinstance(e.orig, BaseException):
        e = e.orig
    if isinstance(e, SchemaNotReady):
        return CliError(str(e))
    if isinstance(e, CommandError):
        return CliError(f"alembic: {_one_line(e)}", EXIT_USAGE)
    if isinstance(e, psycopg.errors.InsufficientPrivilege):
        return CliError(
            f"permission denied: {_one_line(e)}. Use a role with the privileges this command needs "
            "(see docs/security.md)"
        )
    if isinstance(e, psycopg.OperationalError) and (e.sqlstate or "08").startswith(("08", "57P")):
        return CliError(f"lost the connection to PostgreSQL: {_libpq_detail(e)}. Run the command again")
    if isinstance(e, psycopg.Error):
        state = f" (SQLSTATE {e.sqlstate})" if e.sqlstate else ""
        return CliError(f"database error{state}: {_one_line(e)}. Run with --debug for the traceback")
    return CliError(
        f"unexpected error: {type(e).__name__}: {_one_line(e)}. "
        "Run with --debug for the traceback, and please report it"
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# -- passwords --------------------------------------------------------------------


def _secrets_in(argv: Sequence[str], env_url: str | None) -> list[str]:
    """Every password of the URLs in ``argv`` and ``$DATABASE_URL``, to scrub them from any output."""
    urls = [env_url] if env_url else []
    for i, arg in enumerate(argv):
        if arg == "--url" and i + 1 < len(argv):
            urls.append(argv[i + 1])
        elif arg.startswith("--url="):
            urls.append(arg.removeprefix("--url="))
    found: set[str] = set()
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            continue
        userinfo, at, _ = parts.netloc.rpartition("@")
        if at and ":" in userinfo:
            found.add(userinfo.split(":", 1)[1])
        found.update(v for k, v in urllib.parse.parse_qsl(parts.query) if k in _SECRET_PARAMETERS)
        for piece in parts.query.split("&"):
            key, _, value = piece.partition("=")
            if key in _SECRET_PARAMETERS:
                found.add(value)
    found |= {urllib.parse.unquote(s) for s in found}
    # Longest first, so that a password containing another is replaced whole.
    return sorted((s for s in found if len(s) >= 3), key=len, reverse=True)


def _scrub(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _shown(url: str) -> str:
    try:
        return mask_password(url)
    except ValueError:
        return "(not shown: it cannot be parsed)"


# -- the database ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Database:
    """Where a subcommand connects, and how to name it without the password."""

    #: libpq URL (holds the password).
    conninfo: str
    #: The URL as it may be printed.
    shown: str
    #: What to pass to ``--url`` in a suggested command.
    fix_url: str
    #: libpq parameters (``host``, ``port``, ``user``, ``dbname``...).
    params: dict[str, Any]

    @property
    def server(self) -> str:
        host = self.params.get("host") or self.params.get("hostaddr") or "the local socket"
        return f"{host}:{self.params.get('port') or 5432}"


def _database(args: argparse.Namespace) -> _Database:
    """The validated URL of ``--url`` or ``$DATABASE_URL``.

    Raises:
      CliError: (usage) If there is none, or it is not a PostgreSQL URL psycopg accepts.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    url: str | None = args.url
    from_env = url is None
    if url is None:
        url = os.environ.get(URL_ENV_VAR)
    if not url:
        raise CliError(f"no database URL: pass --url {_URL_SHAPE} or set {URL_ENV_VAR}", EXIT_USAGE)
    source = f"${URL_ENV_VAR}" if from_env else "--url"
    shown = _shown(url)
    netloc = urllib.parse.urlsplit(url).netloc if "://" in url and "[" not in url else ""
    if netloc.count("@") > 1:
        raise CliError(
            f"cannot parse the database URL of {source} ({shown}): it has more than one '@'; "
            f"expected {_URL_SHAPE}, with an '@' in the user name or password written as %40",
            EXIT_USAGE,
        )
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        raise CliError(
            f"cannot parse the database URL of {source} ({shown}): expected {_URL_SHAPE}", EXIT_USAGE
        ) from None
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise CliError(
            f"the database URL of {source} is not a PostgreSQL URL ({shown}): expected {_URL_SHAPE}",
            EXIT_USAGE,
        )
    conninfo = libpq_url(parsed)
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        raise CliError(
            f"cannot use the database URL of {source} ({shown}): {_one_line(e)}; expected {_URL_SHAPE}",
            EXIT_USAGE,
        ) from None
    fix_url = f'"${URL_ENV_VAR}"' if from_env else shlex.quote(shown)
    return _Database(conninfo, shown, fix_url, params)


def _connect(db: _Database) -> psycopg.Connection[Any]:
    """An autocommit connection.

    Raises:
      CliError: If the server cannot be reached or refuses the connection.
    """
    try:
        if db.params.get("connect_timeout"):  # the URL's own, checked by libpq
            return psycopg.connect(db.conninfo, autocommit=True)
        return psycopg.connect(db.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
    except psycopg.OperationalError as e:
        raise _connection_error(e, db) from e


def _connection_error(e: psycopg.OperationalError, db: _Database) -> CliError:
    detail = _libpq_detail(e)
    text = str(e)
    user = db.params.get("user") or _login_name()
    dbname = db.params.get("dbname") or user
    where = f"PostgreSQL at {db.server}"
    reason = rejection_reason(e, server=db.server, user=str(user), dbname=str(dbname))
    if reason is not None:
        return CliError(reason)
    if "Connection refused" in text or "No such file or directory" in text:
        return CliError(
            f"cannot connect to {where}: connection refused. "
            "Check that PostgreSQL is running and that the host and port in the URL are right"
        )
    if "resolve host" in text or "translate host name" in text:
        return CliError(f"cannot connect to {where}: unknown host ({detail}). Check the host in the URL")
    if "timeout expired" in text:
        return CliError(
            f"cannot connect to {where}: no answer within the connect timeout. "
            "Check the host and port in the URL and any firewall between"
        )
    return CliError(f"cannot connect to {where}: {detail}. Check the URL and that the server runs")


def _login_name() -> str:
    """libpq's default user name."""
    try:
        return getpass.getuser()
    except Exception:
        return "(your login name)"


def _libpq_detail(e: psycopg.Error) -> str:
    """libpq's message on one line, without its ``connection to server at ... failed:`` prefixes."""
    return libpq_detail(e)


@contextmanager
def _checked_connection(
    args: argparse.Namespace,
) -> Iterator[tuple[psycopg.Connection[Any], str, _Database]]:
    """(connection, quoted schema, database) once the schema is known to be current."""
    db = _database(args)
    with _connect(db) as conn:
        check_schema(conn, args.schema, url=db.shown, fix_url=db.fix_url)
        yield conn, quote_ident(args.schema), db


# -- output helpers ---------------------------------------------------------------------


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str], numeric: Sequence[int] = ()) -> None:
    """Print ``rows`` under ``header`` in aligned columns; the ``numeric`` columns right-aligned."""
    cells = [list(header)] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        line = "  ".join(
            v.rjust(w) if i in numeric else v.ljust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )
        print(line.rstrip())


def _duration(seconds: float | None) -> str:
    """``0.4s``, ``42s``, ``5m03s``, ``2h05m``, ``3d04h``."""
    if seconds is None:
        return ""
    seconds = max(0.0, float(seconds))
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3_600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3_600}h{whole % 3_600 // 60:02d}m"
    return f"{whole // 86_400}d{whole % 86_400 // 3_600:02d}h"


def _queue_list(queues: Sequence[str]) -> str:
    """``default, emails``: Dramatiq's delay queues (``emails.DQ``) are the same rows as their queue."""
    return ", ".join(dict.fromkeys(q_name(q) for q in queues))


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 3)].rstrip() + "..."


def exception_line(error_type: str | None, error: str | None) -> str:
    """The line that says what failed: ``KeyError: 'no such customer'``.

    For a stored traceback, its exception line (the last line naming
    ``error_type``, else its last unindented line); for any other error text
    (``MaxDeliveriesExceeded``, ``DecodeError``), the type and the text's first
    line.

    Parameters:
      error_type(str|None): ``history.error_type``, the exception's class name.
      error(str|None): ``history.error``, a traceback or a message.

    Returns:
      str: One line.
    """
    lines = [line.rstrip() for line in (error or "").splitlines() if line.strip()]
    kind = error_type or ""
    named = re.compile(rf"^(?:[\w.]+\.)?{re.escape(kind)}(?::|$)") if kind else None
    if any(line.startswith("Traceback (most recent call last):") for line in lines):
        if named is not None:
            for line in reversed(lines):
                if named.match(line):
                    return line
        for line in reversed(lines):
            if not line[:1].isspace() and line != "[...]":
                return f"{kind}: {line}" if kind and not line.startswith(kind) else line
    if not lines:
        return kind
    first = lines[0].strip()
    if not kind or (named is not None and named.match(first)):
        return first
    return f"{kind}: {first}"


# -- subcommands ------------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    if args.sql:
        upgrade_sql(args.schema, args.revision)
        return 0
    db = _database(args)
    with _connect(db) as conn:
        before = _applied_revisions(conn, args.schema)
        if before is None:
            row = conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL", (f"{quote_ident(args.schema)}.messages",)
            ).fetchone()
            if row is not None and row[0]:
                raise CliError(
                    f"schema {args.schema!r} already holds the tables, but not our version table "
                    f"{VERSION_TABLE}: your application's alembic history manages them; "
                    "run `alembic upgrade heads` there instead"
                )
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


def _applied_revisions(conn: psycopg.Connection[Any], schema: str) -> list[str] | None:
    """Revisions recorded in our version table, or ``None`` if it does not exist."""
    table = f"{quote_ident(schema)}.{VERSION_TABLE}"
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
    if row is None or not row[0]:
        return None
    return [str(r[0]) for r in conn.execute(f"SELECT version_num FROM {table} ORDER BY 1").fetchall()]  # noqa: S608


def _status(args: argparse.Namespace) -> int:
    with _checked_connection(args) as (conn, s, _):
        messages = conn.execute(
            f"SELECT queue_name, state, count(*), count(*) FILTER (WHERE next_attempt_at > now()), "  # noqa: S608
            f"extract(epoch FROM now() - min(enqueued_at)) FROM {s}.messages GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()
        failed = conn.execute(
            f"SELECT queue_name, count(*) FILTER (WHERE finished_at > now() - interval '1 hour'), "  # noqa: S608
            f"count(*) FROM {s}.history WHERE state = 'failed' GROUP BY 1 ORDER BY 1"
        ).fetchall()
        workers = conn.execute(
            f"SELECT hostname, pid, queues, extract(epoch FROM now() - heartbeat_at) "  # noqa: S608
            f"FROM {s}.workers ORDER BY hostname, pid"
        ).fetchall()
    if messages:
        _table(
            [(q, state, n, delayed, _duration(age)) for q, state, n, delayed, age in messages],
            ["queue", "state", "messages", "delayed", "oldest"],
            numeric=(2, 3, 4),
        )
    else:
        print(f"no messages waiting or running in schema {args.schema!r}")
    print()
    if failed:
        _table(failed, ["queue", "failed last hour", "failed in history"], numeric=(1, 2))
    else:
        print("no dead letters")
    print()
    if workers:
        _table(
            [(host, pid, _queue_list(queues), f"{_duration(age)} ago") for host, pid, queues, age in workers],
            ["host", "pid", "queues", "last heartbeat"],
            numeric=(1, 3),
        )
    else:
        print("no workers")
    return 0


def _metrics(args: argparse.Namespace) -> int:
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise CliError(
            "the metrics command needs prometheus_client: pip install 'dramatiq-pg-outbox[metrics]'"
        ) from None
    import signal
    import threading

    from .metrics import DatabaseCollector

    with _checked_connection(args):
        pass  # the server, the credentials and the schema are fine: serve
    db = _database(args)
    collector = DatabaseCollector(
        db.conninfo,
        args.schema,
        cache_seconds=args.cache_seconds,
        heartbeat_timeout=args.heartbeat_timeout,
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
    print(
        f"metrics of {db.shown} schema {args.schema!r} on http://{args.host}:{args.port}/metrics "
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


def _relay(args: argparse.Namespace) -> int:
    import logging
    import signal

    from .broker import PostgresBroker, validate_queue_name
    from .relay import Relay, TargetUnusable, check_target, target_broker

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
    with _checked_connection(args):
        pass  # the server, the credentials and the schema are fine
    db = _database(args)
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
    from .relay import RelayCollector

    registry = CollectorRegistry()
    registry.register(RelayCollector(relay))
    try:
        server, _ = start_http_server(port, host, registry)
    except OSError as e:
        raise CliError(
            f"cannot listen on {host}:{port}: {e.strerror or e}. Choose another --metrics-port"
        ) from None
    return server


def _failed(args: argparse.Namespace) -> int:
    with _checked_connection(args) as (conn, s, _):
        rows = conn.execute(
            f"SELECT id, queue_name, actor_name, attempts, finished_at, error_type, error "  # noqa: S608
            f"FROM {s}.history WHERE state = 'failed' "
            f"AND (%(queue)s::text IS NULL OR queue_name = %(queue)s) "
            f"ORDER BY finished_at DESC, id DESC LIMIT %(limit)s",
            {"queue": args.queue, "limit": args.limit},
        ).fetchall()
    if not rows:
        only = f" of queue {args.queue!r}" if args.queue else ""
        print(f"no dead letters{only} in schema {args.schema!r}")
        return 0
    utc = datetime.timezone.utc
    table = [
        (
            row_id,
            queue,
            actor,
            attempts,
            f"{finished.astimezone(utc):%Y-%m-%d %H:%M:%S}",
            exception_line(kind, error),
        )
        for row_id, queue, actor, attempts, finished, kind, error in rows
    ]
    header = ["id", "queue", "actor", "attempts", "finished (UTC)", "error"]
    used = sum(max(len(str(r[i])) for r in [header, *table]) + 2 for i in range(len(header) - 1))
    width = max(MIN_ERROR_WIDTH, shutil.get_terminal_size((120, 24)).columns - used)
    _table([(*row[:-1], _clip(row[-1], width)) for row in table], header, numeric=(0, 3))
    return 0


def _retry_failed(args: argparse.Namespace) -> int:
    with _checked_connection(args) as (conn, s, db):
        row = conn.execute(
            f"""WITH moved AS (
                    DELETE FROM {s}.history
                    WHERE state = 'failed'
                      AND (%(queue)s::text IS NULL OR queue_name = %(queue)s)
                      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
                    RETURNING id, queue_name, actor_name, message_id, payload, idempotency_key
                ), inserted AS (
                    INSERT INTO {s}.messages (queue_name, actor_name, message_id, payload, idempotency_key)
                    SELECT queue_name, actor_name, message_id, payload, idempotency_key FROM moved RETURNING 1
                ) SELECT (SELECT count(*) FROM inserted), (SELECT array_agg(id) FROM moved)""",  # noqa: S608
            {"queue": args.queue, "ids": args.ids},
        ).fetchone()
    count, moved = (int(row[0]), set(row[1] or ())) if row else (0, set())
    print(f"re-enqueued {count} failed message(s)")
    missing = sorted(set(args.ids or ()) - moved)
    if missing:
        only = f" of queue {args.queue!r}" if args.queue else ""
        raise CliError(
            f"no dead letter{only} with id {', '.join(map(str, missing))} in schema {args.schema!r}. "
            f"List them with: {PROG} failed --url {db.fix_url} --schema {args.schema}"
        )
    return 0


def _prune(args: argparse.Namespace) -> int:
    from .partitions import prune

    with _checked_connection(args) as (conn, _, _):
        result = prune(conn, args.schema, args.older_than, lock_timeout=args.lock_timeout)
    age = _duration(args.older_than.total_seconds())
    days = f" ({result.dropped[0].day} to {result.dropped[-1].day})" if result.dropped else ""
    print(
        f"dropped {len(result.dropped)} day partition(s){days} of about {result.dropped_rows} row(s), "
        f"deleted {result.deleted} history row(s) older than {age}"
    )
    if result.kept:
        raise CliError(
            f"{len(result.kept)} partition(s) older than {age} were kept: their lock was not granted within "
            f"{args.lock_timeout} ms (a long query on history?). Run the same prune again later"
        )
    return 0


def _maintain(args: argparse.Namespace) -> int:
    from .partitions import create_partitions, day_partitions

    with _checked_connection(args) as (conn, s, _):
        created = create_partitions(conn, args.schema, args.days_ahead)
        parts = day_partitions(conn, args.schema)
        row = conn.execute(f"SELECT count(*) FROM {s}.history_default").fetchone()  # noqa: S608
    span = f"from {parts[0].day} to {parts[-1].day}" if parts else "none"
    print(
        f"created {created} history partition(s); {len(parts)} day partition(s) {span}; "
        f"{row[0] if row else 0} row(s) in history_default"
    )
    return 0


if __name__ == "__main__":
    # `python -m dramatiq_pg_outbox.cli` runs this file as __main__: call the main() of the
    # imported module, whose CliError is the one that feature modules raise.
    from dramatiq_pg_outbox.cli import main as _main

    raise SystemExit(_main())
