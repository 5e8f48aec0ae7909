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
then one ``INSERT ... SELECT ... ON CONFLICT DO NOTHING`` into the messages
table, then at most one ``NOTIFY`` (delivered at commit).  Rows stream into
``COPY`` batch by batch, so a partition is never held in memory.

Payloads are built one of two ways, with the same result (same ids, keys
and decoded messages):

- by Spark expressions, when the encoder is Dramatiq's default JSON encoder,
  the key is a string or integer column and the arguments are string,
  boolean, integer or floating point columns: no Python runs per row, and
  Arrow writes the batches to ``COPY`` as CSV;
- else in the executors' Python, row by row, with the driver's encoder
  (custom encoders such as pickle, arrays, structs, ...).  A value the
  encoder refuses (a ``Decimal`` or a ``date`` with JSON) fails the job.

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
default JSON encoder: a ``Decimal``, a ``date``...; cast such columns first),
raises :class:`EnqueueError` naming the column and the row's key.  The
partition's transaction is rolled back (it writes nothing) and the Spark job
fails.  Other partitions may have committed: run the job again with the same
``batch_id`` once the data is fixed; it adds only what is missing.

Connection budget
-----------------
One connection per running task, for the length of the task: at most
``min(number of partitions, total executor cores)`` connections at a time.
Use ``max_partitions=`` to cap it (the DataFrame is coalesced).  The driver
opens none.

The messages are ordinary messages: a ``dramatiq`` worker with a
:class:`~dramatiq_pg_outbox.PostgresBroker` on the same schema processes them.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._jdbc import jdbc_options
from ._queries import queries_for_schema
from .names import DEFAULT_SCHEMA, channel_for, validate_schema_name
from .urls import libpq_url

if TYPE_CHECKING:
    from dramatiq import Actor
    from dramatiq.encoder import Encoder
    from pyspark.sql import DataFrame

__all__ = [
    "NAMESPACE",
    "EnqueueError",
    "EnqueueResult",
    "enqueue_dataframe",
    "jdbc_jar",
    "jdbc_options",
    "local_session",
    "message_id_for",
]

#: Namespace of the uuid5 message ids of :func:`enqueue_dataframe`.
NAMESPACE = uuid.UUID("5b0d1c1e-7f4e-5a43-9d0e-0a6f0c0b7d21")


class EnqueueError(ValueError):
    """A row could not become a message (null key, unencodable argument)."""


@dataclass(frozen=True)
class EnqueueResult:
    """What :func:`enqueue_dataframe` did.

    Attributes:
      batch_id(str): The batch id.
      rows(int): Rows read from the DataFrame.
      enqueued(int): New messages.
      skipped(int): Rows whose key was already enqueued (this batch earlier, a retried task).
      partitions(int): Partitions written.
      seconds(float): Wall time of the Spark job.
    """

    batch_id: str
    rows: int
    enqueued: int
    skipped: int
    partitions: int
    seconds: float

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("inf")


def idempotency_key_for(batch_id: str, key: Any) -> str:
    """The idempotency key of the row with ``key`` in batch ``batch_id`` (``str(key)`` is used)."""
    return f"{batch_id}:{key}"


def message_id_for(batch_id: str, key: Any) -> str:
    """The deterministic message id of the row with ``key`` in batch ``batch_id``."""
    return str(uuid.uuid5(NAMESPACE, idempotency_key_for(batch_id, key)))


@dataclass(frozen=True)
class _Plan:
    """Everything an executor needs, pickled once per task (no Spark objects).

    Rows reach the executor as tuples in the order of ``columns``; ``key``,
    ``args`` and ``kwargs`` hold positions in them.
    """

    #: Holds the password: kept out of the repr (Spark may print a failed task's closure).
    conninfo: str = field(repr=False)
    schema: str
    channel: str
    queue_name: str
    actor_name: str
    batch_id: str
    columns: tuple[str, ...]
    key: int
    args: tuple[int, ...]
    kwargs: tuple[tuple[str, int], ...]
    options: dict[str, Any]
    delay_ms: int
    notify: bool
    encoder: Encoder

    @classmethod
    def build(
        cls,
        *,
        key: str,
        args: Sequence[str] = (),
        kwargs: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> _Plan:
        columns = tuple(dict.fromkeys([key, *args, *(kwargs or {}).values()]))
        where = {column: i for i, column in enumerate(columns)}
        return cls(
            columns=columns,
            key=where[key],
            args=tuple(where[c] for c in args),
            kwargs=tuple((name, where[c]) for name, c in (kwargs or {}).items()),
            **fields,
        )


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

    Raises:
      EnqueueError: (from the Spark job) a null key or an argument that cannot be encoded.
      ValueError: For bad parameters (unknown column, bad schema or queue name).

    Returns:
      EnqueueResult: Counts and timing.
    """
    import dramatiq
    from dramatiq.common import q_name

    from .broker import PostgresBroker
    from .names import validate_queue_name

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
    encoder = encoder or dramatiq.get_encoder()
    try:
        encoder.encode({"options": dict(options or {})})
    except Exception as e:
        raise ValueError(f"options cannot be encoded with {type(encoder).__name__}: {e}") from e
    plan = _Plan.build(
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
        notify=notify,
        encoder=encoder,
    )
    selected = df.select(*plan.columns)
    if max_partitions is not None:
        if max_partitions < 1:
            raise ValueError(f"max_partitions must be at least 1, not {max_partitions!r}")
        if selected.rdd.getNumPartitions() > max_partitions:
            selected = selected.coalesce(max_partitions)

    prepared = _prepare_in_jvm(selected, plan, int(time.time() * 1000))
    in_jvm = prepared is not None  # the closure below must not capture a DataFrame

    # Arrow carries the rows to the Python workers column by column, much
    # faster than pickled Row objects; each task returns its counts as one row.
    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        if not in_jvm:
            read, enqueued = write_partition(plan, _arrow_rows(batches))
        else:
            read, enqueued = write_prepared_partition(plan, batches)
        yield pa.RecordBatch.from_pydict({"rows": [read], "enqueued": [enqueued]})

    started = time.perf_counter()
    source = selected if prepared is None else prepared
    try:
        counts = source.mapInArrow(write, "rows long, enqueued long").collect()
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
    return EnqueueResult(
        batch_id=batch_id,
        rows=rows,
        enqueued=enqueued,
        skipped=rows - enqueued,
        partitions=len(counts),
        seconds=seconds,
    )


#: Spark types whose JSON (``to_json``) decodes to what Dramatiq's JSON encoder would write.
_JVM_JSON_TYPES = ("string", "boolean", "tinyint", "smallint", "int", "bigint", "float", "double")
#: Key types whose Spark string cast equals Python's ``str()``.
_JVM_KEY_TYPES = ("string", "tinyint", "smallint", "int", "bigint")


def _prepare_in_jvm(selected: DataFrame, plan: _Plan, now_ms: int) -> DataFrame | None:
    """(message_id, idempotency_key, payload) computed by Spark itself, or None if it cannot.

    The common case (Dramatiq's default JSON encoder, string or integer key,
    arguments of string, boolean, integer or floating point columns) needs no
    Python per row: Spark builds the JSON payload and the uuid5 id, and the
    executor's Python streams Arrow batches into COPY as CSV.  Anything else
    (another encoder, decimals, dates, nested types) takes the Python path,
    which refuses what the encoder cannot encode.
    """
    import json

    from dramatiq.encoder import JSONEncoder
    from pyspark.sql import functions as F

    types = dict(selected.dtypes)
    columns = plan.columns
    if type(plan.encoder) is not JSONEncoder or types[columns[plan.key]] not in _JVM_KEY_TYPES:
        return None
    values = [*plan.args, *(i for _, i in plan.kwargs)]
    if any(types[columns[i]] not in _JVM_JSON_TYPES for i in values):
        return None

    def col(index: int) -> Any:
        return selected[columns[index]]

    def json_value(column: Any, kind: str = "string") -> Any:
        if kind in ("tinyint", "smallint", "int", "bigint", "float", "double"):
            # Numbers as Spark prints them (1.0E10, NaN, Infinity): json.loads reads them all.
            return F.coalesce(column.cast("string"), F.lit("null"))
        if kind == "boolean":
            return F.when(column, F.lit("true")).when(~column, F.lit("false")).otherwise(F.lit("null"))
        # Strings: to_json escapes them; it takes a struct: {"v":<value>} -> <value>.
        text = F.to_json(F.struct(column.alias("v")), {"ignoreNullFields": "false"})
        return text.substr(F.lit(6), F.length(text) - 6)

    def value(index: int) -> Any:
        return json_value(col(index), types[columns[index]])

    ikey = F.concat(F.lit(f"{plan.batch_id}:"), col(plan.key).cast("string"))
    digest = F.sha1(F.concat(F.unhex(F.lit(NAMESPACE.hex)), F.encode(ikey, "UTF-8")))
    variant = F.element_at(
        F.array(*(F.lit(c) for c in "89ab")),
        (F.conv(F.substring(digest, 17, 1), 16, 10).cast("int").bitwiseAND(3) + 1),
    )
    message_id = F.concat(
        F.substring(digest, 1, 8), F.lit("-"), F.substring(digest, 9, 4), F.lit("-5"),
        F.substring(digest, 14, 3), F.lit("-"), variant, F.substring(digest, 18, 3), F.lit("-"),
        F.substring(digest, 21, 12),
    )  # fmt: skip
    args_json = F.concat(
        F.lit("["),
        F.concat_ws(",", *(value(i) for i in plan.args)) if plan.args else F.lit(""),
        F.lit("]"),
    )
    kwargs_json = F.concat(
        F.lit("{"),
        F.concat_ws(
            ",",
            *(F.concat(F.lit(json.dumps(name) + ":"), value(i)) for name, i in plan.kwargs),
        )
        if plan.kwargs
        else F.lit(""),
        F.lit("}"),
    )
    dumps = _json_dumps()
    options = dumps(plan.options)[:-1] + ("," if plan.options else "") + '"idempotency_key":'
    payload = F.concat(
        F.lit(f'{{"queue_name":{dumps(plan.queue_name)},"actor_name":{dumps(plan.actor_name)},"args":'),
        args_json,
        F.lit(',"kwargs":'),
        kwargs_json,
        F.lit(f',"options":{options}'),
        json_value(ikey),
        F.lit('},"message_id":"'),
        message_id,
        F.lit(f'","message_timestamp":{int(now_ms)}}}'),
    )
    return selected.select(
        message_id.alias("message_id"), ikey.alias("idempotency_key"), payload.alias("payload")
    )


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


def _arrow_rows(batches: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    for batch in batches:
        yield from zip(*(column.to_pylist() for column in batch.columns), strict=True)


def _uuid5(prefix: Any, name: str) -> str:
    """``str(uuid.uuid5(namespace, name))`` for a sha1 object primed with the namespace, faster."""
    digest = prefix.copy()
    digest.update(name.encode("utf-8"))
    h = digest.hexdigest()
    # Version 5 in the high nibble of byte 6, RFC 4122 variant in the top bits of byte 8.
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}


def _json_dumps() -> Callable[[Any], str]:
    """A compact ``json.dumps`` (as Dramatiq's JSONEncoder writes) that reuses one C encoder."""
    import json
    from json import encoder as json_encoder

    make = getattr(json_encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return json.JSONEncoder(separators=(",", ":")).encode
    iterencode = make(
        None,
        json.JSONEncoder().default,
        json_encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        False,
        False,
        True,
    )

    def dumps(value: Any) -> str:
        return "".join(iterencode(value, 0))

    return dumps


def _encode_rows(plan: _Plan, rows: Iterable[Any], now_ms: int) -> Iterator[tuple[str, str, bytes]]:
    """(message id, idempotency key, payload) per row; raises EnqueueError naming the bad column."""
    import hashlib

    from dramatiq.encoder import JSONEncoder

    prefix = hashlib.sha1(NAMESPACE.bytes, usedforsecurity=False)
    batch = f"{plan.batch_id}:"
    key_at, args_at, kwargs_at = plan.key, plan.args, plan.kwargs
    fast = type(plan.encoder) is JSONEncoder
    if fast:
        # Byte for byte what JSONEncoder.encode gives for the message dict,
        # with the constant parts rendered once.
        dumps = _json_dumps()
        head = f'{{"queue_name":{dumps(plan.queue_name)},"actor_name":{dumps(plan.actor_name)},"args":'
        options = dumps(plan.options)[:-1] + ("," if plan.options else "") + '"idempotency_key":'
    for row in rows:
        key = row[key_at]
        if key is None:
            raise EnqueueError(
                f"Column {plan.columns[key_at]!r} (the key) is null in a row of batch {plan.batch_id!r}; "
                "every row needs a key"
            )
        ikey = batch + str(key)
        message_id = _uuid5(prefix, ikey)
        try:
            if fast:
                payload = (
                    f"{head}{dumps([row[i] for i in args_at])}"
                    f',"kwargs":{dumps({name: row[i] for name, i in kwargs_at})}'
                    f',"options":{options}{dumps(ikey)}}}'
                    f',"message_id":"{message_id}","message_timestamp":{now_ms}}}'
                ).encode()
            else:
                payload = plan.encoder.encode(
                    {
                        "queue_name": plan.queue_name,
                        "actor_name": plan.actor_name,
                        "args": [row[i] for i in args_at],
                        "kwargs": {name: row[i] for name, i in kwargs_at},
                        "options": {**plan.options, "idempotency_key": ikey},
                        "message_id": message_id,
                        "message_timestamp": now_ms,
                    }
                )
        except Exception as e:
            raise EnqueueError(_explain(plan, row, key, e)) from e
        yield message_id, ikey, payload


def _explain(plan: _Plan, row: Any, key: Any, error: Exception) -> str:
    key_name = plan.columns[plan.key]
    for i in (*plan.args, *(i for _, i in plan.kwargs)):
        try:
            plan.encoder.encode({"value": row[i]})
        except Exception as e:
            value = row[i]
            return (
                f"Column {plan.columns[i]!r} of the row with {key_name}={key!r} cannot be encoded "
                f"({type(value).__name__} {value!r}: {e}); cast it to a supported type"
            )
    return f"The row with {key_name}={key!r} cannot be encoded: {error}"


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
    import psycopg

    queries = queries_for_schema(plan.schema)
    with psycopg.connect(plan.conninfo, application_name="dramatiq-pg-outbox-spark") as conn:
        with conn.cursor() as cur:
            cur.execute(queries["spark_stage"])
            with cur.copy(queries[copy_query]) as copy:
                read = feed(copy)
            cur.execute(
                queries["spark_insert"],
                {"queue_name": plan.queue_name, "actor_name": plan.actor_name, "delay": plan.delay_ms},
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
DEBIAN_JDBC_JAR = "/usr/share/java/postgresql.jar"
#: Environment variable naming another JDBC driver jar.
JDBC_JAR_ENV_VAR = "DRAMATIQ_PG_OUTBOX_JDBC_JAR"


def jdbc_jar() -> str | None:
    """Path of a PostgreSQL JDBC driver jar (``$DRAMATIQ_PG_OUTBOX_JDBC_JAR``, else Debian's), or None."""
    import os

    for candidate in (os.environ.get(JDBC_JAR_ENV_VAR), DEBIAN_JDBC_JAR):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def local_session(app_name: str = "dramatiq-pg-outbox", *, cores: str = "*", memory: str = "1g") -> Any:
    """A ``local[cores]`` SparkSession with the UI off and the JDBC driver jar when one is found.

    Sets ``SPARK_LOCAL_IP=127.0.0.1`` unless already set.  For laptops, tests
    and examples; on a cluster, build the session as usual.
    """
    import os

    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", memory)
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
    )
    jar = jdbc_jar()
    if jar is not None:
        builder = builder.config("spark.jars", jar)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
