"""``dramatiq-pg-outbox dashboard``: a web dashboard for operators.

Queues, workers, dead letters (search, payload, traceback; retry one or
many), charts of throughput and latency per actor, and the actions retry,
purge a queue and cancel a message (waiting, or running: its worker stops it).  Starlette + Jinja2, served by
uvicorn; needs the ``dashboard`` extra
(``pip install 'dramatiq-pg-outbox[dashboard]'``).

The application is :func:`dramatiq_pg_outbox.dashboard.app.create_app`; the
``dashboard`` subcommand that serves it is in :mod:`dramatiq_pg_outbox.cli.dashboard`.
"""

from __future__ import annotations

#: Environment variables read when the matching option is not given (keeps secrets out of ``ps``).
TOKEN_ENV = "DRAMATIQ_PG_OUTBOX_DASHBOARD_TOKEN"
BASIC_AUTH_ENV = "DRAMATIQ_PG_OUTBOX_DASHBOARD_BASIC_AUTH"
USERS_FILE_ENV = "DRAMATIQ_PG_OUTBOX_DASHBOARD_USERS_FILE"

__all__ = ["BASIC_AUTH_ENV", "TOKEN_ENV", "USERS_FILE_ENV"]
