"""The outbox relay's statements: ``relay.sql``.

Its acks and dead letters are the broker's own statements (:class:`~.messages.MessageStore`).

Used by :mod:`dramatiq_pg_outbox.relay`.  Every method takes a connection first (the
relay passes one of the broker's pooled autocommit connections) and runs one statement.
A claimed row is a :class:`RelayClaim`, a ``NamedTuple`` read by name.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
from psycopg.rows import class_row

from .base import SchemaStore, named_rows


class RelayClaim(NamedTuple):
    """A row the relay claimed: its id, queue, due time and stored payload (Dramatiq's encoding)."""

    id: int
    queue_name: str
    next_attempt_at: dt.datetime
    payload: bytes


_CLAIMED_ROWS = named_rows(RelayClaim)


@dataclass(frozen=True)
class QueueLag:
    """A relayed queue: age of its oldest due row (seconds, 0 if none) and how many rows are due."""

    queue_name: str
    age_s: float
    due: int


class RelayStore(SchemaStore):
    """The relay's statements on one schema (see :class:`~.base.SchemaStore`)."""

    def claim(
        self,
        conn: psycopg.Connection[Any],
        *,
        queues: Sequence[str],
        limit: int,
        lease: uuid.UUID,
        owner: uuid.UUID,
        from_at: dt.datetime | None,
        from_id: int | None,
    ) -> list[RelayClaim]:
        """Claim up to ``limit`` committed, due rows of ``queues`` under ``lease``, charging no attempt.

        Each queue is read after the watermark ``(from_at, from_id)``, or from its start when
        both are None (a sweep).  The rows come in no particular order.
        """
        params = {
            "queues": list(queues),
            "limit": limit,
            "lease": lease,
            "owner": owner,
            "from_at": from_at,
            "from_id": from_id,
        }
        with conn.cursor(row_factory=_CLAIMED_ROWS) as cur:
            cur.execute(self.queries["relay_claim"], params)
            return cur.fetchall()

    def release(self, conn: psycopg.Connection[Any], *, ids: Sequence[int], fences: Sequence[str]) -> None:
        """Hand back unpublished claimed rows, fenced by lease (``fences``: ``"<id>/<lease>"``)."""
        conn.execute(self.queries["relay_release"], {"ids": list(ids), "fences": list(fences)})

    def next_due_ms(self, conn: psycopg.Connection[Any], *, queues: Sequence[str]) -> float | None:
        """Milliseconds until the earliest delayed row of ``queues`` (< 0 once due); None if none."""
        row = conn.execute(self.queries["relay_next_due"], {"queues": list(queues)}).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def lag(self, conn: psycopg.Connection[Any], *, queues: Sequence[str]) -> list[QueueLag]:
        """Per queue of ``queues``, by name: the age of its oldest due row and how many are due."""
        with conn.cursor(row_factory=class_row(QueueLag)) as cur:
            cur.execute(self.queries["relay_lag"], {"queues": list(queues)})
            return cur.fetchall()


__all__ = ["QueueLag", "RelayClaim", "RelayStore"]
