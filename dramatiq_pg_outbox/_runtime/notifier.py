"""The wake-ups' own connection, written on without waiting: :class:`Notifier`.

With ``notify="after_commit"`` an outbox transaction's NOTIFY is sent by the broker once
the application's COMMIT has returned.  Handed to the flush thread, it waited for that
thread to wake, for the GIL (held by the application's thread until it blocks) and for a
pool checkout before it left the process: from ``commit()`` returning to a listener of the
same process holding it, 0.42-0.56 ms at the median, against 0.09-0.11 ms written at once
as below (``python -m benchmarks.wake_up_trace``, 2 x 1,000 commits a side,
benchmarks/README.md section 32).

The notifier keeps one connection of its own, in libpq's non-blocking mode, and the
committing thread *writes* the statement on it and goes on without waiting for the
reply (libpq's asynchronous command processing: ``PQsendQueryParams`` then ``PQflush``,
https://www.postgresql.org/docs/current/libpq-async.html).  The flush thread reads the
reply (:meth:`Notifier.collect`).  One statement is in flight at a time, as libpq
allows outside pipeline mode: a send while one is in flight, or before the connection is
open, or after it broke, returns False and the caller hands the payloads to the flush
thread, which sends them on a pooled connection as before.  A wake-up is a hint (every
consumer also polls), so a NOTIFY that may have been lost with a broken connection is
sent again, at the cost of a duplicate wake-up at worst.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq

from .._isolation import connect
from ..store.libpq import text_array

#: The statement, with the channel and a ``text[]`` of payloads as text parameters.
QUERY = b"SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p"


def wait_ready(fileno: int, *, write: bool, timeout: float) -> None:
    """Wait up to ``timeout`` seconds until the socket ``fileno`` is readable (or writable too)."""
    if not hasattr(select, "poll"):  # Windows: select() has no descriptor-number limit there
        select.select([fileno], [fileno] if write else [], [], timeout)
        return
    poller = select.poll()
    poller.register(fileno, select.POLLIN | (select.POLLOUT if write else 0))
    poller.poll(timeout * 1000)


class Notifier:
    """One connection that NOTIFYs are written on without waiting for their reply.

    Parameters:
      conninfo(str): The broker's connection string.
      channel(str): The channel of every NOTIFY.
      kwargs(dict[str, Any]): Passed to ``psycopg.connect`` (the pool's: ``autocommit``,
        ``application_name``, ``prepare_threshold``), through ``_isolation.connect``.

    Thread safety: :meth:`send` may be called from any thread; :meth:`open`,
    :meth:`collect` and :meth:`close` from the flush thread (or on stop).  A lock guards
    the connection; :meth:`send` never waits for it.
    """

    def __init__(self, conninfo: str, channel: str, kwargs: dict[str, Any]) -> None:
        self.conninfo = conninfo
        self.channel = channel.encode()
        self.kwargs = kwargs
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        #: The payloads of the statement in flight (its reply not read yet), or None.
        self._sent: list[str] | None = None
        #: Whether part of that statement is still in libpq's output buffer.
        self._unflushed = False
        #: Statements written by :meth:`send` (a test signal).
        self.sent = 0

    @property
    def connected(self) -> bool:
        """Whether the connection is open (it may still be found broken at the next use)."""
        conn = self._conn
        return conn is not None and not conn.closed

    @property
    def backend_pid(self) -> int | None:
        """The server process of the connection (``pg_stat_activity.pid``), None when it is not open."""
        conn = self._conn
        return None if conn is None or conn.closed else conn.info.backend_pid

    def open(self) -> None:
        """Open the connection, unless it is open.  Raises psycopg's error when the server refuses it."""
        if self.connected:
            return
        conn = connect(self.conninfo, **self.kwargs)  # at READ COMMITTED, as every connection of ours
        conn.pgconn.nonblocking = 1
        with self._lock:
            self._drop()
            self._conn = conn

    def send(self, payloads: Sequence[str]) -> bool:
        """Write a NOTIFY of each of ``payloads`` and return without waiting for the reply.

        Returns:
          bool: False when nothing was written: the connection is not open, it broke, a
          statement is in flight, or another thread holds it now.  The caller then sends
          the payloads another way.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            conn = self._conn
            if conn is None or self._sent is not None:
                return False
            pgconn = conn.pgconn
            if pgconn.status != pq.ConnStatus.OK or pgconn.transaction_status != pq.TransactionStatus.IDLE:
                self._drop()
                return False
            values = [self.channel, text_array(payloads).encode(conn.info.encoding)]
            try:
                pgconn.send_query_params(QUERY, values)
                self._unflushed = pgconn.flush() != 0
            except psycopg.Error:
                self._drop()
                return False
            self._sent = list(payloads)
            self.sent += 1
            return True
        finally:
            self._lock.release()

    def collect(self, timeout: float) -> list[str]:
        """Read the reply of the statement in flight, waiting up to ``timeout`` seconds.

        Returns:
          list[str]: The payloads to send again: those of a statement that failed, or
          whose reply did not come within ``timeout`` (the connection is then closed);
          empty when nothing was in flight or the NOTIFY was sent.
        """
        deadline = time.monotonic() + timeout
        failed = False
        while True:
            with self._lock:
                sent, conn = self._sent, self._conn
                if sent is None or conn is None:
                    return []
                pgconn = conn.pgconn
                try:
                    if self._unflushed:
                        self._unflushed = pgconn.flush() != 0
                    if not self._unflushed:
                        pgconn.consume_input()
                        while not pgconn.is_busy():
                            result = pgconn.get_result()
                            if result is None:  # the statement's last result was read
                                self._sent = None
                                return sent if failed else []
                            failed = failed or result.status != pq.ExecStatus.TUPLES_OK
                except psycopg.Error:
                    self._drop()
                    return sent
                left = deadline - time.monotonic()
                if left <= 0:
                    self._drop()
                    return sent
                fileno, write = pgconn.socket, self._unflushed
            wait_ready(fileno, write=write, timeout=left)

    def close(self) -> None:
        """Close the connection (a statement in flight is dropped: it was only a wake-up)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        """Close the connection and forget what was in flight.  Called with the lock held."""
        conn, self._conn = self._conn, None
        self._sent = None
        self._unflushed = False
        if conn is not None:
            conn.close()
