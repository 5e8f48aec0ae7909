"""What an outbox writes on the application's connection: the messages, the schema check, after_enqueue."""

from __future__ import annotations

import contextlib
import shlex
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from dramatiq import Middleware
from psycopg import pq
from sqlalchemy.engine import Connection
from sqlalchemy.engine.base import TwoPhaseTransaction

from .._runtime import StoredMessage, enqueue_result, enqueue_statement
from ..broker import PostgresBroker
from ..migrations import schema_not_ready
from ..store.messages import EnqueueRow, message_store
from ..urls import safe_url


@dataclass
class OutboxWrite:
    """What one statement stored, for the after-commit steps."""

    broker: PostgresBroker
    stored: list[StoredMessage]
    payloads: list[str]
    #: (row id, message id) of the rows, when they were written inside a savepoint that
    #: may still roll back (connections only): checked at commit.
    ids: list[tuple[int, str]] = field(default_factory=list)
    #: The transaction id, for a two-phase transaction's wake-up on a Connection.
    xid: str | None = None
    #: Whether ``after_enqueue`` runs for ``stored`` after the commit (a Connection's: only when a
    #: middleware of the broker overrides it).
    announce: bool = True
    #: Written in a two-phase transaction: PostgreSQL cannot PREPARE a transaction that ran
    #: NOTIFY, so the wake-up is sent after the second phase, from the broker's connection.
    twophase: bool = False

    @property
    def notify_after_commit(self) -> bool:
        """Whether the wake-up is sent after the commit (never in the transaction)."""
        notify = self.broker.options.notify
        return notify == "after_commit" or (self.twophase and notify != "off")

    @property
    def notify_at_commit(self) -> bool:
        """Whether a Connection's wake-up is sent by the dialect's ``do_commit`` once the COMMIT
        returned: after commit, not two-phase (whose COMMIT PREPARED may come from another
        session: see ``xid``), and a message stored."""
        return self.notify_after_commit and not self.twophase and bool(self.payloads and self.stored)


class DriverCursor:
    """A SQLAlchemy connection seen as a DB-API cursor (``exec_driver_sql``), for the stores.

    The statement runs through SQLAlchemy, so its events and the connection's
    transaction apply as to any other statement of the application.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.rows: Sequence[Sequence[Any]] = []

    def execute(self, query: str, params: Mapping[str, Any] | None = None, /) -> DriverCursor:
        result = self.conn.exec_driver_sql(query, dict(params) if params is not None else None)
        self.rows = result.fetchall() if result.returns_rows else []
        return self

    def fetchall(self) -> Sequence[Sequence[Any]]:
        return self.rows


#: The databases (the engine's URL, and as text without its password) whose revision of the
#: broker's schema was checked, per broker.
_schema_checked: weakref.WeakKeyDictionary[PostgresBroker, set[object]] = weakref.WeakKeyDictionary()


def check_schema(conn: Connection, broker: PostgresBroker) -> None:
    """Raise :class:`SchemaNotReady` if the broker's tables are missing or old on ``conn``'s database."""
    url = conn.engine.url
    checked = _schema_checked.setdefault(broker, set())
    if url in checked:
        return  # the common case: a lookup (safe_url costs ~20 us per send)
    key = safe_url(url)
    if key in checked:
        checked.add(url)
        return
    row = message_store(broker.schema).schema_revision(DriverCursor(conn))
    # The command names the bind's database, or $DATABASE_URL when its URL has a password.
    fix_url = None if conn.engine.url.password else shlex.quote(key)
    error = schema_not_ready(broker.schema, row, url=key, fix_url=fix_url)
    if error is not None:
        raise error
    checked.update((key, url))


def write_items(
    conn: Connection, broker: PostgresBroker, items: list[StoredMessage], return_ids: bool = False
) -> OutboxWrite:
    """Insert ``items`` through ``conn``, in its transaction, with one statement."""
    check_schema(conn, broker)
    twophase = isinstance(conn.get_transaction(), TwoPhaseTransaction)
    statement = enqueue_statement(
        items,
        broker.channel,
        broker.options.notify == "transaction" and not twophase,
        broker.options.max_fetch_interval,
        return_ids,
    )
    rows = message_store(broker.schema).enqueue(DriverCursor(conn), statement)
    result = enqueue_result(statement.name, items, rows)
    return OutboxWrite(broker, result.stored, result.payloads, result.ids, twophase=twophase)


def pipeline_supported(dbapi_connection: Any) -> bool:
    """Whether ``dbapi_connection`` can send the outbox's INSERT with its COMMIT (:func:`write_with_commit`).

    A sync psycopg 3 connection in a transaction (not autocommit), with a libpq that
    has pipeline mode (14 or later).
    """
    return (
        isinstance(dbapi_connection, psycopg.Connection)
        and not dbapi_connection.autocommit
        and psycopg.Pipeline.is_supported()
    )


#: The states of a connection whose transaction a failed :func:`write_with_commit` left open.
_OPEN = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


def write_with_commit(
    dbapi_connection: psycopg.Connection[Any],
    groups: dict[PostgresBroker, list[StoredMessage]],
    commit: Callable[[], None],
) -> list[OutboxWrite]:
    """Insert each broker's messages and commit, in one round trip (pipeline mode).

    One message of one broker is written by libpq's pipeline directly
    (``MessageStore.enqueue_one_and_commit``), anything else by psycopg's.

    The INSERTs are queued, then a COMMIT, and the whole is sent at once (with one
    Sync); ``commit`` (the dialect's ``do_commit``) then finds the connection idle and
    sends nothing.  The INSERTs' rows are read once the COMMIT has succeeded.  If an INSERT fails, PostgreSQL
    skips the COMMIT that follows it in the pipeline: the error is raised, and the
    transaction, aborted, is rolled back here, as a failed COMMIT would have
    ended it (so is a transaction left open by any other failure before the
    COMMIT).  Nothing of the transaction is committed.

    Raises:
      psycopg.Error: What the server refused (an INSERT, or the COMMIT itself).
    """
    statements = [
        (
            broker,
            items,
            enqueue_statement(
                items,
                broker.channel,
                broker.options.notify == "transaction",
                broker.options.max_fetch_interval,
            ),
        )
        for broker, items in groups.items()
    ]
    # One send (the common case) goes through libpq's pipeline directly (store/libpq.py): the
    # same messages without psycopg's pipeline machinery.
    one = (
        len(statements) == 1
        and statements[0][2].name == "enqueue_one"
        and dbapi_connection.pgconn.pipeline_status == pq.PipelineStatus.OFF
    )
    rows: list[list[EnqueueRow]] = []
    cursors: list[psycopg.Cursor[Any]] = []
    try:
        if one:
            broker, _, statement = statements[0]
            rows.append(message_store(broker.schema).enqueue_one_and_commit(dbapi_connection, statement))
        else:
            with dbapi_connection.pipeline():
                for broker, _, statement in statements:
                    cursors.append(psycopg.Cursor(dbapi_connection))
                    message_store(broker.schema).enqueue_send(cursors[-1], statement)
                # Queued, not Connection.commit(): that one waits for its own Sync, and leaving
                # the pipeline would wait for another.
                message_store(statements[0][0].schema).commit_send(psycopg.Cursor(dbapi_connection))
        commit()  # the connection is idle now: the driver's commit() has nothing to send
    except BaseException:
        if dbapi_connection.info.transaction_status in _OPEN:
            with contextlib.suppress(psycopg.Error):
                dbapi_connection.rollback()
        raise
    if not one:  # psycopg's pipeline: each statement's rows, read once the pipeline was synced
        rows = [
            message_store(broker.schema).enqueue_rows(cursor)
            for (broker, _, _), cursor in zip(statements, cursors, strict=True)
        ]
    written = []
    for (broker, items, statement), stored_rows in zip(statements, rows, strict=True):
        result = enqueue_result(statement.name, items, stored_rows)
        written.append(OutboxWrite(broker, result.stored, result.payloads, result.ids))
    return written


def by_broker(
    items: Iterable[tuple[PostgresBroker, StoredMessage]],
) -> dict[PostgresBroker, list[StoredMessage]]:
    groups: dict[PostgresBroker, list[StoredMessage]] = {}
    for broker, item in items:
        groups.setdefault(broker, []).append(item)
    return groups


def emit_after_enqueue(written: OutboxWrite) -> None:
    for item in written.stored:
        written.broker.emit_after("enqueue", item.message, item.delay or None)


def wants_after_enqueue(broker: PostgresBroker) -> bool:
    """Whether a middleware of ``broker`` overrides Dramatiq's no-op ``after_enqueue``."""
    return any(type(m).after_enqueue is not Middleware.after_enqueue for m in broker.middleware)


# -- sessions -------------------------------------------------------------------
