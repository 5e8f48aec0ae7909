"""The rate-limits store: the ``rate_limit_*`` and barrier statements of ``queries.sql``.

Run by :class:`~dramatiq_pg_outbox.rate_limits.PostgresBackend` (Dramatiq's
``RateLimiterBackend``) and its :class:`~dramatiq_pg_outbox.rate_limits.JoinedGroupCallbacks`.
Every operation is one statement on an autocommit connection, but the window limiter's
(:meth:`RateLimitStore.lock_keys`, then :meth:`RateLimitStore.incr_and_sum`, in one
transaction); times are in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from .base import SchemaStore
from .messages import Statement


class RateLimitStore(SchemaStore):
    """The statements of the rate limiters and barriers (see :class:`~.base.SchemaStore`)."""

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
        keys: Sequence[str],
        amount: int,
        maximum: int,
        ttl: int,
    ) -> bool:
        """Add ``amount`` to ``key`` unless ``amount`` plus the sum of ``keys`` would exceed ``maximum``."""
        params = {"key": key, "keys": list(keys), "amount": amount, "maximum": maximum, "ttl": ttl}
        return self._applied(conn, self.queries["rate_limit_incr_and_sum"], params)

    def lock_keys(self, conn: psycopg.Connection[Any], *, keys: Sequence[str]) -> None:
        """Take the window limiter's lock of each of ``keys`` until ``conn``'s transaction ends."""
        conn.execute(self.queries["rate_limit_lock_keys"], {"keys": list(keys)})

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
