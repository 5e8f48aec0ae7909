"""Writing one partition on an executor: COPY into a staging table, insert what is new, NOTIFY once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..store.spark import SparkStore
from .encoding import (
    Plan,
    arrow_rows,
    batch_encodable,
    encode_batch,
    encode_rows,
    portable_batch,
    repeated_key,
)
from .options import connect


def write_arrow_partition(plan: Plan, batches: Iterable[Any]) -> tuple[int, int, int]:
    """Write one task's Arrow batches (at least ``plan.columns``) in one transaction.

    The writer of both ``df.write.format("dramatiq")`` and ``enqueue_dataframe``.  In the
    common case (:func:`~.encoding.batch_encodable`) each batch is encoded column at a time
    (:func:`~.encoding.encode_batch`) and goes to COPY as CSV written by Arrow, no Python
    per row but one SHA-1; else row by row (:func:`write_partition`).

    Returns:
      tuple[int, int, int]: (rows read, messages enqueued, rows whose key an earlier row of
      the partition has: see :func:`_write_stage`).

    Raises:
      EnqueueError: A null key, a value the encoder refuses, or a repeated key with
        ``on_duplicate_key="error"`` (nothing of the task is written).
    """
    import io

    from pyarrow import csv

    names = list(plan.columns)
    iterator = (portable_batch(plan, batch.select(names)) for batch in batches)
    first = next((b for b in iterator if b.num_rows), None)
    if first is None:
        return 0, 0, 0
    if not batch_encodable(plan, first.schema):
        return write_partition(plan, arrow_rows(_chain(first, iterator)))
    now_ms = int(time.time() * 1000)
    options = csv.WriteOptions(include_header=False)

    def feed(copy: Any) -> int:
        read = 0
        for batch in _chain(first, iterator):
            if batch.num_rows:
                buffer = io.BytesIO()
                csv.write_csv(encode_batch(plan, batch, now_ms), buffer, options)
                copy.write(buffer.getvalue())
                read += batch.num_rows
        return read

    return _write_stage(plan, feed, binary=False)


def write_partition(plan: Plan, rows: Iterable[Any]) -> tuple[int, int, int]:
    """Write one partition's rows (tuples in ``plan.columns`` order) in one transaction.

    Runs on an executor; encodes each row in Python with ``plan.encoder``.

    Returns:
      tuple[int, int, int]: (rows read, messages enqueued, rows repeating a key).
    """
    iterator = iter(rows)
    first = next(iterator, None)
    if first is None:
        return 0, 0, 0
    now_ms = int(time.time() * 1000)

    def feed(copy: Any) -> int:
        read = 0
        copy.set_types(["text", "text", "bytea"])
        for record in encode_rows(plan, _chain(first, iterator), now_ms):
            copy.write_row(record)
            read += 1
        return read

    return _write_stage(plan, feed, binary=True)


def _write_stage(plan: Plan, feed: Callable[[Any], int], *, binary: bool) -> tuple[int, int, int]:
    """One transaction: COPY into a temporary table, insert what is new, NOTIFY once.

    What is new is inserted by a plain INSERT after the staged rows of known keys are
    dropped (``spark_drop_known``, ``spark_insert_new``); ``INSERT ... ON CONFLICT DO
    NOTHING`` (``spark_insert``) costs about 1.5x as much per row (speculative insertion;
    benchmarks/README.md section 17b) and runs only when the plain insert meets a key
    claimed since or one the partition repeats.  Each statement claims its keys in
    ``idempotency_keys`` (migration 0014), whose rows the archive leaves alone: a twin
    task's key is refused whether its message waits, runs or was archived meanwhile.

    A key the partition's rows hold twice: with ``on_duplicate_key="skip"`` the first row
    is enqueued and the others counted (third figure returned; counted among the keys
    not known before, in the fallback only: the plain insert succeeding proves there are
    none); with ``"error"`` the staged rows are checked before anything else and the task
    fails (:func:`~.encoding.repeated_key`).  A key repeated across partitions looks like
    a retried task's and is skipped as known.
    """
    from psycopg.errors import UniqueViolation

    store = SparkStore(plan.schema)
    with connect(plan.conninfo) as conn:
        with conn.cursor() as cur:
            store.stage(cur)
            with store.copy_binary(cur) if binary else store.copy_text(cur) as copy:
                read = feed(copy)
            repeated = 0
            if plan.on_duplicate_key == "error":
                repeated, key = store.stage_repeats(cur)
                if repeated:
                    raise repeated_key(plan, str(key), repeated)
            store.drop_known(cur)
            into = {"queue_name": plan.queue_name, "actor_name": plan.actor_name}
            try:
                with conn.transaction():
                    enqueued = store.insert_new(cur, **into, delay_ms=plan.delay_ms, priority=plan.priority)
            except UniqueViolation:
                # A twin task claimed some of these keys since the check, or the
                # partition holds a key twice: skip each key claimed elsewhere instead.
                repeated, _ = store.stage_repeats(cur)
                enqueued = store.insert(cur, **into, delay_ms=plan.delay_ms, priority=plan.priority)
            if enqueued and plan.notify and plan.delay_ms == 0:
                store.notify(cur, channel=plan.channel, queue_names=[plan.queue_name])
    return read, enqueued, repeated


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest
