"""Transactional enqueue (the outbox): ``actor.send()`` inside an application transaction.

Usage::

    with Session(engine) as session, session.begin(), outbox(session):
        session.add(user)
        send_welcome_email.send(user.id)
    # committed as the block ends: the message exists iff this commits

    async with AsyncSession(async_engine) as session, session.begin(), outbox(session):
        ...

Committing with ``session.begin()`` as the blocks end leaves no room for a ``send()``
between the end of ``outbox()`` and the commit, which would run outside the outbox
(docs/guides/sqlalchemy.md).

How a message follows its transaction
-------------------------------------
Inside the block, ``send()`` encodes the message at once (an encoding error is
raised by ``send()``; arguments changed afterwards are not what is stored) and
buffers it with no I/O, so nothing blocks an event loop.  The buffer belongs to
the database transaction the message was sent in, never to a Session object:

- ``Session``/``AsyncSession``: the innermost open ``SessionTransaction`` (the
  root transaction or a ``begin_nested()`` savepoint).  If the session has no
  transaction yet, one is begun (no I/O), so that a ``rollback()`` before any
  SQL still discards the message.
- ``Connection``/``AsyncConnection``: the innermost savepoint of the
  connection's transaction, followed through SQLAlchemy's savepoint events.

A savepoint that rolls back drops the messages sent in it and in the
savepoints inside it; one that is released hands them to the enclosing
transaction; a root rollback, a ``close()`` without commit, or a transaction
ending any other way drops them all.  Just before the root transaction commits
(the session's ``before_commit``, the connection's ``commit`` event) the
survivors are written through that transaction's own connection, one
multi-row INSERT per broker, so Postgres commits or rolls them back with the
business rows and delivers their ``pg_notify`` at commit.  Messages sent while
the commit is under way (from a flush hook) are written at once (or with the
``COMMIT``, below).  A ``Session``
bound to an Engine on a sync psycopg 3 connection sends that INSERT with the
``COMMIT`` itself, in one round trip (psycopg's pipeline mode, from the
dialect's ``do_commit``), together with what its flush hooks sent; if the
INSERT fails, the ``COMMIT`` behind it is skipped and ``commit()`` raises.

Dramatiq's ``after_enqueue`` runs only for messages actually stored: never
for an idempotency duplicate, a message of a rolled-back savepoint, or a
transaction whose ``COMMIT`` fails (a ``DEFERRABLE INITIALLY DEFERRED``
constraint, a serialization failure).  It runs in the thread (and context)
that commits, once the database has acknowledged the ``COMMIT``:

- ``Session``/``AsyncSession``: in the session's ``after_commit`` event.
- ``Connection``/``AsyncConnection``: SQLAlchemy has no after-commit event for
  connections (its ``commit`` event fires before ``COMMIT`` is sent), so the
  outbox wraps ``do_commit`` of the engine's dialect, once per dialect: the
  messages run ``after_enqueue`` right after the driver's ``commit()``
  returned, before ``Connection.commit()`` returns.  When no middleware of
  the broker overrides ``after_enqueue``, nothing is registered: a commit
  pays one dictionary lookup.

A send from a listener of the end of the bound transaction cannot join it once
the database has committed or rolled it back (a Session's ``after_commit``,
``after_rollback``, ``after_soft_rollback``, ``after_transaction_end``) or is
about to roll it back (a Connection's ``rollback`` event): it is written
through the broker's pool, as outside ``outbox()``, whatever the order of the
listeners.  A Connection's ``commit`` event fires before ``COMMIT``: a send
there joins the transaction.  A send from a ``rollback_savepoint`` listener, or
a Session's ``after_rollback`` of a savepoint, joins the enclosing scope.

Not covered: a ``Session`` that joined a transaction it does not commit
(``Session(bind=connection)`` on a connection already in a transaction) runs
``after_enqueue`` at ``session.commit()``, before that transaction commits.

With ``notify="after_commit"`` the wake-up is sent from the broker's own
connection once the COMMIT returned: written by the committing thread,
without waiting for the reply, on a connection the broker keeps for wake-ups
(two-phase transactions: once ``pg_xact_status`` reports the transaction
committed, see below).

Savepoints must be made through SQLAlchemy (``begin_nested()``): a
``SAVEPOINT`` sent as raw SQL is invisible to the buffer.

Two-phase transactions (``Connection.begin_twophase()``, ``Session(twophase=True)``):
the messages are written before ``PREPARE TRANSACTION`` (the ``prepare_twophase``
event; a two-phase transaction committed without ``prepare()`` is written at
its ``commit_twophase`` event, like a plain commit), never with a NOTIFY in
them (PostgreSQL cannot prepare a transaction that ran NOTIFY): the wake-up is
sent from the broker's connection once ``pg_xact_status`` reports the
transaction committed (sessions: in ``after_commit``).  ``after_enqueue`` runs
after ``COMMIT PREPARED`` (the dialect's ``do_commit_twophase`` is wrapped too).

A binding ends with its ``with`` block.  ``asyncio.create_task``,
``asyncio.to_thread`` and ``contextvars.copy_context().run`` copy it into the
task or thread they start; a send there after the block has ended raises
:class:`~dramatiq_pg_outbox.errors.OutboxError` instead of buffering into a
transaction that may be committed and closed already.  :func:`outside_outbox`
sends on purpose through the broker's pool from such code.

Supported binds: SQLAlchemy ``Session``, ``Connection``, ``AsyncSession`` and
``AsyncConnection`` using the psycopg (3) or psycopg2 driver.
"""

from __future__ import annotations

from contextvars import Token
from types import TracebackType

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from .._binding import Binding, active_bindings
from .._binding import outside_outbox as outside_outbox
from .._runtime import StoredMessage
from ..broker import PostgresBroker
from ..errors import OutboxError
from .hooks import (
    connection_add,
    connection_joinable,
    install_session_listeners,
    session_add,
    session_joinable,
)

#: What :func:`outbox` binds to.
Bind = Session | Connection | AsyncSession | AsyncConnection


def outbox(bind: Bind, broker: PostgresBroker | None = None) -> Outbox:
    """Bind ``actor.send()`` to a SQLAlchemy transaction for the duration of a ``with`` block.

    Parameters:
      bind(Session|Connection|AsyncSession|AsyncConnection): Whose transaction the messages join.
      broker(PostgresBroker|None): Only messages of this broker join it.  Default None: the
        messages of every ``PostgresBroker`` (each written to its own schema).

    Raises:
      OutboxError: If ``broker`` is not a PostgresBroker, or the bind is not supported.

    Returns:
      Outbox: A context manager: ``with`` for sync binds, ``async with`` for async ones.
    """
    if broker is not None and not isinstance(broker, PostgresBroker):
        raise OutboxError(f"outbox() needs a PostgresBroker, not {broker!r}.")
    return Outbox(bind, broker)


class Outbox:
    """A transactional-enqueue binding; create it with :func:`outbox`."""

    def __init__(self, bind: Bind, broker: PostgresBroker | None) -> None:
        if not isinstance(bind, (Session, Connection, AsyncSession, AsyncConnection)):
            raise OutboxError(
                f"outbox() binds a SQLAlchemy Session, Connection or their async forms, not {bind!r}"
            )
        self.bind = bind
        self.broker = broker
        #: True once the ``with`` block has exited: a copy of the context that outlived it
        #: (a task or thread started inside) must not buffer into its transaction.
        self.ended = False
        self._token: Token[tuple[Binding, ...]] | None = None

    @property
    def is_async(self) -> bool:
        return isinstance(self.bind, (AsyncSession, AsyncConnection))

    def add(self, broker: PostgresBroker, items: list[StoredMessage]) -> None:
        """Buffer encoded messages in the bind's current transaction (called by ``enqueue_many``).

        Raises:
          OutboxError: If an ``AsyncConnection`` was not started.
        """
        bind = self.bind
        if isinstance(bind, AsyncSession):
            session_add(bind.sync_session, broker, items)
        elif isinstance(bind, Session):
            session_add(bind, broker, items)
        else:
            conn = bind.sync_connection if isinstance(bind, AsyncConnection) else bind
            if conn is None:
                raise OutboxError("This AsyncConnection is not started: `async with engine.connect()`.")
            connection_add(conn, broker, items)

    def joinable(self) -> bool:
        """Whether a message sent now joins the bound transaction (else it goes through the pool).

        False from a listener of the end of the bound transaction once the database
        has committed or rolled it back (a Session's ``after_commit``,
        ``after_rollback``, ``after_soft_rollback``, ``after_transaction_end``), or
        while a Connection's ``rollback`` event runs (before ``ROLLBACK``, which would
        drop the message).  A Connection's ``commit`` event runs before ``COMMIT``:
        a message sent there joins the transaction.
        """
        bind = self.bind
        if isinstance(bind, AsyncSession):
            return session_joinable(bind.sync_session)
        if isinstance(bind, Session):
            return session_joinable(bind)
        conn = bind.sync_connection if isinstance(bind, AsyncConnection) else bind
        return conn is None or connection_joinable(conn)

    def _push(self) -> None:
        install_session_listeners()
        self.ended = False
        self._token = active_bindings.set((*active_bindings.get(), self))

    def _pop(self) -> None:
        self.ended = True
        if self._token is not None:
            active_bindings.reset(self._token)
            self._token = None

    def __enter__(self) -> Outbox:
        if self.is_async:
            raise OutboxError("This bind is async: use `async with outbox(session):`.")
        self._push()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Nothing is written here: the messages stay with their transaction.
        self._pop()

    async def __aenter__(self) -> Outbox:
        if not self.is_async:
            raise OutboxError("This bind is sync: use `with outbox(session):`.")
        self._push()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pop()


# -- writing ------------------------------------------------------------------


__all__ = ["Bind", "Outbox", "outbox", "outside_outbox"]
