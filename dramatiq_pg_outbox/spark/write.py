"""Writing one partition on an executor: COPY its messages straight into the table when every key is
new, else into a staging table and insert what is new; NOTIFY once."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..store.spark import SparkStore
from .encoding import (
    COPY_BINARY_HEADER,
    COPY_BINARY_TRAILER,
    Plan,
    arrow_rows,
    batch_encodable,
    batch_keys,
    copy_binary_rows,
    encode_batch,
    encode_rows,
    portable_batch,
    repeated_key,
)
from .options import connect

#: Most bytes of a task's Arrow batches (the plan's columns) held in memory for the direct
#: write (:func:`_write_direct`); a larger partition streams through the staging table.
DIRECT_BYTES = 64 << 20


def write_arrow_partition(plan: Plan, batches: Iterable[Any]) -> tuple[int, int, int]:
    """Write one task's Arrow batches (at least ``plan.columns``) in one transaction.

    The writer of both ``df.write.format("dramatiq")`` and ``enqueue_dataframe``.  In the
    common case (:func:`~.encoding.batch_encodable`) each batch is encoded column at a time
    (:func:`~.encoding.encode_batch`), no Python per row but one SHA-1; else row by row
    (:func:`write_partition`).

    A partition whose batches hold at most :data:`DIRECT_BYTES` (the plan's columns, before
    encoding) and that has no delay is kept in memory and first written directly
    (:func:`_write_direct`: its keys claimed, its messages COPYed into the table, no
    staging); if a key is taken already or repeats, that attempt is rolled back and the
    task writes through the staging table (:func:`_write_stage`), as a larger partition
    does from the start, streaming.  Either way the same rows, counts and guarantees.

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
    held, size = [first], first.nbytes
    whole = plan.delay_ms == 0 and size <= DIRECT_BYTES
    while whole:
        batch = next(iterator, None)
        if batch is None:
            break
        if batch.num_rows:
            held.append(batch)
            size += batch.nbytes
            whole = size <= DIRECT_BYTES
    options = csv.WriteOptions(include_header=False)

    def feed(copy: Any) -> int:
        read = 0
        for batch in itertools.chain(held, iterator):
            if batch.num_rows:
                buffer = io.BytesIO()
                csv.write_csv(encode_batch(plan, batch, now_ms), buffer, options)
                copy.write(buffer.getvalue())
                read += batch.num_rows
        return read

    with connect(plan.conninfo) as conn:
        if whole:
            written = _write_direct(conn, plan, held, now_ms)
            if written is not None:
                return written
        return _write_stage(conn, plan, feed, binary=False)


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

    with connect(plan.conninfo) as conn:
        return _write_stage(conn, plan, feed, binary=True)


class _Taken(Exception):
    """A key of the direct write is taken already (rolls its transaction back)."""


def _write_direct(conn: Any, plan: Plan, batches: list[Any], now_ms: int) -> tuple[int, int, int] | None:
    """One transaction that writes a whole partition without staging its messages, or None.

    Three COPYs (binary, framed by Arrow: :func:`~.encoding.copy_binary_rows`): every key, in
    order, into ``idempotency_keys`` (``spark_copy_claims``: the primary key refuses a key
    taken already, by a message waiting, running or archived or by a twin task, and a key
    the partition repeats), the same keys alone into ``dpo_stage`` to look them up in history
    (``spark_drop_in_history``: keys stored by an older version without their row), then
    the messages straight into the table (``spark_copy_messages``; its unique key index
    refuses a key whose message an older version stored without its row); one NOTIFY.

    Returns:
      tuple[int, int, int] | None: (rows, rows, 0): every row enqueued; None: a key was
      taken or repeated, and nothing was written (the transaction rolled back): the caller
      writes through the staging table, which skips and counts such keys.

    Raises:
      EnqueueError: As :func:`~.encoding.encode_batch` (nothing written).
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    from psycopg.errors import UniqueViolation

    store = SparkStore(plan.schema)
    keys = pa.concat_arrays([batch_keys(plan, batch) for batch in batches])
    rows = len(keys)
    # The keys in order: twin tasks claim them alike (neither waits on the other's next key:
    # no deadlock), and the keys of a batch id above the others' fill the index's right edge.
    ordered = copy_binary_rows([pc.take(keys, pc.sort_indices(keys))])
    framed = [COPY_BINARY_HEADER, ordered, COPY_BINARY_TRAILER]
    constants = (plan.queue_name.encode(), plan.actor_name.encode())
    tail = (plan.priority.to_bytes(2, "big", signed=True), (-1).to_bytes(2, "big", signed=True))
    try:
        with conn.transaction(), conn.cursor() as cur:
            with store.copy_claims(cur) as copy:
                for data in framed:
                    copy.write(data)
            store.stage(cur)
            with store.copy_stage_keys(cur) as copy:
                for data in framed:
                    copy.write(data)
            if store.drop_in_history(cur):
                raise _Taken
            with store.copy_messages(cur) as copy:
                copy.write(COPY_BINARY_HEADER)
                for batch in batches:
                    message_id, key, payload = encode_batch(plan, batch, now_ms).columns
                    copy.write(copy_binary_rows([*constants, message_id, key, payload, *tail]))
                copy.write(COPY_BINARY_TRAILER)
            if plan.notify:
                store.notify(cur, channel=plan.channel, queue_names=[plan.queue_name])
    except (UniqueViolation, _Taken):
        return None
    return rows, rows, 0


def _write_stage(conn: Any, plan: Plan, feed: Callable[[Any], int], *, binary: bool) -> tuple[int, int, int]:
    """One transaction on ``conn``: COPY into a temporary table, insert what is new, NOTIFY once.

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
