"""Writing one partition on an executor: COPY into a staging table, insert what is new, NOTIFY once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .._queries import queries_for_schema
from ..names import PARK_AFTER_MS

if TYPE_CHECKING:
    pass
from .encoding import EnqueueError, _encode_rows, _Plan
from .options import connect


def write_prepared_partition(plan: _Plan, batches: Iterable[Any]) -> tuple[int, int]:
    """Write Arrow batches of (message_id, idempotency_key, payload) in one transaction.

    The batches go to COPY as CSV written by Arrow (no Python per row).
    """
    import io

    from pyarrow import csv

    iterator = iter(batches)
    first = next((b for b in iterator if b.num_rows), None)
    if first is None:
        return 0, 0
    options = csv.WriteOptions(include_header=False)
    key_name = plan.columns[plan.key]

    def feed(copy: Any) -> int:
        read = 0
        for batch in _chain(first, iterator):
            if batch.column(1).null_count:
                raise EnqueueError(
                    f"Column {key_name!r} (the key) is null in a row of batch {plan.batch_id!r}; "
                    "every row needs a key"
                )
            buffer = io.BytesIO()
            csv.write_csv(batch, buffer, options)
            copy.write(buffer.getvalue())
            read += batch.num_rows
        return read

    return _write_stage(plan, "spark_copy_text", feed)


def write_partition(plan: _Plan, rows: Iterable[Any]) -> tuple[int, int]:
    """Write one partition's rows (tuples in ``plan.columns`` order) in one transaction.

    Runs on an executor; encodes each row in Python with ``plan.encoder``.

    Returns:
      tuple[int, int]: (rows read, messages enqueued).
    """
    iterator = iter(rows)
    first = next(iterator, None)
    if first is None:
        return 0, 0
    now_ms = int(time.time() * 1000)

    def feed(copy: Any) -> int:
        read = 0
        copy.set_types(["text", "text", "bytea"])
        for record in _encode_rows(plan, _chain(first, iterator), now_ms):
            copy.write_row(record)
            read += 1
        return read

    return _write_stage(plan, "spark_copy_binary", feed)


def _write_stage(plan: _Plan, copy_query: str, feed: Callable[[Any], int]) -> tuple[int, int]:
    """One transaction: COPY into a temporary table, insert what is new, verify, NOTIFY once."""
    queries = queries_for_schema(plan.schema)
    with connect(plan.conninfo) as conn:
        with conn.cursor() as cur:
            cur.execute(queries["spark_stage"])
            with cur.copy(queries[copy_query]) as copy:
                read = feed(copy)
            cur.execute(
                queries["spark_insert"],
                {
                    "queue_name": plan.queue_name,
                    "actor_name": plan.actor_name,
                    "delay": plan.delay_ms,
                    "priority": plan.priority,
                    "park_after_ms": PARK_AFTER_MS,
                },
            )
            enqueued = cur.rowcount
            if enqueued:
                cur.execute(queries["spark_drop_twins"])
                enqueued -= cur.rowcount
            if enqueued and plan.notify and plan.delay_ms == 0:
                cur.execute(queries["notify"], {"channel": plan.channel, "queue_names": [plan.queue_name]})
    return read, enqueued


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


#: Where Debian's ``libpostgresql-jdbc-java`` puts the PostgreSQL JDBC driver.
