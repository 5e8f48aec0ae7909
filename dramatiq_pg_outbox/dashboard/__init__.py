"""``dramatiq-pg-outbox dashboard``: a web dashboard for operators.

Queues, workers, dead letters (search, payload, traceback; retry one or
many), charts of throughput and latency per actor, and the actions retry,
purge a queue and cancel a waiting message.  Starlette + Jinja2, served by
uvicorn; needs the ``dashboard`` extra
(``pip install 'dramatiq-pg-outbox[dashboard]'``).

This module only holds the command line (:func:`add_parser`, :func:`run`), so
that ``dramatiq-pg-outbox --help`` works without the extra; the application
is :func:`dramatiq_pg_outbox.dashboard.app.create_app`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Sequence
from typing import Any

#: Environment variables read when the matching option is not given (keeps secrets out of ``ps``).
TOKEN_ENV = "DRAMATIQ_PG_OUTBOX_DASHBOARD_TOKEN"
BASIC_AUTH_ENV = "DRAMATIQ_PG_OUTBOX_DASHBOARD_BASIC_AUTH"

_INSTALL_HINT = "pip install 'dramatiq-pg-outbox[dashboard]'"


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be 1-65535, not {port}")
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
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8080, help="port to bind (default: 8080)")
    parser.add_argument("--read-only", action="store_true", help="hide and refuse every action")
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
    return parser


def _fail(message: str) -> int:
    print(f"dramatiq-pg-outbox dashboard: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Serve the dashboard until interrupted (Ctrl-C, SIGTERM).  Returns the exit code.

    Expected failures (no URL, bad options, the extra missing, the database
    unreachable or not migrated) print one line on stderr and return 1 or 2.
    """
    # An option given on the command line wins; otherwise the environment (both set: an error).
    token, basic = args.token, args.basic_auth
    if token is None and basic is None:
        token, basic = os.environ.get(TOKEN_ENV) or None, os.environ.get(BASIC_AUTH_ENV) or None
        if token and basic:
            return _fail(f"both ${TOKEN_ENV} and ${BASIC_AUTH_ENV} are set: choose one")
    basic_auth = None
    if basic is not None:
        user, sep, password = basic.partition(":")
        if not sep or not user or not password:
            return _fail("basic auth must be USER:PASSWORD, both non-empty")
        basic_auth = (user, password)
    if not args.url:
        return _fail("no database URL: pass --url or set DATABASE_URL")
    try:
        import uvicorn

        from .app import Settings, create_app
    except ImportError as e:
        return _fail(f"the dashboard needs its extra ({e.name} is missing): {_INSTALL_HINT}")
    from .._urls import mask_password

    try:
        settings = Settings(
            url=args.url, schema=args.schema, read_only=args.read_only, token=token, basic_auth=basic_auth
        )
        _check_database(settings)
    except (ValueError, RuntimeError) as e:
        return _fail(mask_password(str(e)))
    if settings.auth == "none" and not _is_loopback(args.host):
        print(
            f"dramatiq-pg-outbox dashboard: warning: serving on {args.host} without auth; "
            f"set ${TOKEN_ENV} or ${BASIC_AUTH_ENV}",
            file=sys.stderr,
        )
    mode = "read-only" if settings.read_only else "actions enabled"
    print(
        f"dashboard of {mask_password(args.url)} schema {settings.schema!r} ({mode}, auth: {settings.auth}) "
        f"on http://{args.host}:{args.port}/",
        flush=True,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info", server_header=False)
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_database(settings: Any) -> None:
    """Connect once and check the schema; a ``RuntimeError`` with the fix when it is not usable."""
    import psycopg

    from ..migrations import libpq_url, parse_schema_revision, quote_ident
    from .store import MIN_SCHEMA_REVISION, queries_for_schema

    fix = f"dramatiq-pg-outbox migrate --url <DATABASE_URL> --schema {settings.schema}"
    try:
        with psycopg.connect(libpq_url(settings.url), connect_timeout=10) as conn:
            row = conn.execute(
                queries_for_schema(settings.schema)["schema_revision"],
                {"table": f"{quote_ident(settings.schema)}.messages"},
            ).fetchone()
    except psycopg.Error as e:
        raise RuntimeError(f"cannot query the database: {str(e).strip()}") from None
    exists, comment = row if row else (False, None)
    revision = parse_schema_revision(comment)
    if not exists:
        raise RuntimeError(f"no dramatiq-pg-outbox tables in schema {settings.schema!r}. Run: {fix}")
    if revision is None or revision < MIN_SCHEMA_REVISION:
        raise RuntimeError(
            f"schema {settings.schema!r} is at revision {revision}, the dashboard needs "
            f"{MIN_SCHEMA_REVISION} or later. Run: {fix}"
        )


__all__ = ["BASIC_AUTH_ENV", "TOKEN_ENV", "add_parser", "run"]
