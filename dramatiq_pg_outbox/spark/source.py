"""The ``dramatiq`` Spark data source: ``df.write.format("dramatiq")`` enqueues one message per row.

Usage (PySpark 4's Python Data Source API; ``pip install 'dramatiq-pg-outbox[spark]'``)::

    from dramatiq_pg_outbox.spark import register

    register(spark)                       # spark.dataSource.register(DramatiqDataSource)
    (customers.write.mode("append")       # required: Spark refuses its default mode itself
        .format("dramatiq")
        .option("url", "postgresql://app@db/app")
        .option("actor", "notify_customer")
        .option("queue", "notifications")
        .option("batch", "newsletter-2026-11")
        .option("key", "customer_id")
        .option("args", "customer_id,email")
        .option("kwargs", "segment=segment")
        .save())

Each partition is written by its executor's Python worker, by the code that
:func:`~dramatiq_pg_outbox.spark.enqueue_dataframe` runs too
(:func:`~dramatiq_pg_outbox.spark.write.write_arrow_partition`: one transaction, a ``COPY``
of the messages straight into the table when every key is new, else into a temporary table
and one ``INSERT`` of the keys not yet known; one ``NOTIFY``), with
the same idempotency key ``"<batch>:<key>"``, the same uuid5 message id and the same
errors: a re-run with the same ``batch`` adds only what is missing.

Options (strings, as Spark passes them):

- ``url`` (required): the database URL, e.g. ``postgresql://app@db/app``.
- ``actor`` (required): the actor's name.
- ``batch`` (required): identifies this enqueue job; re-running it adds nothing.
- ``key`` (required): the column that identifies a row within the batch (not null).
- ``queue``: the queue, default ``default``.
- ``args``: columns passed as positional arguments, comma-separated.
- ``kwargs``: keyword arguments, ``name=column`` pairs, comma-separated.
- ``schema``: the broker's schema, default ``dramatiq``.
- ``delay``: delay before the messages are due, in milliseconds (default 0).
- ``notify``: ``true`` (default) wakes listening workers, one ``NOTIFY`` per partition.
- ``options``: extra message options as a JSON object, e.g. ``{"max_retries": 3}``.
- ``max_message_bytes``: the largest encoded message, in bytes (default 1048576), or
  ``none``; a larger row fails its task, naming the row.
- ``check_database``: ``true`` (default) checks on the driver, when the write is planned,
  that the database answers and the schema is migrated (one connection of a few seconds
  at most, closed at once); ``false`` skips it, for a driver that cannot reach the
  database (the tasks then fail on the same causes, each retried).
- ``check_actor``: ``false`` (default); ``true`` refuses the write on the driver unless a live
  worker process (one that heartbeated in the last 20 s) consumes the queue and declares the
  actor, naming the actors it declares: a typo in ``actor`` would otherwise dead-letter every
  message as ``ActorNotFound``, and a queue that no worker consumes keep them pending.
  Workers record their actors with each heartbeat (migration 0020; a worker of an older
  version records none).
- ``decimals``: ``string`` (default) or ``float``, how a decimal argument is written.
- ``on_duplicate_key``: ``skip`` (default: one message per key, repeats counted) or ``error``
  (a task whose partition holds a key twice fails and writes nothing).

What a write did: ``save()`` returns nothing (PySpark's Python API has no hook for
it), so the source's ``commit()`` (on the driver's side, once every task committed)
logs one line (logger ``dramatiq_pg_outbox.spark``) and records the figures in the
``spark_writes`` table (migration 0019), which
:func:`~dramatiq_pg_outbox.spark.write_counts` reads back (``EnqueueResult`` objects): rows,
messages enqueued, keys already there, keys repeated in a partition, tasks, seconds.

Payloads are encoded with the driver's ``dramatiq.get_encoder()`` at the time of
``save()``.  Only ``mode("append")`` is supported, and it must be given: Spark refuses
its default mode (``ErrorIfExists``) before the data source runs, suggesting "Append" or
"Overwrite", and the data source refuses an overwrite.  ``spark.read.format("dramatiq")``
is refused: the history and the live messages are read with ``dramatiq_history`` and
``dramatiq_backlog``.

Raises (from ``save()``, or ``start()`` for a stream, before any task of the write): ``ValueError``
naming the option for a missing or bad option (a JDBC ``url``: how to write it) or an
unknown column; with ``check_database`` on, one line naming the fix for a server that
cannot be reached (``dramatiq.errors.ConnectionFailed``), a connection it refuses, such
as a missing database (``dramatiq_pg_outbox.errors.ConnectionRejected``), or a schema not
migrated (:class:`~dramatiq_pg_outbox.SchemaNotReady`: the ``dramatiq-pg-outbox migrate``
command); Spark wraps them: that line is the last of its error, but its ``SQLSTATE``.  While the tasks
run: the Spark job's error carrying :class:`~dramatiq_pg_outbox.spark.EnqueueError` (the
row's key and the column) for a null key or an argument the encoder refuses: that
partition writes nothing, others may have committed, and a re-run with the same
``batch`` completes the job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from ..names import channel_for, validate_queue_name
from ..options import MAX_MESSAGE_BYTES
from ..store.spark import SparkStore
from .encoding import DECIMALS, ON_DUPLICATE_KEY, Plan
from .options import check_database, connect, given_options
from .write import write_arrow_partition

logger = logging.getLogger("dramatiq_pg_outbox.spark")

#: The options the data source reads; any other is refused (a typo would otherwise be ignored).
OPTIONS = (
    "url",
    "actor",
    "batch",
    "key",
    "queue",
    "args",
    "kwargs",
    "schema",
    "delay",
    "notify",
    "options",
    "max_message_bytes",
    "decimals",
    "on_duplicate_key",
    "check_database",
    "check_actor",
)
REQUIRED = ("url", "actor", "batch", "key")
#: The message of ``spark.read.format("dramatiq")``.
WRITE_ONLY = 'format("dramatiq") is write-only; read with dramatiq_history or dramatiq_backlog'


class DramatiqDataSource(DataSource):
    """``format("dramatiq")``: write a DataFrame as messages (see the module's documentation)."""

    @classmethod
    def name(cls) -> str:
        return "dramatiq"

    def schema(self) -> str:
        raise ValueError(WRITE_ONLY)

    def reader(self, schema: Any) -> Any:
        raise ValueError(WRITE_ONLY)

    def streamReader(self, schema: Any) -> Any:
        raise ValueError(WRITE_ONLY)

    def writer(self, schema: Any, overwrite: bool) -> DataSourceArrowWriter:
        if overwrite:
            raise ValueError(
                'use .mode("append"): format("dramatiq") only appends messages (a re-run with the '
                "same batch option adds only what is missing)"
            )
        return _Writer(checked_plan(self.options, schema))

    def streamWriter(self, schema: Any, overwrite: bool) -> DataSourceStreamArrowWriter:
        return _StreamWriter(checked_plan(self.options, schema))


@dataclass
class Written(WriterCommitMessage):
    """What one task wrote: rows read, messages enqueued, rows repeating a key of the partition
    (the rest were already there)."""

    rows: int
    enqueued: int
    repeated: int = 0


class _Writer(DataSourceArrowWriter):
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        #: When the write was planned (the driver's clock): its figures count the seconds from here.
        self.planned_at = time.time()

    def write(self, iterator: Iterator[Any]) -> Written:
        return _write(self.plan, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every task committed: log and record what the write did (see the module's documentation)."""
        record_write(self.plan, messages, spark_batch=-1, seconds=time.time() - self.planned_at)


def record_write(plan: Plan, messages: Sequence[WriterCommitMessage | None], *, spark_batch: int,
                 seconds: float) -> None:  # fmt: skip
    """Log one line and store one row of ``spark_writes`` with the tasks' counts.

    The messages are committed already: a failure to record is logged, never raised.
    """
    written = [m for m in messages if isinstance(m, Written)]
    rows = sum(w.rows for w in written)
    enqueued = sum(w.enqueued for w in written)
    repeated = sum(w.repeated for w in written)
    figures = {"tasks": len(written), "rows": rows, "enqueued": enqueued,
               "skipped": rows - enqueued - repeated, "repeated": repeated}  # fmt: skip
    where = plan.batch_id if spark_batch < 0 else f"{plan.batch_id} micro-batch {spark_batch}"
    logger.info(
        'format("dramatiq") batch %s: %s rows, %s enqueued, %s already there, %s repeated in a partition, '
        "%s tasks, %.1f s", where, f"{rows:,}", f"{enqueued:,}", f"{figures['skipped']:,}",
        f"{repeated:,}", len(written), seconds,
    )  # fmt: skip
    try:
        with connect(plan.conninfo) as conn:
            SparkStore(plan.schema).record_write(
                conn, batch_id=plan.batch_id, spark_batch=spark_batch, seconds=seconds, **figures
            )
    except Exception as e:  # the rows are written: say why the figures are not, and go on
        logger.warning("the figures of batch %s were not recorded: %s", where, str(e).splitlines()[0])


def _write(plan: Plan, batches: Iterator[Any]) -> Written:
    """One task's Arrow batches, the plan's columns only, written as one transaction."""
    return Written(*write_arrow_partition(plan, batches))


#: The local properties by which Spark's micro-batch execution tells its tasks which
#: streaming query and which batch they run (StreamExecution.QUERY_ID_KEY and
#: MicroBatchExecution.BATCH_ID_KEY); tests/test_spark.py pins that executors see them.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"


class _StreamWriter(DataSourceStreamArrowWriter):
    """Each micro-batch exactly once: its rows' keys name the query and the batch.

    Spark runs a micro-batch again after a failure (a killed driver restarted from its
    checkpoint, a failed task) with the same batch id and the same rows; the idempotency
    key ``"<batch>:<query id>:<batch id>:<key>"`` makes the second write add nothing.
    ``write`` runs on the executors, which Spark does not pass the batch id: it is read
    from the task's local properties, which micro-batch execution sets for every job.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> Written:
        import dataclasses

        from pyspark import TaskContext

        context = TaskContext.get()
        query = context.getLocalProperty(QUERY_ID_PROPERTY) if context is not None else None
        batch = context.getLocalProperty(BATCH_ID_PROPERTY) if context is not None else None
        if not query or batch is None:
            raise RuntimeError(
                f'format("dramatiq") streaming: the task does not carry {QUERY_ID_PROPERTY!r} and '
                f"{BATCH_ID_PROPERTY!r}; exactly-once needs Spark's micro-batch execution"
            )
        return _write(
            dataclasses.replace(self.plan, batch_id=f"{self.plan.batch_id}:{query}:{batch}"), iterator
        )

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Every task committed its own rows (the keys make replays harmless): log and record the figures."""
        record_write(self.plan, messages, spark_batch=batchId, seconds=0.0)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: Spark runs the batch again with the same id, which adds only what is missing."""


#: How to turn the driver's check off, in its error.
SKIP_CHECK = '.option("check_database", "false")'
SKIP_ACTOR_CHECK = '.option("check_actor", "false")'


def checked_plan(options: Mapping[str, str], schema: Any) -> Plan:
    """The write plan of the options against the DataFrame's ``schema`` (a StructType), once
    the database is checked from the driver (option ``check_database``, :func:`check_database`).

    Runs where Spark plans the write, before any task.

    With ``check_actor`` true (default false), the same connection checks that a live worker
    of the queue declares the actor (:func:`~.options.check_actor`), even if ``check_database``
    is false.

    Raises:
      ValueError: As :func:`plan_from_options`, or ``check_database`` or ``check_actor``
        neither true nor false.
      dramatiq.errors.ConnectionFailed, dramatiq_pg_outbox.errors.ConnectionRejected,
      dramatiq_pg_outbox.SchemaNotReady: From :func:`check_database`.
      dramatiq_pg_outbox.spark.UnknownActor: From :func:`~.options.check_actor`.
    """
    plan = plan_from_options(options, [field.name for field in schema.fields])
    given = {str(k).lower(): str(v) for k, v in options.items()}
    check, actor = (
        _flag(given, name, default)
        for name, default in (("check_database", "true"), ("check_actor", "false"))
    )
    if check or actor:
        check_database(
            given["url"], plan.conninfo, plan.schema, skip=SKIP_CHECK if check else SKIP_ACTOR_CHECK,
            actor=(plan.actor_name, plan.queue_name, SKIP_ACTOR_CHECK) if actor else None,
        )  # fmt: skip
    return plan


def _flag(given: Mapping[str, str], name: str, default: str) -> bool:
    value = given.get(name, default).strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"option {name!r} is true or false, not {given[name]!r}")
    return value == "true"


def plan_from_options(options: Mapping[str, str], columns: list[str]) -> Plan:
    """The write plan of the data source's options against the DataFrame's columns.

    Raises:
      ValueError: Naming the option: a required one missing, an unknown one, a bad value
        or a column that the DataFrame lacks.
    """
    import dramatiq
    from dramatiq.common import q_name

    from .._runtime.messages import broker_priority

    given, conninfo, schema = given_options(options, "dramatiq", OPTIONS, REQUIRED)

    def column(option: str, name: str) -> str:
        if name not in columns:
            raise ValueError(f"option {option!r} names the column {name!r}, which is not in {columns}")
        return name

    key = column("key", given["key"].strip())
    args = [column("args", c.strip()) for c in given.get("args", "").split(",") if c.strip()]
    kwargs: dict[str, str] = {}
    for pair in (p.strip() for p in given.get("kwargs", "").split(",") if p.strip()):
        name, equals, col = pair.partition("=")
        if not equals or not name.strip().isidentifier():
            raise ValueError(f"option 'kwargs' takes name=column pairs separated by commas, not {pair!r}")
        kwargs[name.strip()] = column("kwargs", col.strip())
    try:
        queue_name = q_name(validate_queue_name(given.get("queue", "default")))
    except ValueError as e:
        raise ValueError(f"option 'queue': {e}") from None
    try:
        delay = int(given.get("delay", "0"))
    except ValueError:
        raise ValueError(f"option 'delay' is a number of milliseconds, not {given['delay']!r}") from None
    if delay < 0:
        raise ValueError(f"option 'delay' is a non-negative number of milliseconds, not {delay}")
    notify = given.get("notify", "true").lower()
    if notify not in ("true", "false"):
        raise ValueError(f"option 'notify' is true or false, not {given['notify']!r}")
    try:
        message_options = json.loads(given.get("options", "{}"))
    except json.JSONDecodeError as e:
        raise ValueError(f"option 'options' is not JSON ({e})") from None
    if not isinstance(message_options, dict):
        raise ValueError(f"option 'options' is a JSON object, not {given['options']!r}")
    try:
        priority = broker_priority(message_options)
    except ValueError as e:
        raise ValueError(f"option 'options': {e}") from None
    limit = given.get("max_message_bytes", str(MAX_MESSAGE_BYTES)).strip()
    try:
        max_bytes = None if limit.lower() == "none" else int(limit)
        if max_bytes is not None and max_bytes < 1:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"option 'max_message_bytes' is a number of bytes >= 1 or none, not {limit!r}"
        ) from None
    decimals = given.get("decimals", "string").strip().lower()
    if decimals not in DECIMALS:
        raise ValueError(f"option 'decimals' is string or float, not {given['decimals']!r}")
    on_duplicate_key = given.get("on_duplicate_key", "skip").strip().lower()
    if on_duplicate_key not in ON_DUPLICATE_KEY:
        raise ValueError(f"option 'on_duplicate_key' is skip or error, not {given['on_duplicate_key']!r}")
    return Plan.build(
        key=key,
        args=args,
        kwargs=kwargs,
        decimals=decimals,
        on_duplicate_key=on_duplicate_key,
        conninfo=conninfo,
        schema=schema,
        channel=channel_for(schema),
        queue_name=queue_name,
        actor_name=given["actor"],
        batch_id=given["batch"],
        options=message_options,
        delay_ms=delay,
        priority=priority,
        notify=notify == "true",
        encoder=dramatiq.get_encoder(),
        max_bytes=max_bytes,
    )


def register(spark: Any) -> None:
    """Make ``format("dramatiq")``, ``format("dramatiq_history")`` and ``format("dramatiq_backlog")``
    known to ``spark`` (a SparkSession)."""
    from .backlog import register as register_backlog
    from .history import register as register_history

    spark.dataSource.register(DramatiqDataSource)
    register_history(spark)
    register_backlog(spark)
