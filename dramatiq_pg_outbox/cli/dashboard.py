"""``dramatiq-pg-outbox dashboard``: serve the web dashboard (the application is
:func:`dramatiq_pg_outbox.dashboard.app.create_app`; this module imports it only when the
subcommand runs, so ``dramatiq-pg-outbox --help`` works without the ``dashboard`` extra)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from ..dashboard import BASIC_AUTH_ENV, TOKEN_ENV, USERS_FILE_ENV
from ..migrations import check_schema
from .common import (
    EXIT_USAGE,
    CliError,
    add_read_url,
    database_from,
    open_connection,
    open_read_connection,
    read_database_from,
)

_INSTALL_HINT = "pip install 'dramatiq-pg-outbox[dashboard]'"


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"port must be 0-65535 (0: any free port), not {port}")
    return port


def add_parser(subparsers: Any, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
    """Register the ``dashboard`` subcommand on an ``argparse`` subparsers object.

    Parameters:
      subparsers: What ``ArgumentParser.add_subparsers()`` returned.
      parents(Sequence[ArgumentParser]): Shared options (the CLI's ``--url``, ``--schema``,
        ``--debug``); without them the subcommand defines its own ``--url`` and ``--schema``.

    Returns:
      argparse.ArgumentParser: The subcommand's parser (``args.command == "dashboard"``).
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "dashboard",
        help="serve the web dashboard",
        description="Serve the web dashboard (queues, workers, dead letters, charts; retry, purge, cancel).",
        parents=list(parents),
    )
    parser.set_defaults(run=run)
    if not parents:
        parser.add_argument(
            "--url", default=os.environ.get("DATABASE_URL"), help="PostgreSQL URL ($DATABASE_URL)"
        )
        parser.add_argument("--schema", default="dramatiq", help="schema of the tables (default: dramatiq)")
    add_read_url(parser, "the pages")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--port", type=_port, default=8080, help="port to bind (default: 8080; 0: any free port, printed)"
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name browsers use to reach the dashboard (repeatable; '*.example.com' matches "
        "subdomains). Always allowed: localhost, 127.0.0.1, [::1] and --host; "
        "required with --host 0.0.0.0 or ::",
    )
    parser.add_argument("--read-only", action="store_true", help="hide and refuse every action")
    parser.add_argument(
        "--refresh",
        type=int,
        default=5,
        metavar="SECONDS",
        help="update the queues, queue, workers and schedules pages every SECONDS (default: 5; 0: never)",
    )
    parser.add_argument(
        "--results-namespace",
        default="dramatiq-results",
        metavar="NAME",
        help="the namespace of the results backend whose results a finished message's page shows "
        "(default: dramatiq-results, Dramatiq's)",
    )
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument(
        "--token",
        help=f"require this token (Bearer header or the login page); prefer ${TOKEN_ENV}, "
        "which does not show in ps",
    )
    auth.add_argument(
        "--basic-auth",
        metavar="USER:PASSWORD",
        help=f"require HTTP basic auth; prefer ${BASIC_AUTH_ENV}, which does not show in ps",
    )
    auth.add_argument(
        "--users-file",
        metavar="PATH",
        help="named users, each with a role (read-only or operator) and a token or basic-auth "
        f"password stored as its SHA-256: one NAME:ROLE:KIND:sha256:HEX a line (or ${USERS_FILE_ENV})",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve the dashboard until interrupted (Ctrl-C, SIGTERM).  Returns the exit code.

    Expected failures (no URL or a bad one, bad options, the extra missing, the
    database unreachable, the schema missing or too old, the port taken) raise
    the CLI's ``CliError``: one line on stderr and exit code 1 or 2, reported by
    ``dramatiq_pg_outbox.cli.main.main`` as for every subcommand.

    The dashboard reads schemas of revision :data:`~.store.MIN_SCHEMA_REVISION`
    (3) or later on purpose (its queries use only the tables and views of
    0001-0003), so it can be deployed before a schema is upgraded.
    """

    # An option given on the command line wins; otherwise the environment (both set: an error).
    token, basic, users_file = args.token, args.basic_auth, args.users_file
    if token is None and basic is None and users_file is None:
        token, basic = os.environ.get(TOKEN_ENV) or None, os.environ.get(BASIC_AUTH_ENV) or None
        users_file = os.environ.get(USERS_FILE_ENV) or None
        if sum(value is not None for value in (token, basic, users_file)) > 1:
            raise CliError(
                f"more than one of ${TOKEN_ENV}, ${BASIC_AUTH_ENV} and ${USERS_FILE_ENV} is set: choose one",
                EXIT_USAGE,
            )
    basic_auth = None
    if basic is not None:
        user, sep, password = basic.partition(":")
        if not sep or not user or not password:
            raise CliError("basic auth must be USER:PASSWORD, both non-empty", EXIT_USAGE)
        basic_auth = (user, password)
    db = database_from(args)
    read_db = read_database_from(args)
    try:
        import uvicorn

        from ..dashboard.app import MIN_SCHEMA_REVISION, Settings, create_app
        from ..dashboard.security import load_users
    except ImportError as e:
        raise CliError(f"the dashboard needs its extra ({e.name} is missing): {_INSTALL_HINT}") from None
    allowed_hosts = allowed_host_names(args.host, args.allowed_host)
    try:
        users = load_users(users_file) if users_file is not None else ()
    except ValueError as e:
        raise CliError(f'{e}; see docs/guides/dashboard.md, "Users and roles"', EXIT_USAGE) from None
    try:
        settings = Settings(
            url=db.conninfo,
            schema=args.schema,
            read_only=args.read_only,
            token=token,
            basic_auth=basic_auth,
            users=users,
            allowed_hosts=allowed_hosts,
            refresh=args.refresh,
            results_namespace=args.results_namespace,
            read_url=None if read_db is None else read_db.conninfo,
        )
    except ValueError as e:
        raise CliError(str(e).rstrip("."), EXIT_USAGE) from None
    with open_connection(db) as conn:
        check_schema(
            conn,
            settings.schema,
            url=db.shown,
            fix_url=db.fix_url,
            minimum=MIN_SCHEMA_REVISION,
            reader="the dashboard",
        )
    if read_db is not None:
        open_read_connection(
            read_db, settings.schema, db, minimum=MIN_SCHEMA_REVISION, reader="the dashboard"
        ).close()
    sock = _listen(args.host, args.port)
    port = sock.getsockname()[1]
    if settings.auth == "none" and not _is_loopback(args.host):
        print(
            f"dramatiq-pg-outbox dashboard: warning: serving on {args.host} without auth; "
            f"set ${TOKEN_ENV} or ${BASIC_AUTH_ENV}",
            file=sys.stderr,
        )
    mode = "read-only" if settings.read_only else "actions enabled"
    if users:
        operators = sum(user.may_act for user in users)
        mode += f"; {len(users)} user(s), {operators} operator(s)"
    reads = "" if read_db is None else f", read from {read_db.shown}"
    print(
        f"dashboard of {db.shown} schema {settings.schema!r}{reads} ({mode}, auth: {settings.auth}) "
        f"on http://{args.host}:{port}/",
        flush=True,
    )
    config = uvicorn.Config(
        create_app(settings), host=args.host, port=port, log_level="info", server_header=False
    )
    with sock:
        uvicorn.Server(config).run(sockets=[sock])
    return 0


#: Addresses that listen on every interface: the Host names must be named.
_WILDCARDS = ("0.0.0.0", "::", "")


def allowed_host_names(host: str, given: list[str]) -> tuple[str, ...]:
    """The Host names answered: the loopback names, ``--host`` unless a wildcard, ``--allowed-host``.

    Raises:
      CliError: Usage error (exit 2) for a wildcard ``--host`` without ``--allowed-host``.
    """
    from ..dashboard.app import LOOPBACK_HOSTS

    if host in _WILDCARDS and not given:
        raise CliError(
            f"--host {host or '0.0.0.0'} answers on every interface: name the host names browsers use, "
            "e.g. --allowed-host dashboard.example.com (repeatable)",
            EXIT_USAGE,
        )
    names = [*LOOPBACK_HOSTS, *([] if host in _WILDCARDS else [host]), *given]
    return tuple(dict.fromkeys(name.lower() for name in names))


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket for uvicorn, bound here so that a taken port is one line (as ``metrics``)."""

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}. Choose another --port") from None
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["add_parser", "run"]
