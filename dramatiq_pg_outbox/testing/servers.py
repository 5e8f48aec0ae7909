"""Picking a server for a run (environment, Docker, local, throwaway) and scratch databases."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import secrets
from collections.abc import Iterator
from typing import Any

import psycopg

from ..store.admin import ServerStore
from ..urls import libpq_url, mask_password, parse_url
from .binaries import DOCKER_IMAGE, LOCAL_SERVER_URL, driverless_url
from .throwaway import ThrowawayPostgres

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Picking a server
# --------------------------------------------------------------------------


def server_is_reachable(url: str, timeout: float = 2.0) -> bool:
    """Tell whether a PostgreSQL server accepts a connection and runs ``SELECT 1``.

    Parameters:
      url(str): A libpq URL; a SQLAlchemy driver suffix
        (``postgresql+psycopg://``) is accepted.
      timeout(float): Connection timeout in seconds (libpq rounds up to
        whole seconds, with a minimum of 2).

    Returns:
      bool: True if the connection and query succeeded.
    """
    try:
        with psycopg.connect(
            driverless_url(url), connect_timeout=max(1, round(timeout)), autocommit=True
        ) as conn:
            ServerStore().ping(conn)
        return True
    except (psycopg.Error, OSError) as exc:
        logger.debug("%s is not reachable: %s", mask_password(url), exc)
        return False


def docker_engine_reachable(timeout: float = 3.0) -> bool:
    """Ping the Docker engine (fails fast when there is none)."""
    try:
        docker: Any = importlib.import_module("docker")
        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception as exc:
        logger.debug("No Docker engine: %s", exc)
        return False


@contextlib.contextmanager
def _docker_postgres() -> Iterator[str | None]:
    """Yield the URL of a testcontainers PostgreSQL container, or None if none can start."""
    if not docker_engine_reachable():
        yield None
        return
    container: Any = None
    url: str | None = None
    try:
        module: Any = None
        for name in ("testcontainers.community.postgres", "testcontainers.postgres"):
            with contextlib.suppress(ImportError):
                module = importlib.import_module(name)
                break
        if module is None:
            raise ImportError("testcontainers[postgres] is not installed")
        container = module.PostgresContainer(
            DOCKER_IMAGE, username="postgres", password="postgres", dbname="postgres", driver=None
        )
        container.start()
        url = str(container.get_connection_url(driver=None))
    except Exception as exc:
        logger.debug("Could not start a PostgreSQL container: %s", exc, exc_info=True)
        if container is not None:
            with contextlib.suppress(Exception):
                container.stop()
    if url is None:
        yield None
        return
    try:
        yield url
    finally:
        container.stop()


@contextlib.contextmanager
def postgres_server(
    env_var: str = "DATABASE_URL", *, allow_local: bool = True, allow_docker: bool = True
) -> Iterator[str]:
    """Provide a PostgreSQL server for tests, examples and benchmarks.

    The first that works, in this order:

    1. the URL in ``os.environ[env_var]``, if set and not empty;
    2. a ``postgres:16-alpine`` container (testcontainers), if
       ``allow_docker`` and a Docker engine answers;
    3. the local server ``postgresql://postgres@127.0.0.1:5432/postgres``,
       if ``allow_local`` and it accepts a connection;
    4. a :class:`ThrowawayPostgres`.

    Whatever it started is stopped on exit.  The choice is logged at
    INFO level, with any password masked.

    Examples:

      >>> with postgres_server() as url:  # doctest: +SKIP
      ...     engine = create_engine(url)

    Parameters:
      env_var(str): Environment variable that may hold a URL.
      allow_local(bool): Whether the local server on port 5432 may be used.
      allow_docker(bool): Whether a Docker container may be started.

    Raises:
      RuntimeError: If a throwaway server is needed but cannot start.

    Returns:
      Iterator[str]: A context manager yielding a superuser (admin) URL.
    """
    url = os.environ.get(env_var)
    if url:
        logger.info("Using PostgreSQL from $%s: %s", env_var, mask_password(url))
        yield url
        return

    if allow_docker:
        with _docker_postgres() as docker_url:
            if docker_url is not None:
                logger.info("Using a %s container: %s", DOCKER_IMAGE, mask_password(docker_url))
                yield docker_url
                return

    if allow_local and server_is_reachable(LOCAL_SERVER_URL):
        logger.info("Using the local PostgreSQL server: %s", LOCAL_SERVER_URL)
        yield LOCAL_SERVER_URL
        return

    with ThrowawayPostgres() as server:
        logger.info("Using a throwaway PostgreSQL server in %s: %s", server.tmp_dir, server.url)
        yield server.url


@contextlib.contextmanager
def scratch_database(admin_url: str, prefix: str = "scratch") -> Iterator[str]:
    """A fresh database on the server of ``admin_url``, dropped (with its connections) at exit.

    Parameters:
      admin_url(str): URL of a role allowed to create databases (any PostgreSQL URL form).
      prefix(str): Start of the database name, followed by ``_`` and 8 random hex digits.

    Returns:
      Iterator[str]: The new database's URL (``postgresql://``), with the admin's credentials.
    """
    admin = parse_url(admin_url)
    admin_dsn = libpq_url(admin)
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        ServerStore().create_database(conn, name=name)
    try:
        yield libpq_url(admin.set(database=name))
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            ServerStore().drop_database(conn, name=name)
