"""What an outbox writes on the application's connection: the messages, the schema check, after_enqueue."""

from __future__ import annotations

import shlex
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dramatiq import Middleware
from sqlalchemy.engine import Connection
from sqlalchemy.engine.base import TwoPhaseTransaction

from .._runtime import StoredMessage, enqueue_result, enqueue_statement
from ..broker import PostgresBroker
from ..migrations import schema_not_ready
from ..store.messages import message_store
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
    #: The transaction id, for ``notify="after_commit"`` (or two-phase) on a Connection.
    xid: str | None = None
    #: Written in a two-phase transaction: PostgreSQL cannot PREPARE a transaction that ran
    #: NOTIFY, so the wake-up is sent after the second phase, from the broker's connection.
    twophase: bool = False

    @property
    def notify_after_commit(self) -> bool:
        """Whether the wake-up is sent after the commit (never in the transaction)."""
        notify = self.broker.options.notify
        return notify == "after_commit" or (self.twophase and notify != "off")


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


#: (engine URL, schema) pairs whose revision was checked, per broker.
_schema_checked: weakref.WeakKeyDictionary[PostgresBroker, set[str]] = weakref.WeakKeyDictionary()


def _check_schema(conn: Connection, broker: PostgresBroker) -> None:
    """Raise :class:`SchemaNotReady` if the broker's tables are missing or old on ``conn``'s database."""
    key = safe_url(conn.engine.url)
    checked = _schema_checked.setdefault(broker, set())
    if key in checked:
        return
    row = message_store(broker.schema).schema_revision(DriverCursor(conn))
    # The command names the bind's database, or $DATABASE_URL when its URL has a password.
    fix_url = None if conn.engine.url.password else shlex.quote(key)
    error = schema_not_ready(broker.schema, row, url=key, fix_url=fix_url)
    if error is not None:
        raise error
    checked.add(key)


def write_items(
    conn: Connection, broker: PostgresBroker, items: list[StoredMessage], return_ids: bool = False
) -> OutboxWrite:
    """Insert ``items`` through ``conn``, in its transaction, with one statement."""
    _check_schema(conn, broker)
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
