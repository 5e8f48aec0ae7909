"""What every subcommand shares: errors and exit codes, the database URL and connection, tables."""

from __future__ import annotations

import argparse
import datetime
import decimal
import json
import math
import os
import re
import shlex
import sys
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
from dramatiq.common import q_name
from psycopg.conninfo import conninfo_to_dict

from .. import _launch
from .._isolation import connect
from ..errors import URL_SHAPE, SchemaNotReady, libpq_detail, login_name, rejection_reason
from ..migrations import check_schema
from ..names import DEFAULT_SCHEMA, validate_queue_name, validate_schema_name
from ..store.admin import AdminStore
from ..urls import SECRET_PARAMETERS, URLError, libpq_url, mask_password, parse_url

#: Name of the program in messages.
PROG = _launch.PROG
#: Environment variable that turns ``--debug`` on for every subcommand (any value but ``0`` or empty).
DEBUG_ENV_VAR = "DRAMATIQ_PG_OUTBOX_DEBUG"
#: Environment variable read when ``--url`` is not given.
URL_ENV_VAR = "DATABASE_URL"
#: Environment variable read when ``--read-url`` is not given (status, dashboard, metrics).
READ_URL_ENV_VAR = "DATABASE_READ_URL"
#: Seconds to wait for the server to answer, unless the URL sets ``connect_timeout``.
CONNECT_TIMEOUT = 10
#: Exit code of a runtime failure.
EXIT_FAILURE = 1
#: Exit code of a usage error (argparse's).
EXIT_USAGE = 2
#: Exit code after Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = _launch.EXIT_INTERRUPTED
#: ``status --check`` found something that needs attention.
EXIT_ATTENTION = 3
#: The reader of the output went away (``... | head``): 128 + SIGPIPE, as a process SIGPIPE ended.
EXIT_BROKEN_PIPE = 141
#: Narrowest the error column of ``failed`` gets, in characters.
MIN_ERROR_WIDTH = 40

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


class Parser(argparse.ArgumentParser):
    """argparse, with its errors reported on one line (no usage block) by :func:`main`."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message}; see '{self.prog} --help'", EXIT_USAGE, self.prog)


# -- argument types (argparse ``type=``) --------------------------------------


def whole_number(text: str, what: str = "a whole number") -> int:
    """``text`` as an int; ``argparse.ArgumentTypeError`` "expected <what>, got ..." if it is none."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def parse_positive_int(text: str) -> int:
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def parse_non_negative_int(text: str) -> int:
    value = whole_number(text)
    if not 0 <= value <= 3660:
        raise argparse.ArgumentTypeError(f"must be within 0..3660, got {value}")
    return value


def parse_port(text: str) -> int:
    port = parse_positive_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1-65535, got {port}")
    return port


def parse_non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def parse_queue_name(text: str) -> str:
    """A valid queue name (letters, digits, ``_ . -``), for argparse."""
    try:
        return validate_queue_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None


def parse_age(text: str) -> datetime.timedelta:
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


def package_version() -> str:
    """The installed version of the package (its metadata), else the source's ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dramatiq-pg-outbox")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


def common_options() -> argparse.ArgumentParser:
    """The options of every subcommand (``--url``, ``--schema``, ``--debug``), as an argparse parent."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help=f"PostgreSQL URL, {URL_SHAPE} (default: ${URL_ENV_VAR})", metavar="URL")
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


def report_error(prog: str, message: str, secrets: Sequence[str]) -> None:
    line = " ".join(scrub(message, secrets).split())
    print(f"{prog}: error: {line}", file=sys.stderr)


def explain(e: BaseException) -> CliError:
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
        return CliError(f"alembic: {one_line(e)}", EXIT_USAGE)
    if isinstance(e, psycopg.errors.InsufficientPrivilege):
        return CliError(
            f"permission denied: {one_line(e)}. Use a role with the privileges this command needs "
            "(see docs/security.md)"
        )
    if isinstance(e, psycopg.OperationalError) and (e.sqlstate or "08").startswith(("08", "57P")):
        return CliError(f"lost the connection to PostgreSQL: {libpq_detail(e)}. Run the command again")
    if isinstance(e, psycopg.Error):
        state = f" (SQLSTATE {e.sqlstate})" if e.sqlstate else ""
        return CliError(f"database error{state}: {one_line(e)}. Run with --debug for the traceback")
    return CliError(
        f"unexpected error: {type(e).__name__}: {one_line(e)}. "
        "Run with --debug for the traceback, and please report it"
    )


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# -- passwords --------------------------------------------------------------------


def secrets_in(argv: Sequence[str], *env_urls: str | None) -> list[str]:
    """Every password of the URLs in ``argv`` (``--url``, ``--read-url``) and ``env_urls``
    (``$DATABASE_URL``, ``$DATABASE_READ_URL``), to scrub them from any output."""
    urls = [url for url in env_urls if url]
    for i, arg in enumerate(argv):
        for option in ("--url", "--read-url"):
            if arg == option and i + 1 < len(argv):
                urls.append(argv[i + 1])
            elif arg.startswith(f"{option}="):
                urls.append(arg.removeprefix(f"{option}="))
    found: set[str] = set()
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            continue
        userinfo, at, _ = parts.netloc.rpartition("@")
        if at and ":" in userinfo:
            found.add(userinfo.split(":", 1)[1])
        found.update(v for k, v in urllib.parse.parse_qsl(parts.query) if k in SECRET_PARAMETERS)
        for piece in parts.query.split("&"):
            key, _, value = piece.partition("=")
            if key in SECRET_PARAMETERS:
                found.add(value)
    found |= {urllib.parse.unquote(s) for s in found}
    # Longest first, so that a password containing another is replaced whole.
    return sorted((s for s in found if len(s) >= 3), key=len, reverse=True)


def scrub(text: str, secrets: Sequence[str]) -> str:
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
class Database:
    """Where a subcommand connects, and how to name it without the password."""

    #: libpq URL (holds the password).
    conninfo: str
    #: The URL as it may be printed.
    shown: str
    #: What to pass to ``--url`` in a suggested command (quoted for a shell), or None when the
    #: URL of ``--url`` has a password: the command then passes ``"$DATABASE_URL"`` and says
    #: to set it (see :func:`~dramatiq_pg_outbox.migrations.schema_not_ready`).
    fix_url: str | None
    #: libpq parameters (``host``, ``port``, ``user``, ``dbname``...).
    params: dict[str, Any]

    def command_url(self) -> str:
        """``--url`` of a suggested command, with what to do first when the URL has a password."""
        if self.fix_url is not None:
            return self.fix_url
        return f'"${URL_ENV_VAR}" (after setting {URL_ENV_VAR} to the URL, its password included)'

    @property
    def server(self) -> str:
        """``host:port``, or for several hosts ``host1:port1, host2:port2`` (libpq's lists)."""
        hosts = str(self.params.get("host") or self.params.get("hostaddr") or "the local socket").split(",")
        ports = str(self.params.get("port") or "").split(",")
        if len(ports) == 1:
            ports = ports * len(hosts)
        return ", ".join(
            f"{host or 'the local socket'}:{port or 5432}" for host, port in zip(hosts, ports, strict=False)
        )


def database_from(args: argparse.Namespace) -> Database:
    """The validated URL of ``--url`` or ``$DATABASE_URL``.

    Raises:
      CliError: (usage) If there is none, or it is not a PostgreSQL URL psycopg accepts.
    """
    url: str | None = args.url
    from_env = url is None
    if url is None:
        url = os.environ.get(URL_ENV_VAR)
    if not url:
        raise CliError(f"no database URL: pass --url {URL_SHAPE} or set {URL_ENV_VAR}", EXIT_USAGE)
    return _database(url, from_env, "--url", URL_ENV_VAR)


def read_database_from(args: argparse.Namespace) -> Database | None:
    """The validated URL of ``--read-url`` or ``$DATABASE_READ_URL`` (a hot standby); None if neither.

    Raises:
      CliError: (usage) If it is not a PostgreSQL URL psycopg accepts (naming ``--read-url``).
    """
    url: str | None = getattr(args, "read_url", None)
    from_env = url is None
    if url is None:
        url = os.environ.get(READ_URL_ENV_VAR) or None
    if url is None:
        return None
    if not url:
        raise CliError(f"--read-url is empty: pass a URL, {URL_SHAPE}, or leave it out", EXIT_USAGE)
    return _database(url, from_env, "--read-url", READ_URL_ENV_VAR)


def add_read_url(parser: argparse.ArgumentParser, reads: str) -> None:
    """``--read-url URL`` (default ``$DATABASE_READ_URL``): where ``reads`` come from (a hot standby)."""
    parser.add_argument(
        "--read-url",
        metavar="URL",
        help=f"PostgreSQL URL of a hot standby of --url's server to read {reads} from, showing its lag; "
        f"writes stay on --url (default: ${READ_URL_ENV_VAR}; see docs/guides/configuration.md)",
    )


def _database(url: str, from_env: bool, option: str, env_var: str) -> Database:
    from sqlalchemy.exc import ArgumentError

    source = f"${env_var}" if from_env else option
    shown = _shown(url)
    netloc = urllib.parse.urlsplit(url).netloc if "://" in url and "[" not in url else ""
    if netloc.count("@") > 1:
        raise CliError(
            f"cannot parse the database URL of {source} ({shown}): it has more than one '@'; "
            f"expected {URL_SHAPE}, with an '@' in the user name or password written as %40",
            EXIT_USAGE,
        )
    try:
        parsed = parse_url(url)
    except URLError as e:  # it says what is wrong (a host list, a JDBC URL); make_url's errors do not
        raise CliError(f"{source}: {one_line(e)}", EXIT_USAGE) from None
    except (ArgumentError, ValueError):
        raise CliError(
            f"cannot parse the database URL of {source} ({shown}): expected {URL_SHAPE}", EXIT_USAGE
        ) from None
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise CliError(
            f"the database URL of {source} is not a PostgreSQL URL ({shown}): expected {URL_SHAPE}",
            EXIT_USAGE,
        )
    try:
        conninfo = libpq_url(parsed)
    except URLError as e:
        raise CliError(f"{source}: {one_line(e)}", EXIT_USAGE) from None
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        raise CliError(
            f"cannot use the database URL of {source} ({shown}): {one_line(e)}; expected {URL_SHAPE}",
            EXIT_USAGE,
        ) from None
    if from_env:
        fix_url: str | None = f'"${env_var}"'
    else:
        fix_url = None if secrets_in(["--url", url]) or parsed.password else shlex.quote(shown)
    return Database(conninfo, shown, fix_url, params)


def open_connection(db: Database) -> psycopg.Connection[Any]:
    """An autocommit connection.

    Raises:
      CliError: If the server cannot be reached or refuses the connection.
    """
    try:
        if db.params.get("connect_timeout"):  # the URL's own, checked by libpq
            return connect(db.conninfo, autocommit=True)
        return connect(db.conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
    except psycopg.OperationalError as e:
        raise _connection_error(e, db) from e


def open_read_connection(
    read_db: Database, schema: str, primary: Database, **check: Any
) -> psycopg.Connection[Any]:
    """An autocommit connection to the server of ``--read-url``, its schema checked.

    ``check`` goes to ``migrations.check_schema`` (``minimum=``, ``reader=``: the dashboard reads
    older schemas than the broker needs).

    Raises:
      CliError: As :func:`open_connection`, the line starting with ``the read URL (...)``; or
        the schema is missing or older there (the fix names ``primary``'s URL: migrations run
        on the primary and reach a standby by replication).
    """
    try:
        conn = open_connection(read_db)
    except CliError as e:
        raise CliError(f"the read URL ({read_db.shown}): {e.message}", e.exit_code) from e.__cause__
    try:
        check_schema(conn, schema, url=read_db.shown, fix_url=primary.fix_url, **check)
    except BaseException:
        conn.close()
        raise
    return conn


#: libpq's refusal of a server that is not what ``target_session_attrs`` asks for.
_WRONG_KIND = re.compile(r"session is (?:not )?read-only|server is (?:not )?in hot standby mode")
#: libpq's refusal of a connection parameter's value (``invalid sslmode value: "bogus"``).
_INVALID_PARAMETER = re.compile(r'invalid (\w+) value: ("[^"]*")')


def _connection_error(e: psycopg.OperationalError, db: Database) -> CliError:
    detail = libpq_detail(e)
    text = str(e)
    user = db.params.get("user") or login_name()
    dbname = db.params.get("dbname") or user
    where = f"PostgreSQL at {db.server}"
    reason = rejection_reason(e, server=db.server, user=str(user), dbname=str(dbname))
    if reason is not None:
        return CliError(reason)
    invalid = _INVALID_PARAMETER.search(text)
    if invalid is not None:
        # libpq refused a parameter of the URL before any connection: a malformed URL.
        return CliError(
            f"the database URL ({db.shown}) has an invalid {invalid.group(1)} value: {invalid.group(2)}. "
            f"Fix it (expected {URL_SHAPE}, with the parameters libpq documents)",
            EXIT_USAGE,
        )
    wrong_kind = _WRONG_KIND.search(text)
    if wrong_kind is not None:
        # Checked before "Connection refused": with several hosts, the text lists every attempt.
        wanted = db.params.get("target_session_attrs")
        return CliError(
            f"cannot connect to {where}: none of its servers is what target_session_attrs={wanted} "
            f"asks for (libpq: {wrong_kind.group(0)}). Check which server is the primary now, "
            "and the hosts and target_session_attrs of the URL"
        )
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


def server_down(error: BaseException | None) -> bool:
    """Whether a failed connection attempt means the server is down (refused, silent, starting).

    Unlike a rejection (credentials, role, database, ``pg_hba.conf``), waiting can fix it.
    """
    if not isinstance(error, psycopg.OperationalError):
        return False
    text = str(error)
    if rejection_reason(error, server="", user="", dbname="") is not None:
        return False
    return any(
        sign in text
        for sign in (
            "Connection refused",
            "No such file or directory",
            "timeout expired",
            "the database system is starting up",
            "the database system is shutting down",
        )
    )


@contextmanager
def checked_connection(
    args: argparse.Namespace,
) -> Iterator[tuple[psycopg.Connection[Any], AdminStore, Database]]:
    """(connection, the schema's operator statements, database) once the schema is known to be current."""
    db = database_from(args)
    with open_connection(db) as conn:
        try:
            check_schema(conn, args.schema, url=db.shown, fix_url=db.fix_url)
            yield conn, AdminStore(args.schema), db
        except psycopg.errors.InsufficientPrivilege as e:
            raise permission_error(e, role=conn.info.user, schema=args.schema) from e


#: PostgreSQL's refusal: ``permission denied for table messages`` (English ``lc_messages``).
_DENIED = re.compile(r"permission denied for (table|schema|function|sequence|view|relation) (\S+)")


def operator_name() -> str:
    """Who runs the command, for the audit trail: the OS user (``getpass.getuser()``)."""
    import getpass

    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def record_action(
    conn: psycopg.Connection[Any], schema: str, *, action: str, target: str, count: int, detail: str = ""
) -> None:
    """Write the audit row of a command's action and log it (logger ``dramatiq_pg_outbox.audit``)."""
    operator = operator_name()
    AdminStore(schema).record_audit(
        conn, operator=operator, source="cli", action=action, target=target, count=count, detail=detail
    )
    log_action(operator, "cli", action, target, count)


def log_action(operator: str, source: str, action: str, target: str, count: int) -> None:
    """The log line of an audited action (logger ``dramatiq_pg_outbox.audit``, INFO)."""
    import logging

    logging.getLogger("dramatiq_pg_outbox.audit").info(
        "%s by %s (%s): %s, %d row(s)", action, operator, source, target, count
    )


def selection_text(args: argparse.Namespace) -> str:
    """How the audit trail names a selection of dead letters: ``queue=Q actor=A``, or ``all``."""
    parts = [f"{name}={value}" for name, value in (("queue", args.queue), ("actor", args.actor)) if value]
    return " ".join(parts) or "all"


def permission_error(e: psycopg.errors.InsufficientPrivilege, *, role: str, schema: str) -> CliError:
    """One line naming the role, the object it may not use and the grant that fixes it.

    The operator commands run as the role that owns the broker's tables (``dramatiq_owner``
    in docs/security.md); a role without ``USAGE`` on the schema gets that grant named.
    """
    found = _DENIED.search(str(e))
    if found is None:
        return CliError(
            f"permission denied for role {role!r}: {one_line(e)}. Run the command as the role that owns "
            f"the tables of schema {schema!r}, or GRANT dramatiq_owner TO {role} (see docs/security.md)"
        )
    kind, name = found.group(1), found.group(2)
    if kind == "schema":
        return CliError(
            f"permission denied: role {role!r} may not use schema {name}. "
            f"Run: GRANT USAGE ON SCHEMA {name} TO {role}, or run the command as the owner of its "
            "tables (see docs/security.md)"
        )
    where = name if "." in name else f"{schema}.{name}"
    return CliError(
        f"permission denied: role {role!r} may not use {kind} {where} as this command needs. Run it as "
        f"the role that owns the tables of schema {schema!r}, or GRANT dramatiq_owner TO {role} (the "
        "owner role of docs/security.md)"
    )


# -- output helpers ---------------------------------------------------------------------


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str], numeric: Sequence[int] = ()) -> None:
    """Print ``rows`` under ``header`` in aligned columns; the ``numeric`` columns right-aligned."""
    cells = [list(header)] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        line = "  ".join(
            v.rjust(w) if i in numeric else v.ljust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=True))
        )
        print(line.rstrip())


def format_queue_list(queues: Sequence[str]) -> str:
    """``default, emails``: Dramatiq's delay queues (``emails.DQ``) are the same rows as their queue."""
    return ", ".join(dict.fromkeys(q_name(q) for q in queues))


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 3)].rstrip() + "..."


# -- subcommands ------------------------------------------------------------------------------


def print_json(value: Any) -> None:
    """``value`` as JSON on standard output: times in ISO 8601 (UTC), Decimals as numbers."""

    def convert(item: Any) -> Any:
        if isinstance(item, datetime.datetime):
            return item.astimezone(datetime.timezone.utc).isoformat()
        if isinstance(item, decimal.Decimal):
            return float(item)
        raise TypeError(f"not JSON: {type(item).__name__}")

    print(json.dumps(value, default=convert, indent=2))
