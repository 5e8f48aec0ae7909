"""PostgresBackend: Dramatiq's results in a PostgreSQL table, beside the broker's.

Why: with :class:`~dramatiq_pg_outbox.PostgresBroker` and this backend, a
full Dramatiq stack (queues, pipelines, groups, ``Results``) needs nothing
but PostgreSQL.

Usage::

    from dramatiq.results import Results
    from dramatiq_pg_outbox.results import PostgresBackend

    backend = PostgresBackend(broker=broker)        # shares the broker's pool
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(store_results=True)
    def add(x, y):
        return x + y

    add.send(1, 2).get_result(block=True, timeout=10_000)   # 3

How it works
------------
- Table ``<schema>.results`` (``message_key``, ``result``, ``expires_at``),
  created by revision 0004 (``dramatiq-pg-outbox migrate``); statements in
  ``queries.sql`` (``results_*``).
- A store writes the encoded result with ``expires_at = now() + ttl`` (the
  ``Results`` middleware's ``result_ttl``, in milliseconds) and, in the same
  statement, ``pg_notify(<results channel>, <message key>)``.
- A blocking ``get_result`` registers with this process's results listener
  (a subscription to the process's one LISTEN connection, ``_runtime.listener``,
  shared with its consumers and relay, made on the first blocking call), reads the table once the listener is
  connected (so a result stored before the LISTEN is never missed), then
  sleeps until a notification for its key, the listener (re)connecting, the
  deadline, or ``poll_interval`` (a safety poll: correctness never depends on
  NOTIFY).  Without a listener (``listen=False``, or while it cannot connect)
  it polls with Dramatiq's backoff, from 100 ms up to ``poll_interval``.
- A row is invisible once ``expires_at`` has passed on the database clock;
  :meth:`PostgresBackend.delete_expired` deletes such rows in batches.  Every
  process that stores results runs it every ``cleanup_interval`` (+-20 %
  jitter) on a daemon thread.

Connections per process: none until first use (the ``dramatiq`` CLI forks
workers); then the broker's pool (``broker=``) or a pool of the backend's own
(``url=``/``engine=``); a process that has blocked on a result shares the
process's one LISTEN connection (none with ``listen=False``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from dramatiq import Message
from dramatiq.common import compute_backoff
from dramatiq.encoder import Encoder
from dramatiq.logging import get_logger
from dramatiq.results import Missing, ResultBackend, ResultMissing, ResultTimeout
from dramatiq.results.backend import BACKOFF_FACTOR, DEFAULT_TIMEOUT
from sqlalchemy.engine import URL, Engine

from ._runtime import Every
from ._runtime.listener import KeyedWaiters
from .broker import PostgresBroker, broker_for_backend, deciding
from .errors import SchemaNotReady
from .names import results_channel as results_channel
from .options import check_positive_ints
from .store.results import ResultStore

#: Longest NOTIFY payload sent, in bytes (PostgreSQL refuses 8000 and more).
#: A longer message key is announced with an empty payload, which wakes every reader.
MAX_PAYLOAD_BYTES = 7_999


class PostgresBackend(ResultBackend):
    """A Dramatiq result backend on a PostgreSQL table, woken by LISTEN/NOTIFY.

    Results live in ``<schema>.results`` (created by ``dramatiq-pg-outbox
    migrate``).  ``get_result(block=True)`` sleeps until the store's NOTIFY
    instead of polling (Dramatiq's default backends poll with backoff, the
    Redis backend blocks on ``BRPOPLPUSH``; this is the PostgreSQL
    equivalent).  Connections are opened lazily, in each process.

    Parameters:
      url(str): PostgreSQL URL (``postgresql://`` or a SQLAlchemy URL).
        Exactly one of ``url``, ``engine`` and ``broker``.
      engine(sqlalchemy.engine.Engine): Take the URL of this engine.
      broker(PostgresBroker): Use this broker's database, schema and
        connection pool (``pool_size`` and ``pool_timeout`` are then the
        broker's).
      schema(str): Schema of the results table.  Default: the broker's, else ``dramatiq``.
      encoder(Encoder): Encodes results.  Default: Dramatiq's global encoder.
      namespace(str): Part of every message key (see Dramatiq's
        ``ResultBackend``).  Default ``dramatiq-results``.
      use_namespace_prefix_keys(bool): Readable keys
        (``namespace:queue:actor:message_id``) instead of their MD5.
        Default False.  Needs Dramatiq 2.2 or later.
      pool_size(int): Most pooled connections per process (``url``/``engine`` only).  Default 4.
      pool_timeout(int): Longest wait for a pooled connection, in milliseconds
        (``url``/``engine`` only).  Default 10000.
      listen(bool): Whether blocked readers LISTEN for stores.  Default: the
        broker's ``listen``, else True.  Turn off behind transaction-mode PgBouncer.
      notify(bool): Whether stores send a NOTIFY.  Default: True unless the
        broker's ``notify`` is ``"off"``.  Readers still find results by polling.
      poll_interval(int): Longest sleep of a blocked reader between two reads
        of the table, in milliseconds: with a listener, a safety net; without
        one, the cap of the polling backoff.  Default 1000.
      cleanup_interval(int|None): Period of the expired-row cleanup in each
        process that stores results, in milliseconds (+-20 % jitter); None
        turns it off (call :meth:`delete_expired` yourself).  Default 60000.
      cleanup_batch_size(int): Rows deleted per statement by the cleanup.  Default 10000.

    Raises:
      ValueError: If not exactly one of ``url``, ``engine``, ``broker`` is
        given, a ``schema`` differs from the broker's, or an option is out of range.
      TypeError: If ``broker`` is not a :class:`PostgresBroker`.
    """

    def __init__(
        self,
        *,
        url: str | URL | None = None,
        engine: Engine | None = None,
        broker: PostgresBroker | None = None,
        schema: str | None = None,
        encoder: Encoder | None = None,
        namespace: str = "dramatiq-results",
        use_namespace_prefix_keys: bool = False,
        pool_size: int = 4,
        pool_timeout: int = 10_000,
        listen: bool | None = None,
        notify: bool | None = None,
        poll_interval: int = 1_000,
        cleanup_interval: int | None = 60_000,
        cleanup_batch_size: int = 10_000,
    ) -> None:
        options: dict[str, Any] = {"namespace": namespace, "encoder": encoder}
        if use_namespace_prefix_keys:
            options["use_namespace_prefix_keys"] = True
        super().__init__(**options)
        self.logger = get_logger(__name__, type(self))
        check_positive_ints(
            poll_interval=poll_interval,
            cleanup_interval=cleanup_interval,
            cleanup_batch_size=cleanup_batch_size,
        )
        self._broker, self._owns_broker = broker_for_backend(
            url=url,
            engine=engine,
            broker=broker,
            schema=schema,
            pool_size=pool_size,
            pool_timeout=pool_timeout,
            tables="the results table lives",
        )
        self.schema = self._broker.schema
        self.channel = results_channel(self.schema)
        if broker is not None:
            self.listen = broker.options.listen if listen is None else listen
            self.notify = broker.options.notify != "off" if notify is None else notify
        else:
            self.listen = listen is not False
            self.notify = notify is not False
        self.poll_interval = poll_interval
        self.cleanup_interval = cleanup_interval
        self.cleanup_batch_size = cleanup_batch_size
        self._result_store = ResultStore(self.schema)
        self._process: _Process | None = None
        self._process_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<PostgresBackend {self._broker.safe_url} schema={self.schema!r}>"

    # -- Dramatiq's ResultBackend interface ---------------------------------
    def get_result(self, message: Message[Any], *, block: bool = False, timeout: int | None = None) -> Any:
        """Get the result of ``message``.

        Parameters:
          message(Message): The message whose result to get.
          block(bool): Wait until the result is stored.  Default False.
          timeout(int): Longest wait when ``block`` is True, in milliseconds.
            Default 10000 (Dramatiq's).  0 reads once.

        Raises:
          ResultMissing: When ``block`` is False and the result is not stored (or expired).
          ResultTimeout: When ``block`` is True and the timeout elapses first.
          ResultFailure: When the actor failed and its exception was stored instead.
          ConnectionClosed/ConnectionFailed: If the database cannot be reached.
          SchemaNotReady: If the results table does not exist.

        Returns:
          object: The result, decoded with the backend's encoder.
        """
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        message_key = self.build_message_key(message)
        if not block:
            result = self._get(message_key)
            if result is Missing:
                raise ResultMissing(message)
            return self.unwrap_result(result)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + timeout / 1000
        listener = self._state().listener() if self.listen else None
        wakeup = threading.Event()
        if listener is not None:
            listener.add(message_key, wakeup)
        try:
            attempts = 0
            while True:
                # Clear, then see whether the listener is connected, then read:
                # a store committed after this read wakes us (its NOTIFY, or the
                # wake-up of a listener that reconnects), so none is missed.
                wakeup.clear()
                listening = listener is not None and listener.connected.is_set()
                result = self._get(message_key)
                if result is not Missing:
                    return self.unwrap_result(result)  # type: ignore[no-untyped-call]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ResultTimeout(message)
                if listening:
                    assert listener is not None
                    listener.wait(wakeup, min(self.poll_interval / 1000, remaining))
                else:
                    attempts, backoff = compute_backoff(
                        attempts, factor=BACKOFF_FACTOR, max_backoff=self.poll_interval
                    )
                    wakeup.wait(min(backoff / 1000, remaining))
        finally:
            if listener is not None:
                listener.remove(message_key, wakeup)

    def _get(self, message_key: str) -> Any:
        with self.connection() as conn:
            stored = self._result_store.get(conn, message_key=message_key)
        if stored is None:
            return Missing
        return self.encoder.decode(stored)

    def _store(self, message_key: str, result: Any, ttl: int) -> None:
        """Store an already wrapped ``result`` for ``ttl`` milliseconds (replacing an earlier one)."""
        payload = message_key if len(message_key.encode()) <= MAX_PAYLOAD_BYTES else ""
        encoded = self.encoder.encode(result)
        finishing = deciding()
        if finishing is not None and finishing.consumer.broker.conninfo == self._broker.conninfo:
            limit = finishing.consumer.broker.options.max_message_bytes
            if limit is not None and len(encoded) > limit:
                # A follow-up over the limit: the message is quarantined (see the broker's enqueue_many).
                finishing.refused.append(
                    f"the result of actor {finishing.actor_name!r} is {len(encoded):,} bytes encoded, "
                    f"over the broker's max_message_bytes={limit:,}"
                )
                return
        statement = self._result_store.store_statement(
            message_key=message_key,
            result=encoded,
            ttl=int(ttl),
            channel=self.channel,
            payload=payload,
            notify=self.notify,
        )
        if finishing is not None and finishing.consumer.broker.conninfo == self._broker.conninfo:
            # Stored by the Results middleware while a message's outcome is decided:
            # written with its ack or nack, in one transaction (PostgresBroker.emit_after).
            finishing.statements.append(statement)
        else:
            with self.connection() as conn:
                self._result_store.store(conn, statement)
        if self.cleanup_interval is not None:
            self._state().start_cleaner()

    # -- maintenance ----------------------------------------------------------
    def delete_expired(self, *, batch_size: int | None = None) -> int:
        """Delete the rows whose ``expires_at`` has passed, in batches, each its own short transaction.

        Safe to run from many processes at once (a row locked by another
        cleanup is skipped).

        Parameters:
          batch_size(int): Rows per ``DELETE``.  Default: ``cleanup_batch_size``.

        Raises:
          ConnectionClosed/ConnectionFailed: If the database cannot be reached.
          SchemaNotReady: If the results table does not exist.

        Returns:
          int: How many rows were deleted.
        """
        limit = batch_size or self.cleanup_batch_size
        total = 0
        while True:
            with self.connection() as conn:
                deleted = self._result_store.delete_expired(conn, limit=limit)
            total += deleted
            if deleted < limit:
                return total

    @property
    def waiting(self) -> int:
        """Readers of this process blocked on a notification right now (after their read under LISTEN)."""
        process = self._process
        if process is None or process.pid != os.getpid() or process.results_listener is None:
            return 0
        return process.results_listener.waiting

    @property
    def listening(self) -> bool:
        """Whether this process's results listener is connected."""
        process = self._process
        if process is None or process.pid != os.getpid() or process.results_listener is None:
            return False
        return process.results_listener.connected.is_set()

    def close(self) -> None:
        """Stop this process's listener and cleanup; close the backend's own pool (not a shared broker's)."""
        with self._process_lock:
            process, self._process = self._process, None
        if process is not None and process.pid == os.getpid():
            process.stop()
        if self._owns_broker:
            self._broker.close()

    # -- internals ------------------------------------------------------------
    def _state(self) -> _Process:
        process = self._process
        if process is None or process.pid != os.getpid():
            with self._process_lock:
                process = self._process
                if process is None or process.pid != os.getpid():
                    process = self._process = _Process(self)
        return process

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection of the broker's runtime, as a context manager (returned after the block).

        The backend's own statements run on it; the tests read its session settings through it.

        Raises:
          SchemaNotReady: If the results table does not exist.
          dramatiq.errors.ConnectionClosed: If the database cannot be reached."""
        try:
            with self._broker.runtime.connection() as conn:
                yield conn
        except psycopg.errors.UndefinedTable as e:
            raise SchemaNotReady(
                f"The results table {self.schema}.results does not exist in {self._broker.safe_url}. "
                f"Run: dramatiq-pg-outbox migrate --url <DATABASE_URL> --schema {self.schema}"
            ) from e


class _Process:
    """What one backend runs in one process: the results listener and the cleanup, both lazy."""

    def __init__(self, backend: PostgresBackend) -> None:
        self.pid = os.getpid()
        self.backend = backend
        self.results_listener: KeyedWaiters | None = None
        self.cleaner: Every | None = None
        self._lock = threading.Lock()

    def listener(self) -> KeyedWaiters:
        with self._lock:
            if self.results_listener is None:
                self.results_listener = KeyedWaiters(self.backend._broker.conninfo, self.backend.channel)
            return self.results_listener

    def start_cleaner(self) -> None:
        if self.cleaner is not None:
            return
        with self._lock:
            if self.cleaner is None and self.backend.cleanup_interval is not None:
                self.cleaner = Every(
                    "results-cleanup", self.backend.cleanup_interval, self.backend.delete_expired
                )
                self.cleaner.start()

    def stop(self) -> None:
        if self.results_listener is not None:
            self.results_listener.close()
        if self.cleaner is not None:
            self.cleaner.stop()
