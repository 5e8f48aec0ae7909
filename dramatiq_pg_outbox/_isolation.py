"""Every connection the package opens runs its statements at READ COMMITTED, whatever the defaults.

The package's statements are written for READ COMMITTED: a statement (and each
statement inside a PL/pgSQL function such as ``reclaim_messages()``) sees what
was committed when it started.  A server, database or role default
(``default_transaction_isolation``), or one in the URL (``options=-c ...``, or
Django's ``OPTIONS["options"]`` copied into the broker's URL) would otherwise
give them one snapshot for a whole transaction.

:func:`read_committed` sets it up on each new connection:

- A transaction psycopg begins (``conn.transaction()``, or any statement of a
  connection that is not in autocommit) starts with ``BEGIN ISOLATION LEVEL READ
  COMMITTED``: the connection's ``isolation_level``.  Said per transaction, it
  holds behind PgBouncer's transaction pooling too, at no cost.
- A statement run alone on an autocommit connection (most of the broker's:
  sends outside ``outbox()``, claims, acks) runs in an implicit transaction at the
  session's default.  On a direct connection (``pin_read_committed`` in
  queries.sql: the backend's pid is the one announced at connect) that default is
  set to READ COMMITTED once, at connect: no cost per statement, and psycopg keeps
  preparing the statements (their generic plans save the claim's planning).
  Through a pooler that shares server connections (PgBouncer's transaction pooling
  announces a pid of its own), a session setting would stay on one server
  connection and reach other clients, so nothing is set and each such statement is
  sent as ``BEGIN ISOLATION LEVEL READ COMMITTED; <statement>; COMMIT``, one query
  (:class:`ReadCommittedCursor`).

Measured (2 vCPU shared, PostgreSQL 15 on localhost, a one-row ``SELECT`` with one
parameter on an autocommit connection, nothing prepared; a short script, 15 x 500
calls each): alone 95 us at best (102 median); as one query with its ``BEGIN`` and
``COMMIT`` 105 (117); in a psycopg pipeline 170 (191); in psycopg's transaction 291
(339).  Through a proxy that delays each server answer by 5 ms: 5.6, 5.5, 5.7 and
16.3 ms, so one round trip for all but psycopg's transaction (``BEGIN``, statement
and ``COMMIT`` each wait for their answer).  A pipeline was also tried and left:
pipelining every lone statement of the broker cost its ``send()`` about 150 us of
client CPU (175 -> 330 us), and psycopg sends a Flush after the pipeline's Sync
when the answers are not all in, which PgBouncer 1.18 answers by keeping a server
connection linked to the client (``test_the_readme_pgbouncer_snippet_runs_as_written``
then waited 30 s for its one server connection, 1 run in 3).

Statements that run in the application's own transaction (``outbox()``, the
Django outbox) run at the application's level; docs/guarantees.md,
"Isolation levels".
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import IsolationLevel
from psycopg.pq import TransactionStatus
from psycopg.rows import Row

from ._queries import raw_queries

#: The level every connection of the package runs its transactions at.
LEVEL = IsolationLevel.READ_COMMITTED


def _alone(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """Whether a statement on ``conn`` would run in an implicit transaction of its own."""
    return (
        conn.autocommit
        and conn._pipeline is None  # in a pipeline (executemany's) a statement is only queued
        and conn.pgconn.transaction_status == TransactionStatus.IDLE
    )


def _in_transaction(statement: str) -> str:
    """``statement`` between ``BEGIN ISOLATION LEVEL READ COMMITTED`` and ``COMMIT``: one query."""
    queries = raw_queries()
    return f"{queries['begin_read_committed']};\n{statement};\n{queries['commit']}"


class ReadCommittedCursor(psycopg.Cursor[Row]):
    """A cursor whose statements run at READ COMMITTED on an autocommit connection too.

    Outside a transaction of an autocommit connection, :meth:`execute` sends
    ``BEGIN ISOLATION LEVEL READ COMMITTED; <statement>; COMMIT`` as one query
    of the simple protocol (one round trip), its parameters bound on the client
    (psycopg's ``ClientCursor``; nothing is prepared), and leaves the cursor on
    the statement's result; on error the transaction is rolled back and the
    statement's error raised.  (Not a pipeline: psycopg may send a Flush after
    the pipeline's Sync, which PgBouncer 1.18 in transaction pooling answers by
    keeping a server connection linked to the client, idle, until it sends again.)
    :meth:`executemany`, there, runs in a transaction of psycopg's.  Inside a
    transaction both run as psycopg's cursor does.
    """

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> ReadCommittedCursor[Row]:
        conn = self._conn
        if not _alone(conn):
            super().execute(query, params, prepare=prepare, binary=binary)
        elif (
            binary
        ):  # the simple protocol returns text only: psycopg's transaction, BEGIN ISOLATION LEVEL ...
            with conn.transaction():
                super().execute(query, params, prepare=prepare, binary=binary)
        else:
            statement = psycopg.ClientCursor(conn).mogrify(query, params)
            try:
                super().execute(_in_transaction(statement), prepare=False)
            except BaseException:
                roll_back(conn)
                raise
            self.nextset()  # from BEGIN's result to the statement's
        return self

    def executemany(self, query: Any, params_seq: Any, *, returning: bool = False) -> None:
        conn = self._conn
        if not _alone(conn):
            super().executemany(query, params_seq, returning=returning)
            return
        with conn.transaction():
            super().executemany(query, params_seq, returning=returning)


class AsyncReadCommittedCursor(psycopg.AsyncCursor[Row]):
    """:class:`ReadCommittedCursor` for asyncio connections (the dashboard's)."""

    async def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> AsyncReadCommittedCursor[Row]:
        conn = self._conn
        if not _alone(conn):
            await super().execute(query, params, prepare=prepare, binary=binary)
        elif binary:
            async with conn.transaction():
                await super().execute(query, params, prepare=prepare, binary=binary)
        else:
            statement = psycopg.AsyncClientCursor(conn).mogrify(query, params)
            try:
                await super().execute(_in_transaction(statement), prepare=False)
            except BaseException:
                if not conn.closed and conn.pgconn.transaction_status != TransactionStatus.IDLE:
                    try:
                        await conn.rollback()
                    except psycopg.Error:
                        pass
                raise
            self.nextset()
        return self


def roll_back(conn: psycopg.Connection[Any]) -> None:
    """Roll back the transaction a failed query of the package's own ``BEGIN`` left open, if any.

    For a wrapped lone statement here, and the window rate limiter's transaction
    (``store.rate_limits``).  The query's error is what counts: the rollback's own
    (a connection already lost) is swallowed.
    """
    if not conn.closed and conn.pgconn.transaction_status != TransactionStatus.IDLE:
        try:
            conn.rollback()
        except psycopg.Error:
            pass


def read_committed(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """Make ``conn`` run every transaction and every lone statement at READ COMMITTED.

    Sets psycopg's ``isolation_level`` (no round trip); on an autocommit connection,
    runs ``pin_read_committed`` (one round trip) and, where that could not set the
    session's default, pipelines each lone statement with its ``BEGIN`` and ``COMMIT``
    (:class:`ReadCommittedCursor`).  Returns ``conn``.

    Raises:
      psycopg.Error: If that statement fails (``conn`` is then closed).
    """
    conn.isolation_level = LEVEL
    if conn.autocommit:
        try:
            pinned = conn.execute(raw_queries()["pin_read_committed"], {"backend_pid": conn.info.backend_pid})
            if pinned.fetchone() is None:
                conn.cursor_factory = ReadCommittedCursor
        except BaseException:
            conn.close()
            raise
    return conn


async def read_committed_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """:func:`read_committed` for an asyncio connection (a pool's ``configure``)."""
    await conn.set_isolation_level(LEVEL)
    if conn.autocommit:
        params = {"backend_pid": conn.info.backend_pid}
        try:
            pinned = await conn.execute(raw_queries()["pin_read_committed"], params)
            if await pinned.fetchone() is None:
                conn.cursor_factory = AsyncReadCommittedCursor
        except BaseException:
            await conn.close()
            raise


def connect(conninfo: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect(conninfo, **kwargs)``, made :func:`read_committed`.

    Raises:
      psycopg.OperationalError: If the server cannot be reached or refuses the connection.
    """
    return read_committed(psycopg.connect(conninfo, **kwargs))


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether :func:`read_committed` found an autocommit ``conn`` behind a pooler.

    True when the backend's pid was not the one announced at connect (PgBouncer, in any
    pool mode, announces a key of its own), so that the session's default was not set;
    False on a direct connection, and for a connection :func:`read_committed` has not seen.
    """
    factory = conn.cursor_factory
    return isinstance(factory, type) and issubclass(factory, ReadCommittedCursor)
