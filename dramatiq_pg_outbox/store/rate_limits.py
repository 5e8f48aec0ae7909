"""The rate-limits store: the ``rate_limit_*`` and barrier statements of ``queries.sql``.

Run by :class:`~dramatiq_pg_outbox.rate_limits.PostgresBackend` (Dramatiq's
``RateLimiterBackend``) and its :class:`~dramatiq_pg_outbox.rate_limits.JoinedGroupCallbacks`.
Every operation is one statement on an autocommit connection, but the window limiter's
(:meth:`RateLimitStore.incr_and_sum`: one transaction of two queries); times are in
milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from .._isolation import roll_back
from .base import SchemaStore
from .libpq import text_array
from .messages import Statement


class RateLimitStore(SchemaStore):
    """The statements of the rate limiters and barriers (see :class:`~.base.SchemaStore`)."""

    def __init__(self, schema: str) -> None:
        super().__init__(schema)
        q = self.queries
        self._begin_and_lock = f"{q['begin_read_committed']};\n{q['rate_limit_lock_keys']}"
        self._sum_and_commit = f"{q['rate_limit_incr_and_sum']};\n{q['commit']}"

    def add(self, conn: psycopg.Connection[Any], *, key: str, value: int, ttl: int) -> bool:
        """Add ``key`` with ``value`` for ``ttl`` ms unless it exists (and lives); whether it was added."""
        return self._applied(conn, self.queries["rate_limit_add"], {"key": key, "value": value, "ttl": ttl})

    def incr(self, conn: psycopg.Connection[Any], *, key: str, amount: int, maximum: int, ttl: int) -> bool:
        """Add ``amount`` to ``key`` unless it would exceed ``maximum``; whether it did."""
        params = {"key": key, "amount": amount, "maximum": maximum, "ttl": ttl}
        return self._applied(conn, self.queries["rate_limit_incr"], params)

    def decr(self, conn: psycopg.Connection[Any], *, key: str, amount: int, minimum: int, ttl: int) -> bool:
        """Subtract ``amount`` from ``key`` unless it would fall below ``minimum``; whether it did."""
        params = {"key": key, "amount": amount, "minimum": minimum, "ttl": ttl}
        return self._applied(conn, self.queries["rate_limit_decr"], params)

    def incr_and_sum(
        self,
        conn: psycopg.Connection[Any],
        *,
        key: str,
        keys: Callable[[], Iterable[str]],
        amount: int,
        maximum: int,
        ttl: int,
    ) -> bool:
        """Add ``amount`` to ``key`` unless ``amount`` plus the sum of ``keys()`` would exceed ``maximum``.

        One READ COMMITTED transaction in two round trips: ``BEGIN`` with the locks of
        ``key`` and of the window ``keys()`` gives (``rate_limit_lock_keys``), then, once
        they are held, ``rate_limit_incr_and_sum`` with the window ``keys()`` gives then,
        with the ``COMMIT`` (``keys`` is called twice for that: see the statement's
        comment).  Each is one query of the simple protocol, its parameters bound on the
        client (psycopg's ``ClientCursor``), as ``_isolation.ReadCommittedCursor`` sends a
        lone statement: no pipeline, which PgBouncer's transaction pooling may hold on to.
        ``conn`` must be an autocommit connection outside a transaction.

        Raises:
          psycopg.Error: The server's error, the transaction rolled back.
        """
        cursor = psycopg.ClientCursor(conn)
        try:
            cursor.execute(self._begin_and_lock, {"keys": text_array([key, *keys()])})
            params = {
                "key": key,
                "keys": text_array(list(keys())),
                "amount": amount,
                "maximum": maximum,
                "ttl": ttl,
            }
            cursor.execute(self._sum_and_commit, params)
        except BaseException:
            roll_back(conn)
            raise
        row = cursor.fetchone()
        return row is not None and bool(row[0])

    def notify(self, conn: psycopg.Connection[Any], *, key: str, ttl: int, channel: str) -> None:
        """Publish an event on ``key`` that lives ``ttl`` ms, and announce it on ``channel``."""
        conn.execute(self.queries["rate_limit_notify"], {"key": key, "ttl": ttl, "channel": channel})

    def event(self, conn: psycopg.Connection[Any], *, key: str) -> bool:
        """Whether a live event was published on ``key``."""
        row = conn.execute(self.queries["rate_limit_event"], {"key": key}).fetchone()
        return row is not None and bool(row[0])

    def delete_expired(self, conn: psycopg.Connection[Any], *, limit: int) -> int:
        """Delete up to ``limit`` expired keys and up to ``limit`` expired events; how many rows went."""
        row = conn.execute(self.queries["rate_limit_delete_expired"], {"limit": limit}).fetchone()
        assert row is not None
        return int(row[0])

    def group_barrier_count_down(self, *, key: str, ttl: int) -> Statement:
        """The count-down of a group's barrier ``key`` (lives ``ttl`` ms), to run in a member's outcome.

        It returns true when it opened the barrier (``MessageStore.holds``).
        """
        return Statement(self.queries["group_barrier_count_down"], {"key": key, "ttl": ttl})

    @staticmethod
    def _applied(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> bool:
        # One row (true) when the operation was applied; none, or one false row, when not.
        row = conn.execute(query, params).fetchone()
        return row is not None and bool(row[0])
