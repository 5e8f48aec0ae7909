"""The results store: the statements of ``queries.sql`` that the results backend runs (``results.py``)."""

from __future__ import annotations

from typing import Any

import psycopg

from .base import SchemaStore
from .messages import Statement


class ResultStore(SchemaStore):
    """The ``results_*`` statements of ``queries.sql`` (see :class:`~.base.SchemaStore`)."""

    def get(self, conn: psycopg.Connection[Any], *, message_key: str) -> bytes | None:
        """The stored (encoded) result of ``message_key``, or None if missing or expired."""
        row = conn.execute(self.queries["results_get"], {"message_key": message_key}).fetchone()
        return None if row is None else bytes(row[0])

    def store_statement(
        self, *, message_key: str, result: bytes, ttl: int, channel: str, payload: str, notify: bool
    ) -> Statement:
        """The statement that stores ``result`` for ``ttl`` ms (replacing an earlier one), to run later.

        Parameters:
          message_key(str): The result's key.
          result(bytes): The encoded result.
          ttl(int): Milliseconds it is kept.
          channel(str), payload(str), notify(bool): The notification sent with it, if ``notify``.
        """
        params = {
            "message_key": message_key,
            "result": result,
            "ttl": ttl,
            "channel": channel,
            "payload": payload,
            "notify": notify,
        }
        return Statement(self.queries["results_store"], params)

    def store(self, conn: psycopg.Connection[Any], statement: Statement) -> None:
        """Run a statement of :meth:`store_statement` now."""
        conn.execute(statement.query, statement.params)

    def delete_expired(self, conn: psycopg.Connection[Any], *, limit: int) -> int:
        """Delete up to ``limit`` expired results (rows locked by another cleanup skipped); how many."""
        return conn.execute(self.queries["results_delete_expired"], {"limit": limit}).rowcount
