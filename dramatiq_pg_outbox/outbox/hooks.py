"""The SQLAlchemy events an outbox listens to: Session transactions, Connection commits, savepoints, 2PC.

Messages added inside a transaction are kept per root transaction (Session) or
per connection (Connection) and written before the commit; after_enqueue runs
once the database commit is done; a rollback (of a savepoint too) drops them.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Dialect, Engine, Transaction
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.orm.session import SessionTransactionState
from sqlalchemy.pool import PoolProxiedConnection

from .._runtime import StoredMessage
from ..broker import PostgresBroker
from ..errors import OutboxError
from ..store.messages import message_store
from .writes import (
    DriverCursor,
    OutboxWrite,
    by_broker,
    check_schema,
    emit_after_enqueue,
    pipeline_supported,
    wants_after_enqueue,
    write_items,
    write_with_commit,
)


@dataclass
class _SessionBuffer:
    """Messages of one root SessionTransaction, each with the (root or nested) one it was sent in."""

    items: list[tuple[SessionTransaction, PostgresBroker, StoredMessage]] = field(default_factory=list)
    written: list[OutboxWrite] = field(default_factory=list)
    #: Set by before_commit: messages sent from now on (flush hooks) are written at once,
    #: or with the COMMIT (``carrier``).
    committing: bool = False
    #: The pooled connection whose COMMIT carries the messages (see ``_commit_carrier``), from
    #: before_commit on; None: they are written by before_commit itself.
    carrier: PoolProxiedConnection | None = None

    def take(self) -> dict[PostgresBroker, list[StoredMessage]]:
        """The buffered messages, by broker, removed from the buffer."""
        items, self.items = self.items, []
        return by_broker((broker, item) for _, broker, item in items)


#: Buffers by root SessionTransaction (dropped with it).
_session_buffers: weakref.WeakKeyDictionary[SessionTransaction, _SessionBuffer] = weakref.WeakKeyDictionary()
_listeners_lock = threading.Lock()
_session_listeners_installed = False


def install_session_listeners() -> None:
    """Listen to every Session's transaction events, once per process (on first ``outbox()``).

    Class-level listeners cost nothing at Session creation (instance listeners
    measured ~59 us per Session), and return at once for sessions without
    buffered messages.
    """
    global _session_listeners_installed
    if _session_listeners_installed:
        return
    with _listeners_lock:
        if not _session_listeners_installed:
            event.listen(Session, "before_commit", _session_before_commit)
            event.listen(Session, "after_commit", _session_after_commit)
            event.listen(Session, "after_soft_rollback", _session_after_soft_rollback)
            event.listen(Session, "after_transaction_end", _session_after_transaction_end)
            _session_listeners_installed = True


# -- the end of a transaction -------------------------------------------------------
#
# A send from a listener of the end of the bound transaction cannot join it: the database
# has committed or rolled it back (a Session's after_* events), or is about to roll it back
# (a Connection's rollback event).  Outbox.joinable() says so, and the broker writes the
# message through its pool, as outside outbox().  Whatever the order of the listeners:
# the state of the transaction tells, not a mark left by one of the outbox's own listeners.

#: States of a root SessionTransaction whose database transaction is over.
_ENDED = (SessionTransactionState.COMMITTED, SessionTransactionState.DEACTIVE, SessionTransactionState.CLOSED)


def _code(method: Any) -> CodeType:
    """The code object of ``method``, under SQLAlchemy's state-checking decorator if any."""
    return getattr(method, "__wrapped__", method).__code__  # type: ignore[no-any-return]


#: The methods in which a root SessionTransaction, already detached from its Session, reports
#: its end (after_transaction_end in close(), after_soft_rollback in rollback()).
_SESSION_ENDS = frozenset(_code(m) for m in (SessionTransaction.close, SessionTransaction.rollback))
#: The method that runs a Connection's rollback listeners, then sends ROLLBACK.
_CONNECTION_ROLLBACK = _code(Connection._rollback_impl)
#: The method that runs a Connection's rollback_savepoint listeners, then sends ROLLBACK TO SAVEPOINT.
_CONNECTION_ROLLBACK_TO = _code(Connection._rollback_to_savepoint_impl)


def session_joinable(session: Session) -> bool:
    """Whether a message sent now can join ``session``'s transaction (see ``Outbox.joinable``)."""
    root = session.get_transaction()
    if root is not None:
        # COMMITTED: in after_commit.  DEACTIVE: rolled back in the database (after_rollback,
        # or a failed flush waiting for rollback()).  A savepoint's end leaves the root ACTIVE.
        return root._state not in _ENDED
    # No transaction: an idle session (the send begins one), or a root transaction that has
    # just ended and is reporting it: find its close() or rollback() on the stack.
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _SESSION_ENDS:
            transaction = frame.f_locals.get("self")
            if (
                isinstance(transaction, SessionTransaction)
                and transaction.parent is None
                and getattr(transaction, "session", None) is session
            ):
                return False
        frame = frame.f_back  # type: ignore[assignment]
    return True


def connection_joinable(conn: Connection) -> bool:
    """Whether a message sent now can join ``conn``'s transaction: not from its rollback listeners."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CONNECTION_ROLLBACK and frame.f_locals.get("self") is conn:
            return False
        frame = frame.f_back  # type: ignore[assignment]
    return True


def _rolling_back_to(conn: Connection) -> str | None:
    """The savepoint of ``conn`` whose rollback_savepoint listeners are running now, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CONNECTION_ROLLBACK_TO and frame.f_locals.get("self") is conn:
            return str(frame.f_locals.get("name"))
        frame = frame.f_back  # type: ignore[assignment]
    return None


def session_add(session: Session, broker: PostgresBroker, items: list[StoredMessage]) -> None:
    try:
        session.get_bind()  # no I/O: the default bind, where the messages are written at commit
    except UnboundExecutionError:
        raise OutboxError(
            f"outbox() cannot tell which database of {session!r} the messages belong to: it has no "
            "default bind (only binds={...} per mapper or table). Give it one for the broker's database, "
            "Session(bind=engine, binds={...}), or bind outbox() to a Connection of that database"
        ) from None
    root = session.get_transaction() or session.begin()
    scope = session.get_nested_transaction()
    while scope is not None and not scope.is_active:
        # A savepoint rolled back in the database, reporting it (after_rollback): the message
        # belongs to the enclosing scope.
        scope = scope.parent
    scope = scope or root
    buffer = _session_buffers.get(root)
    if buffer is None:
        buffer = _session_buffers[root] = _SessionBuffer()
    if buffer.committing and buffer.carrier is not None:
        # Sent by a flush hook during commit: it joins the messages that go with the COMMIT.
        check_schema(session.connection(), broker)
        buffer.items.extend((root, broker, item) for item in items)
    elif buffer.committing:
        # Sent by a flush hook during commit: the buffer was already written.
        buffer.written.append(write_items(session.connection(), broker, items))
    else:
        buffer.items.extend((scope, broker, item) for item in items)


def _root_of(transaction: SessionTransaction) -> SessionTransaction:
    while transaction.parent is not None:
        transaction = transaction.parent
    return transaction


def _is_within(transaction: SessionTransaction, ancestor: SessionTransaction) -> bool:
    current: SessionTransaction | None = transaction
    while current is not None:
        if current is ancestor:
            return True
        current = current.parent
    return False


def _session_before_commit(session: Session) -> None:
    if session.get_nested_transaction() is not None:
        return  # a savepoint is released: its messages now belong to the enclosing transaction
    root = session.get_transaction()
    if root is None:
        return
    buffer = _session_buffers.get(root)
    if buffer is None:
        buffer = _session_buffers[root] = _SessionBuffer()
    buffer.committing = True
    if buffer.items:
        conn = session.connection()
        carrier = _commit_carrier(session, conn)
        if carrier is not None:
            # Written by the dialect's do_commit in the COMMIT's round trip (_hook_commit).
            for broker in {broker: None for _, broker, _ in buffer.items}:
                check_schema(conn, broker)
            buffer.carrier = carrier
            carrier.info[_AT_COMMIT] = buffer
            return
        for broker, stored in buffer.take().items():
            buffer.written.append(write_items(conn, broker, stored))


def _commit_carrier(session: Session, conn: Connection) -> PoolProxiedConnection | None:
    """The pooled connection whose COMMIT can carry the session's messages, if any.

    One whose ``COMMIT`` the session itself sends through the dialect's
    ``do_commit`` (its default bind is an Engine, so the session began the
    connection's transaction; not two-phase), on a sync psycopg 3 connection
    (``pipeline_supported``): the INSERT then rides in the COMMIT's round trip.
    Any other (a Session bound to a Connection, whose transaction may outlive the
    session's commit; psycopg2; an AsyncSession's driver): None, and the
    messages are written by before_commit, through SQLAlchemy.
    """
    if session.twophase or not isinstance(session.get_bind(), Engine):
        return None
    carrier = conn.connection
    if not pipeline_supported(carrier.dbapi_connection):
        return None
    _hook_dialect(conn.engine.dialect)
    return carrier


def _session_after_commit(session: Session) -> None:
    if session.get_nested_transaction() is not None:
        return
    root = session.get_transaction()
    buffer = _session_buffers.pop(root, None) if root is not None else None
    if buffer is None:
        return
    for written in buffer.written:
        emit_after_enqueue(written)
        if written.notify_after_commit and written.payloads:
            # Non-blocking: the flush loop sends it from the broker's own connection.
            written.broker.runtime.flusher.notify_later(written.payloads)


def _session_after_soft_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    # The database rolled back to the nearest savepoint (or the root) at or above the
    # transaction that was rolled back: every message sent inside that one is gone.
    boundary = previous_transaction
    while boundary.parent is not None and not boundary.nested:
        boundary = boundary.parent
    root = _root_of(boundary)
    buffer = _session_buffers.get(root)
    if buffer is None:
        return
    if boundary is root:
        del _session_buffers[root]
        _drop_carried(buffer)
        return
    buffer.items = [entry for entry in buffer.items if not _is_within(entry[0], boundary)]


def _session_after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        # Committed (already written), rolled back, or closed without either.
        buffer = _session_buffers.pop(transaction, None)
        if buffer is not None:
            _drop_carried(buffer)


def _drop_carried(buffer: _SessionBuffer) -> None:
    """Make sure no later COMMIT carries ``buffer`` (do_commit or do_rollback took it already, unless
    the transaction ended without either)."""
    carrier = buffer.carrier
    if carrier is not None and carrier.info.get(_AT_COMMIT) is buffer:
        carrier.info.pop(_AT_COMMIT, None)


# -- connections -----------------------------------------------------------------
#
# A Connection's savepoints begin eagerly, and SQLAlchemy names a savepoint only
# after its begin event (and lets an outer one end before an inner one), so the
# buffer does not try to mirror them: at every savepoint begin, the messages
# buffered so far are written before the SAVEPOINT is sent, and from then on
# PostgreSQL decides what a ROLLBACK TO undoes.  The invariant: every buffered
# message was sent after every savepoint still open began, so a savepoint
# rollback discards the whole (unwritten) buffer and a release keeps it.


@dataclass
class _ConnectionBuffer:
    """Messages of one Connection's current transaction."""

    root: Transaction | None = None
    #: Sent since the last write, not yet written.
    items: list[tuple[PostgresBroker, StoredMessage]] = field(default_factory=list)
    #: Written at savepoint begins; their after-commit steps wait for the commit.
    written: list[OutboxWrite] = field(default_factory=list)
    #: Set once the buffer was written before COMMIT: a message sent from a later commit
    #: listener is written at once.
    committing: bool = False
    #: Sent from a rollback_savepoint listener, with that savepoint's name: they belong to the
    #: enclosing scope, so that savepoint's rollback keeps them (whatever the listeners' order).
    late: list[tuple[str, PostgresBroker, StoredMessage]] = field(default_factory=list)

    def reset(self, root: Transaction | None = None) -> None:
        self.root = root
        self.items = []
        self.written = []
        self.committing = False
        self.late = []

    def write(self, conn: Connection) -> None:
        """Write the buffered messages through ``conn`` (kept for a retry if that fails)."""
        if self.late:
            self.items[:0] = [(broker, item) for _, broker, item in self.late]
            self.late = []
        if not self.items:
            return
        # Rows written inside a savepoint may still be rolled back with it: keep their ids.
        inside = conn.in_nested_transaction()
        items, self.items = self.items, []
        try:
            for broker, stored in by_broker(items).items():
                self.written.append(write_items(conn, broker, stored, return_ids=inside))
        except BaseException:
            self.items = items + self.items
            raise


_connection_buffers: weakref.WeakKeyDictionary[Connection, _ConnectionBuffer] = weakref.WeakKeyDictionary()
_engines_listened: weakref.WeakSet[Engine] = weakref.WeakSet()
_dialects_hooked: weakref.WeakSet[Dialect] = weakref.WeakSet()
#: Key, in a pooled DBAPI connection's ``info``, of what its current database transaction
#: stored that waits for its COMMIT: a list of :class:`OutboxWrite`.
_AFTER_COMMIT = "dramatiq_pg_outbox.after_commit"
#: Key, in a pooled DBAPI connection's ``info``, of the Session buffer whose messages its next
#: COMMIT carries (``_commit_carrier``).
_AT_COMMIT = "dramatiq_pg_outbox.at_commit"


def install_engine_listeners(engine: Engine) -> None:
    """Listen to the transaction events of every connection of ``engine``, once per engine."""
    if engine in _engines_listened:
        return
    with _listeners_lock:
        if engine not in _engines_listened:
            event.listen(engine, "savepoint", _connection_savepoint)
            event.listen(engine, "rollback_savepoint", _connection_rollback_savepoint)
            event.listen(engine, "commit", _connection_commit)
            event.listen(engine, "rollback", _connection_rollback)
            event.listen(engine, "prepare_twophase", _connection_prepare_twophase)
            event.listen(engine, "commit_twophase", _connection_commit_twophase)
            event.listen(engine, "rollback_twophase", _connection_rollback_twophase)
            _hook_commit(engine.dialect)
            _engines_listened.add(engine)


def _hook_dialect(dialect: Dialect) -> None:
    """``_hook_commit`` on ``dialect``, once (for Sessions, which need no engine events)."""
    if dialect in _dialects_hooked:
        return
    with _listeners_lock:
        _hook_commit(dialect)


def _hook_commit(dialect: Dialect) -> None:
    """Make ``dialect`` run ``after_enqueue`` for what a transaction stored once its COMMIT succeeded.

    A Connection has no after-commit event: its ``commit`` event fires before
    ``COMMIT`` is sent, and ``handle_error`` reports a failed COMMIT but nothing
    reports a successful one.  ``Dialect.do_commit`` and ``do_rollback`` are what
    SQLAlchemy (the Connection, and the pool when it resets a connection) calls
    with the pooled DBAPI connection to end its database transaction, so this
    dialect's (an engine's own instance, shared by its ``execution_options()``
    copies) are wrapped, once: what ``_connection_commit`` left in the DBAPI
    connection's ``info`` runs after a COMMIT that returned, and is dropped by a
    COMMIT that raised or by a ROLLBACK.  A commit or rollback with nothing left
    pays one dictionary lookup.  Called under ``_listeners_lock``.
    """
    if dialect in _dialects_hooked:
        return
    commit, rollback = dialect.do_commit, dialect.do_rollback
    commit_twophase, rollback_twophase = dialect.do_commit_twophase, dialect.do_rollback_twophase

    def do_commit(dbapi_connection: PoolProxiedConnection) -> None:
        stored = _take_after_commit(dbapi_connection)
        carried = _take_at_commit(dbapi_connection)
        if carried is not None and carried.items:
            # A Session's messages: inserted in the COMMIT's round trip; its after_commit
            # listener announces them.
            carried.written.extend(
                write_with_commit(
                    dbapi_connection.dbapi_connection,  # type: ignore[arg-type]
                    carried.take(),
                    lambda: commit(dbapi_connection),
                )
            )
        else:
            commit(dbapi_connection)  # raises if the COMMIT fails: ``stored`` is dropped
        for written in stored:
            if written.notify_at_commit:
                written.broker.runtime.flusher.notify_later(written.payloads)
            if written.announce:
                emit_after_enqueue(written)

    def do_rollback(dbapi_connection: PoolProxiedConnection) -> None:
        _take_after_commit(dbapi_connection)
        _take_at_commit(dbapi_connection)
        rollback(dbapi_connection)

    # Two-phase: COMMIT PREPARED / ROLLBACK PREPARED (a commit without PREPARE goes through do_commit).
    def do_commit_twophase(
        connection: Connection, xid: Any, is_prepared: bool = True, recover: bool = False
    ) -> None:
        stored = _take_after_commit(connection.connection)
        commit_twophase(connection, xid, is_prepared, recover)
        for written in stored:
            if written.announce:  # its wake-up waits for pg_xact_status (OutboxWrite.xid)
                emit_after_enqueue(written)

    def do_rollback_twophase(
        connection: Connection, xid: Any, is_prepared: bool = True, recover: bool = False
    ) -> None:
        _take_after_commit(connection.connection)
        rollback_twophase(connection, xid, is_prepared, recover)

    dialect.do_commit = do_commit  # type: ignore[method-assign]
    dialect.do_rollback = do_rollback  # type: ignore[method-assign]
    dialect.do_commit_twophase = do_commit_twophase  # type: ignore[method-assign]
    dialect.do_rollback_twophase = do_rollback_twophase  # type: ignore[method-assign]
    _dialects_hooked.add(dialect)


def _take_after_commit(dbapi_connection: PoolProxiedConnection) -> list[OutboxWrite]:
    """Remove and return what the connection's current database transaction stored (see _hook_commit)."""
    if not isinstance(dbapi_connection, PoolProxiedConnection):
        return []  # a bare DBAPI connection: nothing of ours can be waiting on it
    stored: list[OutboxWrite] = dbapi_connection.info.pop(_AFTER_COMMIT, [])
    return stored


def _take_at_commit(dbapi_connection: PoolProxiedConnection) -> _SessionBuffer | None:
    """Remove and return the Session buffer whose messages this COMMIT carries (see _commit_carrier)."""
    if not isinstance(dbapi_connection, PoolProxiedConnection):
        return None
    carried: _SessionBuffer | None = dbapi_connection.info.pop(_AT_COMMIT, None)
    return carried


def connection_add(conn: Connection, broker: PostgresBroker, items: list[StoredMessage]) -> None:
    install_engine_listeners(conn.engine)
    # Connection.begin() does no I/O (the driver begins implicitly on the next statement);
    # without a transaction, a commit() would fire no event.
    root = conn.get_transaction() or conn.begin()
    buffer = _connection_buffers.get(conn)
    if buffer is None:
        buffer = _connection_buffers[conn] = _ConnectionBuffer()
    if buffer.root is not root:
        buffer.reset(root)
    savepoint = _rolling_back_to(conn)
    if savepoint is not None:
        buffer.late.extend((savepoint, broker, item) for item in items)
        return
    buffer.items.extend((broker, item) for item in items)
    if buffer.committing:
        # Sent from a commit listener that runs after the outbox's: COMMIT is not sent yet.
        _connection_commit(conn)


def _current_buffer(conn: Connection) -> _ConnectionBuffer | None:
    buffer = _connection_buffers.get(conn)
    if buffer is None or buffer.root is None:
        return None
    if buffer.root is not conn.get_transaction():
        buffer.reset()  # left over from a transaction that ended without an event we saw
        return None
    return buffer


def _connection_savepoint(conn: Connection, name: str | None) -> None:
    # Fired before the SAVEPOINT is sent: what was sent so far goes in before it.
    buffer = _current_buffer(conn)
    if buffer is not None:
        buffer.write(conn)


def _connection_rollback_savepoint(conn: Connection, name: str, context: Any) -> None:
    buffer = _current_buffer(conn)
    if buffer is not None:
        buffer.items = []  # all sent inside the savepoint being rolled back (the invariant)
        # Sent from a listener of this rollback: kept.  Of an earlier one: inside this savepoint too.
        buffer.late = [entry for entry in buffer.late if entry[0] == name]


def _connection_rollback(conn: Connection) -> None:
    buffer = _connection_buffers.get(conn)
    if buffer is not None:
        buffer.reset()


def _connection_prepare_twophase(conn: Connection, xid: Any) -> None:
    # Fired before PREPARE TRANSACTION: the messages go in first, as before a COMMIT.
    _connection_commit(conn)


def _connection_commit_twophase(conn: Connection, xid: Any, is_prepared: bool) -> None:
    # A two-phase transaction committed without prepare() is a plain COMMIT; once
    # prepared, its messages were written before the PREPARE.
    if not is_prepared:
        _connection_commit(conn)


def _connection_rollback_twophase(conn: Connection, xid: Any, is_prepared: bool) -> None:
    _connection_rollback(conn)


def _connection_commit(conn: Connection) -> None:
    # Fired before COMMIT is sent: the buffer is written in the transaction, and after_enqueue
    # is left for the dialect's do_commit to run once the COMMIT succeeded (_hook_commit).
    buffer = _current_buffer(conn)
    if buffer is None:
        return
    announced: list[OutboxWrite] = []  # run by do_commit: after_enqueue, the wake-ups
    try:
        buffer.write(conn)
        written, buffer.written = buffer.written, []
        buffer.committing = True
        for w in written:
            announce = wants_after_enqueue(w.broker)
            after_commit_notify = w.notify_after_commit
            if w.ids and (announce or after_commit_notify):
                # Written inside a savepoint: keep only the rows that survived it.
                alive = message_store(w.broker.schema).surviving_ids(
                    DriverCursor(conn), ids=[row_id for row_id, _ in w.ids]
                )
                surviving = {message_id for row_id, message_id in w.ids if row_id in alive}
                w.stored = [item for item in w.stored if item.message.message_id in surviving]
            w.announce = announce and bool(w.stored)
            if w.twophase and after_commit_notify and w.payloads and w.stored:
                # COMMIT PREPARED may come from another session: the flush loop waits for
                # pg_xact_status of this transaction id.
                w.xid = message_store(w.broker.schema).current_xact_id(DriverCursor(conn))
            if w.announce or w.notify_at_commit:
                announced.append(w)
    except BaseException:
        # An exception raised by a commit event leaves SQLAlchemy's transaction closed but
        # the database transaction open, with the business rows in it: roll it back so
        # nothing of it can be committed by a later statement on this connection.
        # A connection SQLAlchemy invalidated (the server ended it: the transaction is gone with
        # it, and the pool clears its ``info`` before reconnecting) is left alone, so the caller
        # sees the DBAPIError that a retry catches, not an error of this cleanup.
        buffer.reset()
        if not conn.invalidated:
            _take_after_commit(conn.connection)
            conn.connection.dbapi_connection.rollback()  # type: ignore[union-attr]
        raise
    if announced:
        # Run by do_commit once this database transaction's COMMIT succeeded; appended to, since
        # a commit event that a later listener made fail leaves the database transaction open.
        conn.connection.info.setdefault(_AFTER_COMMIT, []).extend(announced)
    for w in written:
        if w.xid is not None:
            w.broker.runtime.flusher.notify_after_commit(w.xid, w.payloads)
