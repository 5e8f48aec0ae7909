"""Transactional enqueue for Django: ``actor.send()`` inside ``transaction.atomic()``.

Usage::

    from django.db import transaction
    from dramatiq_pg_outbox.django import outbox

    with transaction.atomic(), outbox():
        order = Order.objects.create(total=total)
        send_receipt.send(order.id)          # commits or rolls back with the order

The promise is the one :func:`dramatiq_pg_outbox.outbox` gives a SQLAlchemy
session: a message sent inside the block exists if and only if the Django
transaction it was sent in commits.  Unlike ``transaction.on_commit(lambda:
actor.send(...))``, nothing is left to do after the ``COMMIT``: a process that
dies right after it still has its message stored.

How a message follows Django's transaction
------------------------------------------
``send()`` inside the block writes the message at once, with one ``INSERT``
through Django's own connection of the ``using`` database (its psycopg cursor,
in its current transaction): ``broker.enqueue_many(messages)`` writes one
multi-row ``INSERT`` for all its messages.  PostgreSQL then does the rest:

- the outermost ``atomic()`` commits or rolls back the messages with the model
  rows;
- a nested ``atomic()`` (a savepoint) that rolls back removes the messages sent
  inside it, and only those; one released hands them to the enclosing block;
  ``atomic(savepoint=False)`` and ``transaction.set_rollback(True)`` follow
  Django's rules (the whole transaction rolls back);
- outside any ``atomic()`` (autocommit) a message commits at once, like any
  statement of Django's in autocommit mode.

Wake-ups follow the broker's ``notify`` option as for SQLAlchemy: with
``"transaction"`` the ``INSERT`` itself calls ``pg_notify``, which PostgreSQL
delivers at commit (never for a rolled-back savepoint or transaction); with
``"after_commit"`` the broker's own connection sends it after the commit
(``transaction.on_commit``); with ``"off"`` workers find the message by
polling.  Dramatiq's ``after_enqueue`` hooks (django_dramatiq's
``AdminMiddleware``, for one) run in ``transaction.on_commit`` too, so only for
messages that were committed: never for a rolled-back savepoint or transaction,
nor for an idempotency duplicate.  Django drops those callbacks with the
savepoint, so no query is needed at commit.

Databases: ``using`` names the Django database (``DATABASES`` alias) whose
transaction the messages join, as ``transaction.atomic(using=...)`` does; the
messages are written to that database, in the broker's schema, so the
broker's workers must consume that database (run ``dramatiq-pg-outbox migrate``
on it).  With several databases, give each its own broker and bind it:
``outbox(using="ledger", broker=ledger_broker)``.

A binding belongs to the thread that entered it: Django's connections are per
thread, and a send from another thread raises
:class:`~dramatiq_pg_outbox.errors.OutboxError` (as does a send after the
block ended, from a thread or task started inside it).  Tested with Django 5.2
and psycopg 3 (Django's ``postgresql`` backend).
"""

from __future__ import annotations

import shlex
import weakref
from contextvars import Token
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlencode

from dramatiq import Middleware

try:
    from django.db import DEFAULT_DB_ALIAS, connections, transaction
    from django.db.utils import ConnectionDoesNotExist
except ImportError as error:
    raise ImportError(
        f"dramatiq_pg_outbox.django needs Django ({error}): pip install 'dramatiq-pg-outbox[django]'"
    ) from None

from ._binding import Binding, active_bindings
from ._runtime import StoredMessage, enqueue_result, enqueue_statement
from .broker import PostgresBroker
from .errors import OutboxError
from .migrations import schema_not_ready
from .store.messages import message_store
from .urls import safe_url


def outbox(using: str | None = None, broker: PostgresBroker | None = None) -> DjangoOutbox:
    """Bind ``actor.send()`` to a Django database's transaction for the duration of a ``with`` block.

    Parameters:
      using(str|None): The Django database alias (a key of ``settings.DATABASES``) whose
        transaction the messages join and where they are written.  Default None: ``"default"``.
      broker(PostgresBroker|None): Only messages of this broker join it.  Default None: the
        messages of every ``PostgresBroker`` (each written to its own schema).

    Raises:
      OutboxError: If ``using`` is not a database of ``settings.DATABASES``, is not a
        PostgreSQL database, or ``broker`` is not a PostgresBroker.

    Returns:
      DjangoOutbox: A context manager (``with outbox(): ...``).
    """
    if broker is not None and not isinstance(broker, PostgresBroker):
        raise OutboxError(f"outbox() needs a PostgresBroker, not {broker!r}.")
    alias = DEFAULT_DB_ALIAS if using is None else using
    try:
        vendor = connections[alias].vendor
    except ConnectionDoesNotExist:
        known = ", ".join(repr(name) for name in connections.settings)
        raise OutboxError(
            f"outbox(using={alias!r}): Django has no database {alias!r} (settings.DATABASES has "
            f"{known}). Pass one of these aliases."
        ) from None
    if vendor != "postgresql":
        raise OutboxError(
            f"outbox(using={alias!r}): that Django database uses the {vendor} backend; the outbox needs "
            "PostgreSQL (ENGINE 'django.db.backends.postgresql'). Bind a PostgreSQL database."
        )
    return DjangoOutbox(alias, broker)


class DjangoOutbox:
    """A transactional-enqueue binding on a Django database; create it with :func:`outbox`."""

    def __init__(self, using: str, broker: PostgresBroker | None) -> None:
        #: The Django database alias.
        self.using = using
        #: The broker whose messages join, or None for every broker.
        self.broker = broker
        #: The Django connection (``DatabaseWrapper``) of the thread that entered the block.
        self.bind: Any = None
        #: True once the ``with`` block has exited.
        self.ended = False
        self._token: Token[tuple[Binding, ...]] | None = None

    def joinable(self) -> bool:
        """True: every send inside the block is written through the Django connection (see :meth:`add`)."""
        return True

    def add(self, broker: PostgresBroker, items: list[StoredMessage]) -> None:
        """Write encoded messages through the Django connection, in its transaction (called by ``send()``).

        Raises:
          OutboxError: If called from another thread than the one that entered the block, or
            while the connection is in manual transaction management (autocommit off outside
            ``atomic()``).
          SchemaNotReady: If the broker's tables are missing or old in this database.
          django.db.Error: What Django's cursor raises (the database is unreachable, the
            transaction is broken...).
        """
        connection = connections[self.using]
        if connection is not self.bind:
            raise OutboxError(
                f"send() in another thread than the one that entered outbox(using={self.using!r}): "
                "Django's connections belong to one thread, so this message cannot join that "
                "transaction. Send from the thread of the atomic() block, or enter outbox() in this one."
            )
        if not connection.in_atomic_block and not connection.get_autocommit():
            raise OutboxError(
                f"outbox(using={self.using!r}) inside manual transaction management (autocommit off "
                "outside atomic()): Django runs no on_commit callback there. Use transaction.atomic()."
            )
        with connection.cursor() as cursor:
            _check_schema(cursor, connection, broker)
            notify = broker.options.notify
            statement = enqueue_statement(
                items, broker.channel, notify == "transaction", broker.options.max_fetch_interval
            )
            rows = message_store(broker.schema).enqueue(cursor, statement)
        result = enqueue_result(statement.name, items, rows)
        announced = result.stored if _wants_after_enqueue(broker) else []
        payloads = result.payloads if notify == "after_commit" else []
        if announced or payloads:
            # Django keeps the callback with the savepoints open now: it is dropped if one of
            # them (or the transaction) rolls back, and runs at once in autocommit mode.
            transaction.on_commit(_AfterCommit(broker, announced, payloads), using=self.using, robust=True)

    def __enter__(self) -> DjangoOutbox:
        self.bind = connections[self.using]
        self.ended = False
        self._token = active_bindings.set((*active_bindings.get(), self))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.ended = True
        if self._token is not None:
            active_bindings.reset(self._token)
            self._token = None

    async def __aenter__(self) -> DjangoOutbox:
        raise OutboxError(
            "outbox() of dramatiq_pg_outbox.django is synchronous, as Django's atomic() is: use "
            "`with transaction.atomic(), outbox():` in a sync function (sync_to_async() from async code)."
        )

    async def __aexit__(self, *exc_info: object) -> None:
        return None


class _AfterCommit:
    """What a committed enqueue still does: ``after_enqueue`` hooks, the after-commit wake-up."""

    def __init__(self, broker: PostgresBroker, stored: list[StoredMessage], payloads: list[str]) -> None:
        self.broker = broker
        self.stored = stored
        self.payloads = payloads
        # Django logs a robust callback's error with its __qualname__.
        self.__qualname__ = "dramatiq_pg_outbox.django.after_commit"

    def __call__(self) -> None:
        for item in self.stored:
            self.broker.emit_after("enqueue", item.message, item.delay or None)
        if self.payloads:
            # Non-blocking: the flush loop sends it from the broker's own connection.
            self.broker.runtime.flusher.notify_later(self.payloads)


def _wants_after_enqueue(broker: PostgresBroker) -> bool:
    """Whether a middleware of ``broker`` overrides Dramatiq's no-op ``after_enqueue``."""
    return any(type(m).after_enqueue is not Middleware.after_enqueue for m in broker.middleware)


#: The databases (masked URLs) whose schema revision was checked, per broker.
_schema_checked: weakref.WeakKeyDictionary[PostgresBroker, set[str]] = weakref.WeakKeyDictionary()


def database_url(settings: dict[str, Any]) -> str:
    """The ``postgresql://`` URL of a Django database, from its ``settings.DATABASES`` entry.

    For ``PostgresBroker(url=...)`` (in django_dramatiq's ``DRAMATIQ_BROKER["OPTIONS"]``) and
    ``dramatiq-pg-outbox migrate --url``: ``NAME``, ``USER``, ``PASSWORD``, ``HOST`` (a
    directory for a Unix socket) and ``PORT`` are taken, the ``OPTIONS`` entries that are
    libpq parameters (``sslmode``, ``sslrootcert``, ``options``, ...) become query parameters.

    Parameters:
      settings(dict): One entry of ``settings.DATABASES``.

    Raises:
      ValueError: If the entry is not a PostgreSQL database (its ``ENGINE`` names neither
        ``postgresql`` nor ``postgis``).

    Returns:
      str: The URL, password included (mask it before showing it).
    """
    engine = str(settings.get("ENGINE", ""))
    # Django's backend, PostGIS's, or a wrapper of either (django-prometheus...).
    if "postgresql" not in engine and "postgis" not in engine:
        raise ValueError(
            f"database_url() needs a PostgreSQL database (ENGINE 'django.db.backends.postgresql'), "
            f"not {engine or 'an entry without ENGINE'!r}"
        )
    query = {
        key: str(value)
        for key, value in (settings.get("OPTIONS") or {}).items()
        if isinstance(value, (str, int)) and not isinstance(value, bool) and key not in _DJANGO_ONLY_OPTIONS
    }
    host = str(settings.get("HOST") or "")
    if host.startswith("/"):
        query["host"], host = host, ""
    user, password = str(settings.get("USER") or ""), str(settings.get("PASSWORD") or "")
    credentials = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    port = str(settings.get("PORT") or "")
    netloc = (credentials + "@" if credentials else "") + host + (":" + port if port else "")
    # Percent-encoded throughout (a space too, which libpq refuses raw in a URL).
    url = f"postgresql://{netloc}/{quote(str(settings.get('NAME') or ''), safe='')}"
    return url + ("?" + urlencode(query, quote_via=quote) if query else "")


#: Keys of a Django database's ``OPTIONS`` that are not libpq parameters: read by Django itself,
#: or keyword arguments of the driver's ``connect()``.
_DJANGO_ONLY_OPTIONS = frozenset(
    {
        "isolation_level",
        "server_side_binding",
        "pool",
        "assume_role",
        "prepare_threshold",
        "cursor_factory",
        "row_factory",
        "context",
        "autocommit",
    }
)


def _check_schema(cursor: Any, connection: Any, broker: PostgresBroker) -> None:
    """Raise :class:`SchemaNotReady` if the broker's tables are missing or old in this database."""
    key = safe_url(database_url(connection.settings_dict))
    checked = _schema_checked.setdefault(broker, set())
    if key in checked:
        return
    row = message_store(broker.schema).schema_revision(cursor)
    # The command names the database, or $DATABASE_URL when its URL has a password.
    fix_url = None if connection.settings_dict.get("PASSWORD") else shlex.quote(key)
    error = schema_not_ready(broker.schema, row, url=key, fix_url=fix_url)
    if error is not None:
        raise error
    checked.add(key)


__all__ = ["DjangoOutbox", "database_url", "outbox"]
