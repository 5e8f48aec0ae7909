"""The Spark integration's statements: ``spark.sql`` and ``spark_backlog.sql``.

Used by :mod:`dramatiq_pg_outbox.spark` (the writer on the executors, the
``dramatiq_backlog`` and ``dramatiq_history`` readers) and
:mod:`dramatiq_pg_outbox.spark_analytics`.  A :class:`SparkStore` holds only its schema and
its statements' text, and pickles as its schema alone (Spark ships it to the executors inside a
closure; it looks its statements up again there).

The per-row paths keep their row handling: the writer streams its rows into ``COPY``
(:meth:`SparkStore.copy_text`, :meth:`SparkStore.copy_binary`) and the readers leave their
rows on the caller's cursor, plain tuples in the column order of the Spark schema that the
method names, which Spark reads by position.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg

from .base import SchemaStore, named_rows


class SparkWriteRow(NamedTuple):
    """One recorded write of ``format("dramatiq")`` (``spark_writes``, migration 0019)."""

    batch_id: str
    spark_batch: int
    tasks: int
    rows: int
    enqueued: int
    skipped: int
    repeated: int
    seconds: float
    committed_at: dt.datetime


_WRITE_ROWS = named_rows(SparkWriteRow)


@dataclass(frozen=True)
class IdRange:
    """The smallest and the largest id of the live messages (both included)."""

    lo: int
    hi: int


class SparkStore(SchemaStore):
    """The Spark statements on one schema (see :class:`~.base.SchemaStore`)."""

    def __reduce__(self) -> tuple[type[SparkStore], tuple[str]]:
        """Pickled as its schema alone: the statements are looked up again where it is unpickled."""
        return SparkStore, (self.schema,)

    # -- the writer: one transaction per task ------------------------------------
    def stage(self, cur: psycopg.Cursor[Any]) -> None:
        """Create the staging table ``dpo_stage``, dropped at commit."""
        cur.execute(self.queries["spark_stage"])

    def copy_text(self, cur: psycopg.Cursor[Any]) -> AbstractContextManager[psycopg.Copy]:
        """``COPY`` into ``dpo_stage`` as CSV: (message_id, idempotency_key, payload_text) rows."""
        return cur.copy(self.queries["spark_copy_text"])

    def copy_binary(self, cur: psycopg.Cursor[Any]) -> AbstractContextManager[psycopg.Copy]:
        """``COPY`` into ``dpo_stage`` in binary: (message_id, idempotency_key, payload) rows."""
        return cur.copy(self.queries["spark_copy_binary"])

    def copy_claims(self, cur: psycopg.Cursor[Any]) -> AbstractContextManager[psycopg.Copy]:
        """``COPY`` in binary into ``idempotency_keys``: (idempotency_key) rows, each claimed.

        Raises:
          psycopg.errors.UniqueViolation: (at the end of the copy) A key is taken already
            or comes twice.
        """
        return cur.copy(self.queries["spark_copy_claims"])

    def copy_stage_keys(self, cur: psycopg.Cursor[Any]) -> AbstractContextManager[psycopg.Copy]:
        """``COPY`` in binary into ``dpo_stage``: (idempotency_key) rows, the other columns null."""
        return cur.copy(self.queries["spark_copy_stage_keys"])

    def drop_in_history(self, cur: psycopg.Cursor[Any]) -> int:
        """Delete the staged rows whose idempotency key history holds; how many."""
        cur.execute(self.queries["spark_drop_in_history"])
        return cur.rowcount

    def copy_messages(self, cur: psycopg.Cursor[Any]) -> AbstractContextManager[psycopg.Copy]:
        """``COPY`` in binary straight into the messages, slot -1: (queue_name, actor_name,
        message_id, idempotency_key, payload, priority, slot) rows.

        Raises:
          psycopg.errors.UniqueViolation: (at the end of the copy) A key is in the table already.
        """
        return cur.copy(self.queries["spark_copy_messages"])

    def stage_repeats(self, cur: psycopg.Cursor[Any]) -> tuple[int, str | None]:
        """(staged rows whose key an earlier staged row has, the first such key or None)."""
        cur.execute(self.queries["spark_stage_repeats"])
        repeated, key = cur.fetchone() or (0, None)
        return int(repeated), key

    def drop_known(self, cur: psycopg.Cursor[Any]) -> None:
        """Delete the staged rows whose idempotency key is taken already."""
        cur.execute(self.queries["spark_drop_known"])

    def insert_new(
        self, cur: psycopg.Cursor[Any], *, queue_name: str, actor_name: str, delay_ms: int, priority: int
    ) -> int:
        """Insert every staged row as a message, claiming its key; the messages inserted.

        Raises:
          psycopg.errors.UniqueViolation: A key was claimed since :meth:`drop_known`, or is
            staged twice (run it in a savepoint, then :meth:`insert`).
        """
        params = {"queue_name": queue_name, "actor_name": actor_name, "delay": delay_ms, "priority": priority}
        cur.execute(self.queries["spark_insert_new"], params)
        return cur.rowcount

    def insert(
        self, cur: psycopg.Cursor[Any], *, queue_name: str, actor_name: str, delay_ms: int, priority: int
    ) -> int:
        """Insert the staged rows whose key this statement claims (``ON CONFLICT``); the messages inserted."""
        params = {"queue_name": queue_name, "actor_name": actor_name, "delay": delay_ms, "priority": priority}
        cur.execute(self.queries["spark_insert"], params)
        return cur.rowcount

    def notify(self, cur: psycopg.Cursor[Any], *, channel: str, queue_names: Sequence[str]) -> None:
        """Wake the listeners of ``queue_names`` on ``channel`` (at commit)."""
        cur.execute(self.queries["notify"], {"channel": channel, "queue_names": list(queue_names)})

    # -- the readers -------------------------------------------------------------
    def record_write(
        self,
        conn: psycopg.Connection[Any],
        *,
        batch_id: str,
        spark_batch: int,
        tasks: int,
        rows: int,
        enqueued: int,
        skipped: int,
        repeated: int,
        seconds: float,
    ) -> None:
        """Record what one committed write did (one row of ``spark_writes``)."""
        conn.execute(
            self.queries["spark_write_record"],
            {"batch_id": batch_id, "spark_batch": spark_batch, "tasks": tasks, "rows": rows,
             "enqueued": enqueued, "skipped": skipped, "repeated": repeated, "seconds": seconds},
        )  # fmt: skip

    def write_counts(self, conn: psycopg.Connection[Any], *, batch_id: str) -> list[SparkWriteRow]:
        """The recorded writes of ``batch_id``, oldest first."""
        with conn.cursor(row_factory=_WRITE_ROWS) as cur:
            return cur.execute(self.queries["spark_write_counts"], {"batch_id": batch_id}).fetchall()

    def live_workers(
        self, conn: psycopg.Connection[Any], *, heartbeat_timeout_ms: int
    ) -> list[tuple[list[str], list[str]]]:
        """(queues, actors) of each worker process that heartbeated within ``heartbeat_timeout_ms``."""
        rows = conn.execute(
            self.queries["spark_live_workers"], {"heartbeat_timeout_ms": heartbeat_timeout_ms}
        ).fetchall()
        return [(list(queues), list(actors)) for queues, actors in rows]

    def backlog_id_range(self, conn: psycopg.Connection[Any]) -> IdRange | None:
        """The id range of the live messages; None when there is none."""
        row = conn.execute(self.queries["backlog_id_range"]).fetchone()
        return None if row is None or row[0] is None else IdRange(int(row[0]), int(row[1]))

    def backlog_rows(self, cur: psycopg.Cursor[Any], *, lo: int, hi: int) -> None:
        """Select the live messages of ids in [lo, hi) on ``cur``.

        Rows: ``(queue_name, actor_name, state, due, age_ms)``, the columns of
        ``spark_analytics.read_backlog``.
        """
        cur.execute(self.queries["backlog_rows"], {"lo": lo, "hi": hi})

    def backlog_range_messages(self, cur: psycopg.Cursor[Any], *, lo: int, hi: int) -> None:
        """Select the live messages of ids in [lo, hi) on ``cur``, without their payloads.

        Rows in the order of :data:`dramatiq_pg_outbox.spark.backlog.SCHEMA`.
        """
        cur.execute(self.queries["backlog_range_messages"], {"lo": lo, "hi": hi})

    def history_days(self, conn: psycopg.Connection[Any]) -> list[dt.date]:
        """The UTC days that may hold history rows, oldest first."""
        return [row[0] for row in conn.execute(self.queries["history_days"]).fetchall()]

    def history_range_rows(
        self,
        cur: psycopg.Cursor[Any],
        *,
        lo: int,
        hi: int,
        queues: Sequence[str] | None,
        actors: Sequence[str] | None,
        states: Sequence[str] | None,
    ) -> None:
        """Select the history rows finished in [lo, hi) epoch ms on ``cur``, of the given values (None: any).

        Rows in the order of :data:`dramatiq_pg_outbox.spark.history.SCHEMA`.
        """
        params = {
            "lo": lo,
            "hi": hi,
            "queues": None if queues is None else list(queues),
            "actors": None if actors is None else list(actors),
            "states": None if states is None else list(states),
        }
        cur.execute(self.queries["history_range_rows"], params)


__all__ = ["IdRange", "SparkStore"]
