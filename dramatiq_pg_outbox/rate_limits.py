"""A PostgreSQL backend for Dramatiq's rate limiters, barriers and group callbacks.

Why: Dramatiq's ``ConcurrentRateLimiter``, ``WindowRateLimiter``,
``BucketRateLimiter``, ``Barrier`` and the ``GroupCallbacks`` middleware take a
``RateLimiterBackend``, and Dramatiq ships Redis, Memcached and an in-memory stub.
With this one, a project that runs PostgreSQL needs no second server for them.

Usage::

    from dramatiq.rate_limits import ConcurrentRateLimiter
    from dramatiq_pg_outbox.rate_limits import PostgresBackend

    backend = PostgresBackend(broker=broker)          # or url=..., engine=...
    mutex = ConcurrentRateLimiter(backend, "distributed-mutex", limit=1)

    with mutex.acquire():
        ...

    broker.add_middleware(GroupCallbacks(backend))     # group(...).add_completion_callback
    # On a broker of the backend's database that adds JoinedGroupCallbacks: a member's
    # count-down and the callbacks are written with its ack (exactly once).

How it works
------------
- Table ``<schema>.rate_limits`` (``key``, ``value``, ``expires_at``), created by
  revision 0008 (``dramatiq-pg-outbox migrate``).  Every operation is one
  statement (``queries.sql``, ``rate_limit_*``): ``INSERT ... ON CONFLICT DO
  UPDATE ... WHERE <the condition>``, so a missing key and an existing one are
  handled atomically, with no read-modify-write race between processes (the
  conflicting row is locked and its condition re-checked against its newest
  version).  A row past its ``expires_at`` (``now() + ttl``, database clock)
  counts as absent; TTLs are in milliseconds, as in Dramatiq.
- ``wait_notify`` stores an event row that lives for its TTL (a waiter that
  arrives late still sees it, as with Dramatiq's Redis backend) and sends a
  NOTIFY on ``names.rate_limits_channel``; ``wait`` reads the event and sleeps
  until a notification for its key, through the process's one LISTEN connection
  (``_runtime.listener``), re-reading at least every ``poll_interval``; with
  ``listen=False`` it polls.
- Expired keys and events are deleted by each process that writes, every
  ``cleanup_interval`` (a :class:`~._runtime.Service`); no cron job.

``incr_and_sum`` (the window limiter) is a function of migration 0008: it takes a
transaction-scoped advisory lock per key of the window, in one order, then sums
the window as committed, so callers of overlapping windows never both pass.  The
backend takes the locks of the window it was given first, then asks for the window
again and runs the function with that one, in the same transaction: a second that
began while it waited for the locks is in the sum (Dramatiq's ``RedisBackend``
likewise reads the keys again before it sums them).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from dramatiq import Message
from dramatiq.broker import Broker, MessageProxy
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits.backend import RateLimiterBackend
from sqlalchemy.engine import URL, Engine

from ._runtime import Every
from ._runtime.listener import KeyedWaiters
from .broker import PostgresBroker, broker_for_backend, deciding
from .names import rate_limits_channel
from .options import check_positive_ints
from .store.rate_limits import RateLimitStore

#: Default period of the cleanup of expired keys, in milliseconds.
DEFAULT_CLEANUP_INTERVAL = 60_000
#: Rows of each table deleted per cleanup statement.
CLEANUP_BATCH = 10_000


class PostgresBackend(RateLimiterBackend):
    """Dramatiq's ``RateLimiterBackend`` on PostgreSQL tables.

    Parameters:
      url(str): PostgreSQL URL (``postgresql://`` or a SQLAlchemy URL).
        Exactly one of ``url``, ``engine`` and ``broker``.
      engine(sqlalchemy.engine.Engine): Take the URL of this engine.
      broker(PostgresBroker): Use this broker's database, schema and connection pool.
      schema(str): Schema of the tables.  Default: the broker's, else ``dramatiq``.
      pool_size(int): Most pooled connections per process (``url``/``engine`` only).  Default 4.
      pool_timeout(int): Longest wait for a pooled connection, in milliseconds
        (``url``/``engine`` only).  Default 10000.
      listen(bool): Whether ``wait`` LISTENs for events.  Default: the broker's
        ``listen``, else True.
      poll_interval(int): Longest sleep of ``wait`` between two reads, in
        milliseconds (the polling period without LISTEN).  Default 1000.
      cleanup_interval(int|None): Period of the cleanup of expired keys in each
        process that writes, in milliseconds (+-20 % jitter); None turns it off
        (call :meth:`delete_expired`).  Default 60000.

    Raises:
      ValueError: If not exactly one of ``url``, ``engine``, ``broker`` is given,
        ``schema`` differs from the broker's, or an interval is not an integer >= 1.
      TypeError: If ``broker`` is not a :class:`PostgresBroker`.
    """

    def __init__(
        self,
        *,
        url: str | URL | None = None,
        engine: Engine | None = None,
        broker: PostgresBroker | None = None,
        schema: str | None = None,
        pool_size: int = 4,
        pool_timeout: int = 10_000,
        listen: bool | None = None,
        poll_interval: int = 1_000,
        cleanup_interval: int | None = DEFAULT_CLEANUP_INTERVAL,
    ) -> None:
        check_positive_ints(poll_interval=poll_interval, cleanup_interval=cleanup_interval)
        self.broker, self._owns_broker = broker_for_backend(
            url=url,
            engine=engine,
            broker=broker,
            schema=schema,
            pool_size=pool_size,
            pool_timeout=pool_timeout,
            tables="the rate-limit tables live",
        )
        self.schema = self.broker.schema
        self.channel = rate_limits_channel(self.schema)
        self.listen = (broker.options.listen if broker is not None else True) if listen is None else listen
        self.poll_interval = poll_interval
        self.cleanup_interval = cleanup_interval
        self._lock = threading.Lock()
        self._pid = 0
        self._waiters: KeyedWaiters | None = None
        self._cleaner: Every | None = None
        self._store = RateLimitStore(self.schema)

    def __repr__(self) -> str:
        return f"<rate_limits.PostgresBackend {self.broker.safe_url} schema={self.schema!r}>"

    # -- Dramatiq's RateLimiterBackend -------------------------------------------------
    def add(self, key: str, value: int, ttl: int) -> bool:
        """Add ``key`` with ``value`` for ``ttl`` ms unless it exists; whether it was added."""
        with self._connection() as conn:
            added = self._store.add(conn, key=key, value=value, ttl=ttl)
        self._start_cleaner()
        return added

    def incr(self, key: str, amount: int, maximum: int, ttl: int) -> bool:
        """Add ``amount`` to ``key`` unless it would exceed ``maximum``; whether it did."""
        with self._connection() as conn:
            done = self._store.incr(conn, key=key, amount=amount, maximum=maximum, ttl=ttl)
        self._start_cleaner()
        return done

    def decr(self, key: str, amount: int, minimum: int, ttl: int) -> bool:
        """Subtract ``amount`` from ``key`` unless it would fall below ``minimum``; whether it did."""
        with self._connection() as conn:
            done = self._store.decr(conn, key=key, amount=amount, minimum=minimum, ttl=ttl)
        self._start_cleaner()
        return done

    def incr_and_sum(
        self, key: str, keys: Callable[[], Iterable[str]], amount: int, maximum: int, ttl: int
    ) -> bool:
        """Add ``amount`` to ``key`` unless ``amount`` plus the sum of ``keys()`` would exceed ``maximum``.

        ``keys()`` (the window's buckets, as of now) is called twice: before the window's
        locks are taken, for the keys to lock, and once they are held, for the keys to sum.
        Summed as of before the wait, a window could end before a second that began during
        it, and miss that second's bucket, which another caller may have filled meanwhile:
        one call over ``maximum`` (seen in CI with 16 threads and a limit of 10).
        """
        with self._connection() as conn:
            done = self._store.incr_and_sum(conn, key=key, keys=keys, amount=amount, maximum=maximum, ttl=ttl)
        self._start_cleaner()
        return done

    def wait(self, key: str, timeout: int) -> bool:
        """Wait up to ``timeout`` ms for an event on ``key``; whether one was published (and lives)."""
        deadline = time.monotonic() + timeout / 1000
        waiters = self._state_waiters() if self.listen else None
        wakeup = threading.Event()
        if waiters is not None:
            waiters.add(key, wakeup)
        try:
            while True:
                wakeup.clear()
                if self._event(key):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                wait = min(self.poll_interval / 1000, remaining)
                if waiters is not None:
                    waiters.wait(wakeup, wait)
                else:
                    wakeup.wait(wait)
        finally:
            if waiters is not None:
                waiters.remove(key, wakeup)

    def wait_notify(self, key: str, ttl: int) -> None:
        """Publish an event on ``key`` that lives ``ttl`` ms, and wake its waiters."""
        with self._connection() as conn:
            self._store.notify(conn, key=key, ttl=ttl, channel=self.channel)
        self._start_cleaner()

    # -- group completion callbacks ------------------------------------------------------
    def joined_group_callbacks(self, middleware: GroupCallbacks, broker: Broker) -> GroupCallbacks:
        """The form of Dramatiq's ``GroupCallbacks`` on this backend that ``broker`` adds.

        Called by :meth:`PostgresBroker.add_middleware`.  On a broker of this backend's
        database: a :class:`JoinedGroupCallbacks` with the same barrier TTL;
        elsewhere ``middleware`` itself.
        """
        if not isinstance(broker, PostgresBroker) or broker.conninfo != self.broker.conninfo:
            return middleware
        return JoinedGroupCallbacks(self, barrier_ttl=middleware.barrier_ttl)

    # -- maintenance -------------------------------------------------------------------
    def delete_expired(self) -> int:
        """Delete expired keys and events (many processes may run it at once); how many rows went."""
        total = 0
        while True:
            with self._connection() as conn:
                deleted = self._store.delete_expired(conn, limit=CLEANUP_BATCH)
            total += deleted
            if deleted < CLEANUP_BATCH:
                return total

    def close(self) -> None:
        """Stop this process's waiters' subscription and cleanup; close the backend's own pool."""
        with self._lock:
            waiters, self._waiters = self._waiters, None
            cleaner, self._cleaner = self._cleaner, None
        if waiters is not None and self._pid == os.getpid():
            waiters.close()
        if cleaner is not None and self._pid == os.getpid():
            cleaner.stop()
        if self._owns_broker:
            self.broker.close()

    # -- internals ---------------------------------------------------------------------
    def _connection(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A pooled autocommit connection of the broker's runtime (one statement each)."""
        return self.broker.runtime.connection()

    def _event(self, key: str) -> bool:
        with self._connection() as conn:
            return self._store.event(conn, key=key)

    def _fork_check(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._waiters = None
            self._cleaner = None

    def _state_waiters(self) -> KeyedWaiters:
        with self._lock:
            self._fork_check()
            if self._waiters is None:
                self._waiters = KeyedWaiters(self.broker.conninfo, self.channel)
            return self._waiters

    def _start_cleaner(self) -> None:
        if self.cleanup_interval is None or (self._cleaner is not None and self._pid == os.getpid()):
            return
        with self._lock:
            self._fork_check()
            if self._cleaner is None:
                self._cleaner = Every("rate-limits-cleanup", self.cleanup_interval, self.delete_expired)
                self._cleaner.start()


class JoinedGroupCallbacks(GroupCallbacks):
    """Dramatiq's ``GroupCallbacks`` whose count-down and callbacks are written with the member's ack.

    What :meth:`PostgresBroker.add_middleware` adds for ``GroupCallbacks(backend)`` when
    ``backend`` is a :class:`PostgresBackend` of the broker's database.  Dramatiq's
    middleware counts the group's barrier down at once (``Barrier.wait(block=False)``)
    and enqueues the completion callbacks when it opens; a member whose ack is then
    lost (its worker killed, its lease taken over) runs again and counts down twice,
    and the callbacks run twice.  Here, after a member succeeds, the count-down
    (``group_barrier_count_down`` in queries.sql, Dramatiq's barrier: decrement with
    a minimum of 1, open when the last party arrives) and the callbacks are one
    follow-up of its ack: the flusher runs the count-down in the ack's transaction,
    for an ack whose fence held, and writes the callbacks there if it opened the
    barrier.  Either all of it commits or none of it does.

    Messages of other brokers, and hooks run outside a delivery's outcome, get
    Dramatiq's behaviour.

    Parameters:
      rate_limiter_backend(PostgresBackend): The backend of the barriers.
      barrier_ttl(int): Lifetime of a group's barrier, in milliseconds.  Default 86,400,000 (a day).
    """

    def __init__(self, rate_limiter_backend: PostgresBackend, *, barrier_ttl: int = 86_400_000) -> None:
        super().__init__(rate_limiter_backend, barrier_ttl=barrier_ttl)
        self.backend = rate_limiter_backend

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        finishing = deciding()
        # ConsumerHost is the broker seen from the consumer: a PostgresBroker.
        host: object = None if finishing is None else finishing.consumer.broker
        if finishing is None or message is not finishing or host is not broker:
            # Not a delivery's outcome of this broker: Dramatiq's count-down, at once.
            dramatiq_hook = super().after_process_message
            dramatiq_hook(broker, message, result=result, exception=exception)  # type: ignore[no-untyped-call]
            return
        group_key = message.options.get("group_completion_uuid")
        callbacks = message.options.get("group_completion_callbacks")
        if exception is not None or not group_key or not callbacks:
            return
        count_down = self.backend._store.group_barrier_count_down(key=group_key, ttl=self.barrier_ttl)
        with finishing.sending_if(count_down):
            for callback in callbacks:
                broker.enqueue(Message(**callback))


__all__ = ["JoinedGroupCallbacks", "PostgresBackend"]
