"""Transactional enqueue (the outbox): ``actor.send()`` inside an application transaction.

Usage::

    with Session(engine) as session:
        with outbox(session):
            session.add(user)
            send_welcome_email.send(user.id)
        session.commit()          # the message exists iff this commits

    async with AsyncSession(async_engine) as session:
        async with outbox(session):
            ...
        await session.commit()

Inside the block, ``send()`` only buffers the message (no I/O, so nothing
blocks an event loop).  The buffer is written through the bound session's or
connection's own connection, in its transaction, as one multi-row INSERT:
when the block exits normally, or at the latest just before the transaction
commits.  A rollback discards it.  The insert's ``pg_notify`` is delivered at
commit, so a worker wakes within milliseconds of the commit and never sees a
message whose transaction did not commit.

Supported binds: SQLAlchemy ``Session``, ``Connection``, ``AsyncSession`` and
``AsyncConnection`` using the psycopg (3) or psycopg2 driver.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from ._queries import queries_for_schema
from ._runtime import enqueue_statement
from .errors import OutboxError

if TYPE_CHECKING:
    from dramatiq import Message

    from .broker import PostgresBroker

#: What :func:`outbox` binds to.
Bind = Session | Connection | AsyncSession | AsyncConnection
_current: ContextVar[Outbox | None] = ContextVar("dramatiq_pg_outbox_current", default=None)
_INFO_KEY = "dramatiq_pg_outbox.pending"


def current_outbox() -> Outbox | None:
    """The binding active in this context (thread or asyncio task), if any."""
    return _current.get()


def outbox(bind: Bind, broker: PostgresBroker | None = None) -> Outbox:
    """Bind ``actor.send()`` to a SQLAlchemy transaction for the duration of a ``with`` block.

    Parameters:
      bind(Session|Connection|AsyncSession|AsyncConnection): Where messages are written.
      broker(PostgresBroker): Defaults to ``dramatiq.get_broker()``.

    Raises:
      OutboxError: If the broker is not a PostgresBroker, or the bind is not supported.

    Returns:
      Outbox: A context manager: ``with`` for sync binds, ``async with`` for async ones.
    """
    from .broker import PostgresBroker

    if broker is None:
        import dramatiq

        broker = dramatiq.get_broker()  # type: ignore[assignment]
    if not isinstance(broker, PostgresBroker):
        raise OutboxError(
            f"outbox() needs a PostgresBroker, not {broker!r}; pass broker= or set_broker() it."
        )
    return Outbox(bind, broker)


class _Pending:
    """Messages buffered for one session or connection, written before it commits."""

    def __init__(self, broker: PostgresBroker) -> None:
        self.broker = broker
        self.items: list[tuple[Message[Any], int]] = []
        self.notify_queues: set[str] = set()

    def write(self, conn: Connection) -> None:
        if not self.items:
            return
        items, self.items = self.items, []
        notify_in_txn = self.broker.notify == "transaction"
        name, params = enqueue_statement(items, self.broker.channel, notify_in_txn)
        # The broker's pool is not touched: the write uses the application's connection.
        conn.exec_driver_sql(queries_for_schema(self.broker.schema)[name], params)
        if self.broker.notify == "after_commit":
            self.notify_queues.update(m.queue_name for m, d in items if d == 0)

    def after_commit(self) -> None:
        if self.notify_queues:
            queues, self.notify_queues = sorted(self.notify_queues), set()
            # Non-blocking: the flush loop sends it from the broker's own connection.
            self.broker.runtime.flusher.notify_later(queues)

    def discard(self) -> None:
        self.items.clear()
        self.notify_queues.clear()


#: Buffered messages of each bound Connection (dropped with the Connection).
_connection_pending: weakref.WeakKeyDictionary[Connection, _Pending] = weakref.WeakKeyDictionary()


def _pending_for_session(session: Session, broker: PostgresBroker) -> _Pending:
    pending = session.info.get(_INFO_KEY)
    if pending is None:
        pending = session.info[_INFO_KEY] = _Pending(broker)
        event.listen(session, "before_commit", lambda s: pending.write(s.connection()))
        event.listen(session, "after_commit", lambda s: pending.after_commit())
        # after_soft_rollback fires on every rollback() call, even before any SQL ran.
        event.listen(session, "after_soft_rollback", lambda s, previous: pending.discard())
    return pending


def _pending_for_connection(conn: Connection, broker: PostgresBroker) -> _Pending:
    # Keyed by the Connection object, not kept in ``conn.info``: that dict belongs to the
    # pooled DBAPI connection, so the next checkout (a new Connection) would find a _Pending
    # whose commit/rollback listeners sit on the previous Connection and never fire.
    pending = _connection_pending.get(conn)
    if pending is None:
        pending = _connection_pending[conn] = _Pending(broker)
        # ConnectionEvents.commit fires before the DBAPI commit, with the transaction still open.
        event.listen(conn, "commit", lambda c: pending.write(c))
        event.listen(conn, "rollback", lambda c: pending.discard())
    return pending


class Outbox:
    """A transactional-enqueue binding; create it with :func:`outbox`."""

    def __init__(self, bind: Bind, broker: PostgresBroker) -> None:
        if not isinstance(bind, (Session, Connection, AsyncSession, AsyncConnection)):
            raise OutboxError(
                f"outbox() binds a SQLAlchemy Session, Connection or their async forms, not {bind!r}"
            )
        self.bind = bind
        self.broker = broker
        self._token: Token[Outbox | None] | None = None
        self._pending: _Pending | None = None

    @property
    def is_async(self) -> bool:
        return isinstance(self.bind, (AsyncSession, AsyncConnection))

    def _sync_bind(self) -> Session | Connection:
        bind = self.bind
        if isinstance(bind, AsyncSession):
            return bind.sync_session
        if isinstance(bind, AsyncConnection):
            return bind.sync_connection  # type: ignore[return-value]
        return bind

    def _attach(self) -> None:
        bind = self._sync_bind()
        if isinstance(bind, Session):
            self._pending = _pending_for_session(bind, self.broker)
        else:
            self._pending = _pending_for_connection(bind, self.broker)
        self._token = _current.set(self)

    def _detach(self) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None

    def add(self, message: Message[Any], delay: int) -> None:
        """Buffer one message (called by ``PostgresBroker.enqueue``)."""
        assert self._pending is not None
        bind = self._sync_bind()
        if isinstance(bind, Connection) and not bind.in_transaction():
            # Connection.commit() is a no-op without a transaction: begin one
            # (no I/O; the DBAPI begins implicitly) so the commit event fires.
            bind.begin()
        self._pending.items.append((message, delay))

    def _write_sync(self, bind: Session | Connection) -> None:
        assert self._pending is not None
        conn = bind.connection() if isinstance(bind, Session) else bind
        self._pending.write(conn)

    def __enter__(self) -> Outbox:
        if self.is_async:
            raise OutboxError("This bind is async: use `async with outbox(session):`.")
        self._attach()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._detach()
        bind = self._sync_bind()
        if exc_type is None:
            self._write_sync(bind)
        else:
            self._keep_or_discard(bind)

    def _keep_or_discard(self, bind: Session | Connection) -> None:
        # On error the buffer stays with the transaction in progress: written
        # if it still commits, discarded if it rolls back.  With no transaction
        # in progress nothing can commit alongside these messages: drop them.
        assert self._pending is not None
        if not bind.in_transaction():
            self._pending.discard()

    async def __aenter__(self) -> Outbox:
        if not self.is_async:
            raise OutboxError("This bind is sync: use `with outbox(session):`.")
        self._attach()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._detach()
        if exc_type is not None:
            self._keep_or_discard(self._sync_bind())
            return
        assert isinstance(self.bind, (AsyncSession, AsyncConnection))
        await self.bind.run_sync(self._write_sync)
