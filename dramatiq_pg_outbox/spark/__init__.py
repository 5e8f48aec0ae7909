"""Bulk enqueue from a Spark DataFrame: one Dramatiq message per row.

Usage (``pip install 'dramatiq-pg-outbox[spark]'``)::

    from dramatiq_pg_outbox.spark import enqueue_dataframe

    result = enqueue_dataframe(
        customers,                     # a pyspark.sql.DataFrame
        notify_customer,               # a dramatiq Actor (or its name, with queue_name=)
        args=["customer_id", "email"], # columns -> positional arguments
        kwargs={"segment": "segment"}, # keyword argument -> column
        key="customer_id",             # the row's unique key
        batch_id="newsletter-2026-11", # the same id on a re-run adds nothing
        url="postgresql://app@db/app",
    )
    print(result.enqueued, result.skipped)

How it writes
-------------
The executors write, not the driver: each partition's task (``mapInArrow``)
runs one transaction on one connection: a ``COPY`` into a temporary table,
the rows of keys already known dropped from it, one ``INSERT ... SELECT`` of
the rest into the messages table (``ON CONFLICT DO NOTHING`` only if a twin
task wrote some of those keys meanwhile), then at most one ``NOTIFY``
(delivered at commit).  Rows stream into
``COPY`` batch by batch, so a large partition is never held in memory.
A partition whose columns take at most 64 MiB (``write.DIRECT_BYTES``; without
a delay) is held, and written first without the temporary table: a ``COPY``
of its keys into ``idempotency_keys``, which refuses a key taken already or
repeated, then a ``COPY`` of its messages straight into the table; a refused
key rolls that attempt back and the task writes through the temporary table
as above, with the same result (issue 34; the time against a bare ``COPY`` of
the messages: benchmarks/README.md, section 17, "The floor row").

Each task runs the writer of ``df.write.format("dramatiq")``
(:func:`~dramatiq_pg_outbox.spark.write.write_arrow_partition`): one code path
for both, which builds the payloads one of two ways, with the same bytes:

- column at a time with Arrow compute, when the encoder is Dramatiq's default
  JSON encoder, the key is a string or integer column and the arguments are
  string, boolean, integer or floating point columns: Python runs per row only
  for the uuid5 id (and for the few strings JSON must escape), and Arrow writes
  the batches to ``COPY`` as CSV;
- else row by row, with the driver's encoder (custom encoders such as pickle,
  arrays, structs, ...).  A value the encoder refuses fails the job.

With the JSON encoder, timestamp, date and decimal arguments are written as text
first (:func:`~dramatiq_pg_outbox.spark.encoding.portable_batch`): a
``TimestampType`` as ISO 8601 in UTC with ``+00:00``, a ``TimestampNTZType``
without an offset, a ``DateType`` as ``YYYY-MM-DD``, a ``DecimalType`` as its
exact text (or a float: ``decimals="float"``, option ``decimals``).

Idempotency
-----------
Every row gets the idempotency key ``"<batch_id>:<key>"`` and the message id
``uuid5(NAMESPACE, that key)``.  The database keeps one message per key (the
unique index of migration 0002, and the key is looked up in history too), so
a Spark task that is retried, a speculative duplicate task, or a re-run of
the whole job with the same ``batch_id`` adds nothing that already exists,
whether or not the messages were processed in between.  A second statement in
the same transaction removes any row whose twin was archived to history while
the insert ran, so this holds even while workers are acking.

Bad input
---------
A null key, or an argument that the message encoder cannot encode (with the
default JSON encoder: a map with non-string keys, a binary column...; cast such columns first),
raises :class:`EnqueueError` naming the column and the row's key.  The
partition's transaction is rolled back (it writes nothing) and the Spark job
fails.  Other partitions may have committed: run the job again with the same
``batch_id`` once the data is fixed; it adds only what is missing.

Connection budget
-----------------
One connection per running task, for the length of the task: at most
``min(number of partitions, total executor cores)`` connections at a time.
Use ``max_partitions=`` to cap it (the DataFrame is coalesced).  The driver
opens one, for a few seconds at most, before any task: it checks that the
database answers and its schema is migrated, so that an unreachable server, a
missing database or an unmigrated schema fails at once with one line naming
the fix instead of failing every task (``check_database=False``, or the data
source's option ``check_database`` ``false``, skips it, for a driver that
cannot reach the database).

The messages are ordinary messages: a ``dramatiq`` worker with a
:class:`~dramatiq_pg_outbox.PostgresBroker` on the same schema processes them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .._jdbc import jdbc_options
from ..names import DEFAULT_SCHEMA, channel_for, validate_schema_name
from ..options import MAX_MESSAGE_BYTES, integer, optional
from ..urls import libpq_url

if TYPE_CHECKING:
    from dramatiq import Actor
    from dramatiq.encoder import Encoder
    from pyspark.sql import DataFrame
from .encoding import (
    DECIMALS,
    NAMESPACE,
    ON_DUPLICATE_KEY,
    EnqueueError,
    EnqueueResult,
    Plan,
    encode_rows,
    idempotency_key_for,
    message_id_for,
)
from .options import UnknownActor
from .options import check_database as check_database_from_driver
from .write import write_arrow_partition, write_partition

__all__ = [
    "NAMESPACE",
    "EnqueueError",
    "EnqueueResult",
    "Plan",
    "UnknownActor",
    "cluster_session",
    "encode_rows",
    "enqueue_dataframe",
    "idempotency_key_for",
    "jdbc_jar",
    "jdbc_options",
    "local_session",
    "message_id_for",
    "register",
    "write_arrow_partition",
    "write_counts",
    "write_partition",
]


def enqueue_dataframe(
    df: DataFrame,
    actor: Actor[Any, Any] | str,
    *,
    key: str,
    batch_id: str,
    args: Sequence[str] = (),
    kwargs: Mapping[str, str] | None = None,
    url: str | None = None,
    schema: str | None = None,
    queue_name: str | None = None,
    options: Mapping[str, Any] | None = None,
    delay: int = 0,
    notify: bool = True,
    max_partitions: int | None = None,
    encoder: Encoder | None = None,
    max_message_bytes: int | Literal["broker"] | None = "broker",
    decimals: Literal["string", "float"] = "string",
    on_duplicate_key: Literal["skip", "error"] = "skip",
    check_database: bool = True,
    check_actor: bool = False,
) -> EnqueueResult:
    """Enqueue one message per row of ``df``, idempotently, written by the executors.

    Parameters:
      df(DataFrame): The rows.
      actor(Actor|str): The actor (its name and queue are used), or an actor name
        with ``queue_name=``.  The actor need not be importable on the executors.
      key(str): Column that identifies a row within the batch (not null).
      batch_id(str): Identifies this enqueue job; re-running with the same id adds nothing.
      args(list[str]): Columns passed as positional arguments, in order.
      kwargs(dict[str, str]): Keyword argument name -> column.
      url(str): Database URL.  Default: the URL of the actor's PostgresBroker.
      schema(str): The broker's schema.  Default: the actor's broker's, else ``dramatiq``.
      queue_name(str): Queue.  Default: the actor's queue.
      options(dict): Extra message options (e.g. ``max_retries``).
      delay(int): Delay before the messages are due, in milliseconds.
      notify(bool): Wake listening workers (one NOTIFY per partition, at commit).
      max_partitions(int): Cap on partitions, hence on concurrent connections.
      encoder(Encoder): Message encoder.  Default: ``dramatiq.get_encoder()`` of the driver.
      max_message_bytes(int | None): Largest encoded message, in bytes; a larger row fails its
        task with ``EnqueueError`` (nothing of its partition written).  Default ``"broker"``:
        the ``max_message_bytes`` of the actor's PostgresBroker, else 1 MiB.  None: no limit.
      decimals(str): How a ``DecimalType`` argument is written with the JSON encoder:
        ``"string"`` (default, its exact text) or ``"float"``.  Timestamps and dates are
        written as ISO 8601 text (see :func:`~.encoding.portable_batch`).
      on_duplicate_key(str): A key that several rows of ``df`` have: ``"skip"`` (default:
        one message, the others counted in ``EnqueueResult.repeated`` when they share a
        partition, in ``skipped`` when not) or ``"error"``: before any task writes, one
        Spark job (a group-by of the key) looks for repeated keys, and ``EnqueueError``
        names one and how many there are.
      check_database(bool): Check from the driver, before any task, that the database answers
        and the schema is migrated (one short connection).  Default True; False for a driver
        that cannot reach the database.
      check_actor(bool): Refuse the write, before any task, unless a live worker process
        consumes the queue and declares the actor (:func:`~.options.check_actor`: a typo
        would dead-letter every message as ``ActorNotFound``).  Default False.

    Raises:
      EnqueueError: (from the Spark job) a null key or an argument that cannot be encoded;
        a repeated key with ``on_duplicate_key="error"`` (before any write).
      ValueError: For bad parameters (unknown column, bad schema or queue name, a JDBC URL).
      dramatiq.errors.ConnectionFailed: (``check_database``) the server cannot be reached.
      dramatiq_pg_outbox.errors.ConnectionRejected: (``check_database``) it refuses the
        connection: no such database or role, a wrong password.
      SchemaNotReady: (``check_database``) the schema is not migrated; the message names the
        ``dramatiq-pg-outbox migrate`` command.
      UnknownActor: (``check_actor``) no live worker of the queue declares the actor.

    Returns:
      EnqueueResult: Counts and timing.
    """
    import dramatiq
    from dramatiq.common import q_name

    from .._runtime.messages import broker_priority
    from ..broker import PostgresBroker
    from ..names import validate_queue_name

    plan_args = tuple(args)
    plan_kwargs = tuple((kwargs or {}).items())
    if not isinstance(batch_id, str) or not batch_id:
        raise ValueError(f"batch_id must be a non-empty string, not {batch_id!r}")
    if isinstance(actor, str):
        actor_name, broker = actor, None
        if queue_name is None:
            raise ValueError("Pass queue_name= with an actor name.")
    else:
        actor_name, broker = actor.actor_name, actor.broker
        queue_name = queue_name or actor.queue_name
    queue_name = q_name(validate_queue_name(queue_name))
    pg_broker = broker if isinstance(broker, PostgresBroker) else None
    if url is None:
        if pg_broker is None:
            raise ValueError("Pass url= (the actor's broker is not a PostgresBroker).")
        conninfo = pg_broker.conninfo
    else:
        conninfo = libpq_url(url)
    if schema is None:
        schema = pg_broker.schema if pg_broker is not None else DEFAULT_SCHEMA
    validate_schema_name(schema)
    columns = set(df.columns)
    wanted = [key, *plan_args, *(column for _, column in plan_kwargs)]
    missing = [c for c in wanted if c not in columns]
    if missing:
        raise ValueError(f"Column(s) {missing} not in the DataFrame (columns: {sorted(columns)})")
    if delay < 0:
        raise ValueError(f"delay must be a non-negative number of milliseconds, not {delay!r}")
    priority = broker_priority(options or {})
    if max_message_bytes == "broker":
        max_bytes = pg_broker.options.max_message_bytes if pg_broker is not None else MAX_MESSAGE_BYTES
    else:
        max_bytes = optional(integer(1)).check("max_message_bytes", max_message_bytes)
    if decimals not in DECIMALS:
        raise ValueError(f"decimals is 'string' or 'float', not {decimals!r}")
    if on_duplicate_key not in ON_DUPLICATE_KEY:
        raise ValueError(f"on_duplicate_key is 'skip' or 'error', not {on_duplicate_key!r}")
    encoder = encoder or dramatiq.get_encoder()
    try:
        encoder.encode({"options": dict(options or {})})
    except Exception as e:
        raise ValueError(f"options cannot be encoded with {type(encoder).__name__}: {e}") from e
    plan = Plan.build(
        key=key,
        args=plan_args,
        kwargs=dict(plan_kwargs),
        conninfo=conninfo,
        schema=schema,
        channel=channel_for(schema),
        queue_name=queue_name,
        actor_name=actor_name,
        batch_id=batch_id,
        options=dict(options or {}),
        delay_ms=int(delay),
        priority=priority,
        notify=notify,
        encoder=encoder,
        max_bytes=max_bytes,
        decimals=decimals,
        on_duplicate_key=on_duplicate_key,
    )
    if max_partitions is not None and max_partitions < 1:
        raise ValueError(f"max_partitions must be at least 1, not {max_partitions!r}")
    if check_database or check_actor:
        check_database_from_driver(
            url if url is not None else conninfo, conninfo, schema,
            skip="check_database=False" if check_database else "check_actor=False",
            actor=(actor_name, queue_name, "check_actor=False") if check_actor else None,
        )  # fmt: skip
    selected = df.select(*plan.columns)
    if on_duplicate_key == "error":
        _refuse_repeated_keys(selected, key, batch_id)
    if max_partitions is not None:
        if selected.rdd.getNumPartitions() > max_partitions:
            selected = selected.coalesce(max_partitions)

    # Arrow carries the rows to the Python workers column by column; each task
    # writes its partition as format("dramatiq")'s writer does and returns its counts.
    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        read, enqueued, repeated = write_arrow_partition(plan, batches)
        yield pa.RecordBatch.from_pydict({"rows": [read], "enqueued": [enqueued], "repeated": [repeated]})

    started = time.perf_counter()
    try:
        counts = selected.mapInArrow(write, "rows long, enqueued long, repeated long").collect()
    except Exception as e:
        # An executor's EnqueueError reaches the driver inside Spark's own
        # exception; raise it as itself, with its message.
        found = re.search(r"EnqueueError: ([^\n]+)", str(e))
        if found:
            raise EnqueueError(found.group(1)) from e
        raise
    seconds = time.perf_counter() - started
    rows = sum(int(r["rows"]) for r in counts)
    enqueued = sum(int(r["enqueued"]) for r in counts)
    repeated = sum(int(r["repeated"]) for r in counts)
    return EnqueueResult(
        batch_id=batch_id,
        rows=rows,
        enqueued=enqueued,
        skipped=rows - enqueued - repeated,
        partitions=len(counts),
        seconds=seconds,
        repeated=repeated,
    )


def write_counts(url: str, batch_id: str, *, schema: str = DEFAULT_SCHEMA) -> list[EnqueueResult]:
    """What the writes of ``format("dramatiq")`` with option ``batch`` = ``batch_id`` did, oldest first.

    The figures :func:`enqueue_dataframe` returns, recorded by the data source's
    ``commit()`` once every task of a write committed (``spark_writes``, migration 0019):
    one result per write (a re-run is one more, with what it added), and per micro-batch
    of a streaming write (``batch_id`` then reads ``"<batch>@<micro-batch id>"``, and
    ``seconds`` is 0: Spark's progress reports time them).

    Parameters:
      url(str): The database URL (``postgresql://...``).
      batch_id(str): The write's ``batch`` option.
      schema(str): The broker's schema.  Default ``dramatiq``.

    Raises:
      psycopg.Error: The database cannot be reached, or is older than migration 0019.
    """
    from ..store.spark import SparkStore
    from .options import connect

    validate_schema_name(schema)
    with connect(libpq_url(url)) as conn:
        rows = SparkStore(schema).write_counts(conn, batch_id=batch_id)
    return [
        EnqueueResult(
            batch_id=r.batch_id if r.spark_batch < 0 else f"{r.batch_id}@{r.spark_batch}",
            rows=r.rows,
            enqueued=r.enqueued,
            skipped=r.skipped,
            partitions=r.tasks,
            seconds=r.seconds,
            repeated=r.repeated,
        )
        for r in rows
    ]


def _refuse_repeated_keys(df: DataFrame, key: str, batch_id: str) -> None:
    """Raise EnqueueError if two rows of ``df`` have the same ``key`` (one Spark job, a group-by)."""
    from pyspark.sql import functions as F

    repeats = df.groupBy(key).count().where(F.col("count") > 1)
    for example in repeats.orderBy(key).limit(1).collect():
        keys = repeats.count()
        raise EnqueueError(
            f"Column {key!r} (the key) repeats: {keys:,} key(s) have more than one row, for example "
            f"{example[key]!r} ({example['count']} rows); on_duplicate_key='error' writes nothing of "
            f"batch {batch_id!r}: deduplicate the data (df.dropDuplicates([{key!r}])) or pass "
            "on_duplicate_key='skip'"
        )


#: Where Debian's ``libpostgresql-jdbc-java`` puts the PostgreSQL JDBC driver.
DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
#: Environment variable naming another JDBC driver jar.
JDBC_JAR_ENV_VAR = "DRAMATIQ_PG_OUTBOX_JDBC_JAR"


def register(spark: Any) -> None:
    """Make the data sources known to ``spark`` (a SparkSession).

    ``df.write.format("dramatiq")`` (and ``writeStream``) enqueues one message per row
    (:mod:`dramatiq_pg_outbox.spark.source`); ``spark.read.format("dramatiq_history")``
    reads history, one partition per day (:mod:`dramatiq_pg_outbox.spark.history`; it pushes no
    filter to PostgreSQL on PySpark 4.3, whose reuse of a pushed read returns wrong rows, and
    logs one line saying whether it pushes, a WARNING if
    ``spark.sql.python.filterPushdown.enabled`` is on and it does not);
    ``spark.read.format("dramatiq_backlog")`` reads the live messages in id ranges
    (:mod:`dramatiq_pg_outbox.spark.backlog`).
    """
    from .source import register as register_source

    register_source(spark)


def jdbc_jar() -> str | None:
    """Path of a PostgreSQL JDBC driver jar (``$DRAMATIQ_PG_OUTBOX_JDBC_JAR``, else Debian's), or None."""
    import os

    for candidate in (os.environ.get(JDBC_JAR_ENV_VAR), DEBIAN_JDBC_JAR):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def cluster_session(
    master: str,
    app_name: str = "dramatiq-pg-outbox",
    *,
    executor_memory: str = "1g",
    executor_cores: int = 1,
    python: str | None = None,
    ship_package: bool = True,
) -> Any:
    """A SparkSession on a cluster whose executors can run this package's data sources.

    On top of what :func:`local_session` sets (session time zone UTC, the JDBC driver jar
    when one is found, which Spark copies to the executors):

    - ``spark.pyspark.python``: the executors' Python, ``python`` or else this interpreter
      (right when the executors' machines have the same layout, as containers of one image
      do); it needs this package's dependencies (``pip install 'dramatiq-pg-outbox[spark]'``:
      pyarrow, psycopg, dramatiq);
    - ``ship_package``: this package's own code, zipped, is added to the job
      (``SparkContext.addPyFile``, as ``--py-files`` would), so executors run the driver's
      copy of it, whatever version is installed there (the idempotency keys and payloads
      must be built alike everywhere).

    The database URL reaches the executors inside the pickled task, never through the
    plan or the logs (Spark shows no option of a Python data source; see
    ``examples/spark_pipeline/README.md`` for a URL without a password).

    Parameters:
      master(str): The cluster manager's URL, e.g. ``spark://host:7077``.
      app_name(str): The application's name, shown by the cluster manager.
      executor_memory(str): Memory of each executor, in Spark's notation (default ``"1g"``).
      executor_cores(int): Cores of each executor (default 1).
      python(str|None): The executors' Python interpreter (default: this one's path).
      ship_package(bool): Ship this package's code with the job (default True).

    Returns:
      SparkSession: A new session, or the running one (whose settings then stay).
    """
    import sys

    builder = _builder(master, app_name).config("spark.pyspark.python", python or sys.executable)
    builder = builder.config("spark.executor.memory", executor_memory)
    builder = builder.config("spark.executor.cores", str(executor_cores))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    if ship_package:
        session.sparkContext.addPyFile(str(_package_zip()))
    return session


def _package_zip() -> Any:
    """This package's code as a zip (``dramatiq_pg_outbox/...``, no caches), made once per process."""
    import atexit
    import shutil
    import tempfile
    import zipfile
    from pathlib import Path

    global _PACKAGE_ZIP
    if _PACKAGE_ZIP is None:
        package = Path(__file__).resolve().parent.parent
        folder = Path(tempfile.mkdtemp(prefix="dpo-pyfiles-"))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / "dramatiq_pg_outbox.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for file in sorted(package.rglob("*")):
                if file.is_file() and "__pycache__" not in file.parts:
                    archive.write(file, Path(package.name) / file.relative_to(package))
        _PACKAGE_ZIP = path
    return _PACKAGE_ZIP


#: The zip of :func:`_package_zip`, once made.
_PACKAGE_ZIP: Any = None


def _builder(master: str, app_name: str) -> Any:
    """A SparkSession builder with the settings every session of this package wants."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
    )
    jar = jdbc_jar()
    if jar is not None:
        builder = builder.config("spark.jars", jar)
    return builder


def local_session(app_name: str = "dramatiq-pg-outbox", *, cores: str = "*", memory: str = "1g") -> Any:
    """A ``local[cores]`` SparkSession with the UI off and the JDBC driver jar when one is found.

    Sets ``SPARK_LOCAL_IP=127.0.0.1`` and ``PYSPARK_PYTHON`` (this interpreter) unless
    already set.  For laptops, tests and examples; on a cluster, :func:`cluster_session`.
    """
    import os
    import sys

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # The executors' Python workers run this interpreter (with pyarrow and this package),
    # not whatever "python3" the PATH finds first.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = _builder(f"local[{cores}]", app_name).config("spark.driver.memory", memory)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
