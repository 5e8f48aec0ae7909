"""One statement and the COMMIT in one round trip, written with libpq's pipeline directly.

The outbox's common case is one ``send()`` in an application transaction: the
``enqueue_one`` INSERT and the application's COMMIT.  psycopg's ``Connection.pipeline()``
sends them in one round trip, but its Python machinery (the pipeline object, two cursors,
their queues, the result sets) was most of the write's client CPU: the write took 339 us
per transaction that way and 204 us with the same messages queued here through
``psycopg.pq`` (``python -m benchmarks.profile_outbox_send``, part 1; benchmarks/README.md
section 34).  This is the hot path the project owns: the rest stays with psycopg.

What psycopg would have done is kept:

- the statement is a named prepared statement of the connection, parsed once and kept
  in psycopg's own map of prepared statements, so that psycopg's ``DEALLOCATE ALL``
  (after a rollback, a ``DROP``, an ``ALTER``) makes the next send parse it again; a
  connection that does not prepare (``prepare_threshold=None``, as behind PgBouncer's
  transaction pooling) gets it unnamed every time;
- a server error is raised as psycopg's exception for its SQLSTATE
  (``psycopg.errors.error_from_result``), after the pipeline's Sync has been read, so the
  connection is left usable: an INSERT that fails makes the server skip the COMMIT (the
  transaction stays aborted for the caller to roll back); a COMMIT that fails has ended
  the transaction;
- a lost connection raises psycopg's ``OperationalError`` (libpq's ``consume_input``).

Limit, shared with psycopg's own prepared statements: a ``DEALLOCATE ALL`` or ``DISCARD
ALL`` that psycopg does not see (sent by a pooler, or through ``conn.pgconn``) drops the
statement; the next send's transaction then fails with ``InvalidSqlStatementName`` and
is rolled back, as a psycopg statement prepared before it would.
"""

from __future__ import annotations

import contextlib
import re
import select
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq

#: The OIDs of the parameter types this module sends (``pg_type``).
TEXT, BIGINT, SMALLINT, BOOLEAN, BYTEA = 25, 20, 21, 16, 17

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True)
class Numbered:
    """A ``%(name)s`` query rewritten with ``$n`` placeholders, for libpq.

    ``names``: the parameters in ``$n`` order; ``types``: their type OIDs (``BYTEA``
    goes in binary format, the others as text); ``name``: the prepared statement's name.
    """

    sql: bytes
    names: tuple[str, ...]
    types: tuple[int, ...]
    name: bytes

    @classmethod
    def of(cls, query: str, types: Mapping[str, int], name: str) -> Numbered:
        """Number the placeholders of ``query`` (psycopg's ``%%`` becomes ``%``).

        Raises:
          KeyError: If a placeholder has no type in ``types``.
        """
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in names:
                names.append(match.group(1))
            return f"${names.index(match.group(1)) + 1}"

        sql = _PLACEHOLDER.sub(number, query).replace("%%", "%")
        return cls(sql.encode(), tuple(names), tuple(types[n] for n in names), name.encode())

    def encode(self, params: Mapping[str, Any]) -> tuple[list[bytes | None], list[int]]:
        """The values of ``params`` in libpq's form, and their formats (1: binary)."""
        values: list[bytes | None] = []
        formats: list[int] = []
        for name, oid in zip(self.names, self.types, strict=True):
            value = params[name]
            if value is None:
                values.append(None)
                formats.append(0)
            elif oid == BYTEA:
                values.append(bytes(value))
                formats.append(1)
            elif oid == BOOLEAN:
                values.append(b"t" if value else b"f")
                formats.append(0)
            elif oid == TEXT:
                values.append(str(value).encode())
                formats.append(0)
            else:
                values.append(str(int(value)).encode())
                formats.append(0)
        return values, formats


def text_array(values: Sequence[str]) -> str:
    """PostgreSQL's text form of a ``text[]`` holding ``values`` (each quoted, ``"`` and ``\\`` escaped)."""
    quoted = ('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
    return "{" + ",".join(quoted) + "}"


def execute_and_commit(
    conn: psycopg.Connection[Any], statement: Numbered, params: Mapping[str, Any]
) -> list[tuple[bytes | None, ...]]:
    """Run ``statement`` then ``COMMIT`` on ``conn`` in one round trip; the statement's rows.

    ``conn`` must be in a transaction, outside psycopg's pipeline mode. Each row is a tuple of
    the columns' values in text format (``None`` for NULL); their decoding is the caller's.

    Raises:
      psycopg.Error: The server's error (the statement's, or the COMMIT's), or
        ``OperationalError`` if the connection was lost.
    """
    values, formats = statement.encode(params)
    with conn.lock:
        pgconn = conn.pgconn
        names = _psycopg_names(conn)
        key = (b"-- " + statement.name, ())
        parse = names is not None and key not in names
        pgconn.enter_pipeline_mode()
        try:
            if parse:
                pgconn.send_prepare(statement.name, statement.sql, statement.types)
            if names is not None:
                pgconn.send_query_prepared(statement.name, values, formats)
            else:
                pgconn.send_query_params(statement.sql, values, statement.types, formats)
            pgconn.send_query_params(b"COMMIT", None)
            pgconn.pipeline_sync()
            results = _round_trip(pgconn)
        finally:
            # Fails only where the round trip did (results left unread, a lost connection):
            # that error is the one raised.
            with contextlib.suppress(psycopg.Error):
                pgconn.exit_pipeline_mode()
        if parse:
            parsed, *results = results
            if names is not None and parsed.status == pq.ExecStatus.COMMAND_OK:
                names[key] = statement.name
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    rows = results[0]
    return [tuple(rows.get_value(r, c) for c in range(rows.nfields)) for r in range(rows.ntuples)]


def _psycopg_names(conn: psycopg.Connection[Any]) -> MutableMapping[Any, bytes] | None:
    """psycopg's map of the connection's prepared statements, or None: send unnamed.

    The statement is entered there, under a key no query of psycopg's can have, so that it
    lives and dies with psycopg's own: psycopg sends ``DEALLOCATE ALL`` after a rollback,
    a ``DROP`` or an ``ALTER`` (a table may come back with other columns) and empties the
    map; the next send finds its entry gone and parses the statement again. psycopg's
    least-recently-used eviction (``prepared_max``) deallocates it like its own. None when
    the connection does not prepare (``prepare_threshold=None``, as behind PgBouncer's
    transaction pooling) or when a psycopg version keeps the map elsewhere (this reads
    ``Connection._prepared._names``, as psycopg 3.3 keeps it; should a version move it, sends
    go unnamed and ``tests/test_outbox_one_send.py`` fails).
    """
    if conn.prepare_threshold is None:
        return None
    names = getattr(getattr(conn, "_prepared", None), "_names", None)
    return names if isinstance(names, MutableMapping) else None


def _round_trip(pgconn: pq.abc.PGconn) -> list[pq.abc.PGresult]:
    """Send what is queued, then read every result up to the pipeline's Sync (not included)."""
    fd = pgconn.socket
    poller = select.poll()  # not select(): it refuses a descriptor >= 1024
    if pgconn.flush():
        poller.register(fd, select.POLLOUT)
        while pgconn.flush():
            poller.poll()
        poller.unregister(fd)
    poller.register(fd, select.POLLIN)
    results: list[pq.abc.PGresult] = []
    while True:
        while pgconn.is_busy():
            poller.poll()
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            continue  # the end of one statement's results
        if result.status == pq.ExecStatus.PIPELINE_SYNC:
            return results
        results.append(result)
