"""Spark integration: bulk enqueue from DataFrames, the data sources and the analytics job.

Runs on a session-scoped ``local[2]`` SparkSession with the UI off; the streaming
kill-and-restart test and the pipeline example also run, as driver processes of their
own, on a session-scoped standalone cluster (``spark_cluster``: a master and two workers
on this machine).  Skipped only when Java or pyspark is absent (``pip install '.[spark]'``).
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import Message

from dramatiq_pg_outbox import PostgresBroker, SchemaNotReady

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[dev]')")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip(
        "Java is not installed (Spark needs a JVM): apt-get install -y openjdk-17-jre-headless",
        allow_module_level=True,
    )

from dramatiq_pg_outbox.spark import (  # noqa: E402
    EnqueueError,
    Plan,
    enqueue_dataframe,
    message_id_for,
    write_partition,
)
from tests.helpers import wait_for  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("dramatiq-pg-outbox-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def actor(broker: PostgresBroker) -> Any:
    @dramatiq.actor(broker=broker, queue_name="notifications")
    def notify_customer(customer_id: int, email: str, *, segment: str = "") -> None:
        pass

    return notify_customer


def customers(spark: Any, n: int, partitions: int = 4) -> Any:
    rows = [(i, f"c{i}@example.com", "gold" if i % 3 == 0 else "basic") for i in range(n)]
    return spark.createDataFrame(rows, "customer_id long, email string, segment string").repartition(
        partitions
    )


def count(db: Any, sql: str = "SELECT count(*) FROM dramatiq.messages") -> int:
    return int(db.execute(sql).fetchone()[0])


def test_every_row_becomes_a_decodable_message(spark: Any, actor: Any, db: Any, database_url: str) -> None:
    listener = psycopg.connect(database_url, autocommit=True)
    listener.execute('LISTEN "dramatiq_pg_outbox.dramatiq"')
    try:
        result = enqueue_dataframe(
            customers(spark, 1000),
            actor,
            args=["customer_id", "email"],
            kwargs={"segment": "segment"},
            key="customer_id",
            batch_id="b1",
            options={"max_retries": 2},
        )
        notes = list(listener.notifies(timeout=1.0, stop_after=100))
    finally:
        listener.close()
    assert (result.rows, result.enqueued, result.skipped, result.partitions) == (1000, 1000, 0, 4)
    # One NOTIFY per partition at most, payload the queue name.
    assert 1 <= len(notes) <= 4 and {n.payload for n in notes} == {"notifications"}
    rows = db.execute(
        "SELECT message_id, idempotency_key, queue_name, actor_name, payload FROM dramatiq.messages"
    ).fetchall()
    assert len(rows) == 1000
    by_key = {r[1]: r for r in rows}
    message_id, _ikey, queue_name, actor_name, payload = by_key["b1:42"]
    assert message_id == message_id_for("b1", 42)
    assert uuid.UUID(message_id).version == 5
    assert (queue_name, actor_name) == ("notifications", "notify_customer")
    message = Message.decode(bytes(payload))
    assert list(message.args) == [42, "c42@example.com"]
    assert message.kwargs == {"segment": "gold"}
    assert message.options["max_retries"] == 2 and message.options["idempotency_key"] == "b1:42"


def test_rerunning_the_same_batch_adds_nothing(spark: Any, actor: Any, db: Any) -> None:
    df = customers(spark, 500, partitions=3)
    first = enqueue_dataframe(df, actor, args=["customer_id", "email"], key="customer_id", batch_id="b2")
    again = enqueue_dataframe(
        df.repartition(5), actor, args=["customer_id", "email"], key="customer_id", batch_id="b2"
    )
    assert (first.enqueued, again.enqueued, again.skipped) == (500, 0, 500)
    assert count(db) == 500
    other = enqueue_dataframe(df, actor, args=["customer_id", "email"], key="customer_id", batch_id="b3")
    assert other.enqueued == 500 and count(db) == 1000


def customer_id_plan(broker: PostgresBroker, batch_id: str, *, notify: bool = False) -> Plan:
    """The plan of an executor task that enqueues notify_customer(customer_id) keyed by customer_id."""
    return Plan.build(
        key="customer_id", args=["customer_id"], conninfo=broker.conninfo, schema="dramatiq",
        channel="dramatiq_pg_outbox.dramatiq", queue_name="notifications", actor_name="notify_customer",
        batch_id=batch_id, options={}, delay_ms=0, notify=notify, encoder=dramatiq.get_encoder(),
    )  # fmt: skip


def test_a_retried_task_adds_nothing(actor: Any, broker: PostgresBroker, db: Any) -> None:
    plan = customer_id_plan(broker, "retry")
    rows = [(i,) for i in range(100)]
    assert write_partition(plan, rows) == (100, 100, 0)
    # The same task run again (Spark retried it after its commit): nothing new.
    assert write_partition(plan, rows) == (100, 0, 0)
    assert count(db) == 100


def test_processed_messages_are_not_enqueued_again(
    spark: Any, broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    seen: list[int] = []

    @dramatiq.actor(broker=broker, queue_name="notifications")
    def notify_customer(customer_id: int, email: str) -> None:
        seen.append(customer_id)

    df = customers(spark, 300)
    kwargs: dict[str, Any] = {"args": ["customer_id", "email"], "key": "customer_id", "batch_id": "b4"}
    assert enqueue_dataframe(df, notify_customer, **kwargs).enqueued == 300
    start_worker(broker)
    broker.join("notifications", timeout=30_000)
    assert sorted(seen) == list(range(300))
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE idempotency_key LIKE 'b4:%'") == 300
    again = enqueue_dataframe(df, notify_customer, **kwargs)
    assert (again.enqueued, again.skipped) == (0, 300)
    assert count(db) == 0
    assert len(seen) == 300


def test_a_null_key_fails_the_job_and_writes_nothing(spark: Any, actor: Any, db: Any) -> None:
    rows = [(i, f"c{i}@example.com") for i in range(50)] + [(None, "nokey@example.com")]
    df = spark.createDataFrame(rows, "customer_id long, email string").coalesce(1)
    with pytest.raises(EnqueueError, match=r"Column 'customer_id' \(the key\) is null"):
        enqueue_dataframe(df, actor, args=["email"], key="customer_id", batch_id="b5")
    assert count(db) == 0


def test_an_unencodable_argument_fails_the_job_naming_the_column(spark: Any, actor: Any, db: Any) -> None:
    rows = [(i, bytearray(b"\x00\x01") if i == 7 else None) for i in range(20)]
    df = spark.createDataFrame(rows, "customer_id long, avatar binary").coalesce(1)
    with pytest.raises(EnqueueError, match=r"Column 'avatar' of the row with customer_id=7 cannot be"):
        enqueue_dataframe(df, actor, args=["customer_id", "avatar"], key="customer_id", batch_id="b6")
    assert count(db) == 0


def test_timestamps_dates_and_decimals_are_written_as_iso_text_and_exact_decimals(
    spark: Any, actor: Any, db: Any, database_url: str
) -> None:
    # Given rows with a timestamp (an instant), a wall-clock timestamp, a date and an amount,
    # in a session whose time zone is not UTC
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        df = spark.sql(
            "SELECT id AS customer_id, TIMESTAMP '2026-11-27 10:00:00.250 UTC' AS paid_at,"
            " TIMESTAMP_NTZ '2026-11-27 10:00:00' AS local_at, DATE '2026-11-27' AS day,"
            " CAST('12.50' AS DECIMAL(10, 2)) AS amount, CAST(NULL AS DATE) AS none"
            " FROM range(3)"
        )
        columns = ["paid_at", "local_at", "day", "amount", "none"]
        # When they are enqueued, as text by default and with decimals as floats by the option
        enqueue_dataframe(df, actor, args=columns, key="customer_id", batch_id="types")
        enqueue_dataframe(df, actor, args=["amount"], key="customer_id", batch_id="floats", decimals="float")
        write_messages(df, database_url, actor="notify_customer", batch="source", key="customer_id",
                       args="amount", decimals="float", queue="notifications")  # fmt: skip
    finally:
        spark.conf.unset("spark.sql.session.timeZone")

    # Then the arguments are ISO 8601 (UTC with its offset; no offset for a wall clock), the
    # decimal's exact text, null for null; a float where asked
    def args_of(batch: str) -> list[Any]:
        rows = db.execute(
            "SELECT payload FROM dramatiq.messages WHERE idempotency_key LIKE %s", (batch + ":%",)
        ).fetchall()
        assert len(rows) == 3
        return [Message.decode(bytes(r[0])).args for r in rows]

    assert args_of("types") == [("2026-11-27T10:00:00.250000+00:00", "2026-11-27T10:00:00", "2026-11-27",
                                 "12.50", None)] * 3  # fmt: skip
    assert args_of("floats") == [(12.5,)] * 3
    assert args_of("source") == [(12.5,)] * 3
    with pytest.raises(ValueError, match="decimals is 'string' or 'float'"):
        enqueue_dataframe(df, actor, args=["amount"], key="customer_id", batch_id="x", decimals="text")  # type: ignore[arg-type]


def test_a_row_over_max_message_bytes_fails_the_job_naming_it_and_writes_nothing(
    spark: Any, make_broker: Any, db: Any
) -> None:
    # Given an actor whose broker allows messages of 600 bytes, and one row that makes a bigger one
    broker = make_broker(max_message_bytes=600)

    @dramatiq.actor(broker=broker, queue_name="notifications")
    def notify_customer(customer_id: int, note: str) -> None:
        pass

    rows = [(i, "x" * (1_000 if i == 7 else 10)) for i in range(20)]
    df = spark.createDataFrame(rows, "customer_id long, note string").coalesce(1)
    kwargs: dict[str, Any] = {"args": ["customer_id", "note"], "key": "customer_id"}
    # Then the job fails naming the row, the size and the limit, and writes nothing
    with pytest.raises(EnqueueError, match=r"customer_id=7 is [\d,]+ bytes .* max_message_bytes=600"):
        enqueue_dataframe(df, notify_customer, batch_id="big", **kwargs)
    assert count(db) == 0
    # And without a limit (or under a larger one) every row is written
    assert (
        enqueue_dataframe(df, notify_customer, batch_id="big", max_message_bytes=None, **kwargs).enqueued
        == 20
    )
    with pytest.raises(ValueError, match="max_message_bytes=0"):
        enqueue_dataframe(df, notify_customer, batch_id="big2", max_message_bytes=0, **kwargs)


def test_a_row_over_the_limit_is_refused_row_by_row_and_by_the_data_source(
    spark: Any, broker: PostgresBroker, db: Any, database_url: str
) -> None:
    import dataclasses

    # Row by row (an argument type that Arrow does not encode): the same refusal
    plan = dataclasses.replace(customer_id_plan(broker, "rows"), max_bytes=300)
    small, big = (1,), (10**400,)
    with pytest.raises(EnqueueError, match=r"customer_id=10+ is [\d,]+ bytes .* max_message_bytes=300"):
        write_partition(plan, [small, big])
    assert count(db) == 0
    # format("dramatiq"): 1 MiB unless its max_message_bytes option says otherwise
    df = spark.createDataFrame([(1, "x" * 2_000)], "customer_id long, note string").coalesce(1)
    source = {"actor": "notify_customer", "key": "customer_id", "args": "customer_id,note"}
    with pytest.raises(Exception, match=r"max_message_bytes=1,000"):
        write_messages(df, database_url, batch="s-big", max_message_bytes="1000", **source)
    assert count(db) == 0
    write_messages(df, database_url, batch="s-big", **source)
    assert count(db) == 1
    with pytest.raises(Exception, match="option 'max_message_bytes' is a number of bytes"):
        write_messages(df, database_url, batch="s-big", max_message_bytes="lots", **source)


def test_bad_parameters_are_refused_before_any_job(spark: Any, actor: Any) -> None:
    df = customers(spark, 3)
    with pytest.raises(ValueError, match="not in the DataFrame"):
        enqueue_dataframe(df, actor, args=["nope"], key="customer_id", batch_id="b7")
    with pytest.raises(ValueError, match="batch_id"):
        enqueue_dataframe(df, actor, key="customer_id", batch_id="")
    with pytest.raises(ValueError, match="queue_name"):
        enqueue_dataframe(df, "notify_customer", key="customer_id", batch_id="b7", url="postgresql://x/y")


def test_a_broker_priority_option_is_stored_on_every_row(spark: Any, actor: Any, db: Any) -> None:
    df = customers(spark, 20, partitions=2)
    enqueue_dataframe(df, actor, args=["customer_id"], key="customer_id", batch_id="bp",
                      options={"broker_priority": 4})  # fmt: skip
    assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE priority = 4") == 20
    with pytest.raises(ValueError, match="broker_priority must be an integer from 0 to 255, not 256"):
        enqueue_dataframe(df, actor, args=["customer_id"], key="customer_id", batch_id="bq",
                          options={"broker_priority": 256})  # fmt: skip
    assert count(db) == 20


def test_max_partitions_caps_connections(spark: Any, actor: Any, db: Any) -> None:
    result = enqueue_dataframe(
        customers(spark, 200, partitions=8), actor, args=["customer_id"], key="customer_id",
        batch_id="b8", max_partitions=2,
    )  # fmt: skip
    assert (result.enqueued, result.partitions) == (200, 2)


#: What the Python processes of a format("dramatiq") write need not import: each new one
#: (the planner's, the commit's, every task's worker) paid for them on a session's first write.
NOT_FOR_A_WRITE = (
    "sqlalchemy",
    "alembic",
    "psycopg_pool",
    "dramatiq_pg_outbox.broker",
    "dramatiq_pg_outbox._runtime",
    "dramatiq_pg_outbox.migrations",
    "dramatiq_pg_outbox.outbox",
    "dramatiq_pg_outbox.results",
)


def test_a_write_task_imports_neither_the_broker_nor_sqlalchemy(tmp_path: Any) -> None:
    import subprocess

    from dramatiq.encoder import JSONEncoder
    from pyspark.serializers import CloudPickleSerializer

    from dramatiq_pg_outbox.spark.source import DramatiqDataSource, Written, _Writer

    # Given what Spark ships to the Python processes of a write: the data source's class (the
    # planner's), its writer with the plan (every task's and the commit's), a task's counts
    plan = Plan.build(
        key="customer_id", args=["customer_id"], kwargs={}, conninfo="postgresql://app@db/app",
        schema="dramatiq", channel="dramatiq_pg_outbox.dramatiq", queue_name="default",
        actor_name="notify", batch_id="b", options={}, delay_ms=0, notify=True, encoder=JSONEncoder(),
    )  # fmt: skip
    shipped = tmp_path / "shipped.pickle"
    shipped.write_bytes(CloudPickleSerializer().dumps((DramatiqDataSource, _Writer(plan), Written(1, 1))))
    # When a fresh interpreter unpickles it and imports what a task runs
    code = (
        "import pickle, sys\n"
        f"source, writer, written = pickle.loads(open({str(shipped)!r}, 'rb').read())\n"
        "import dramatiq_pg_outbox.spark.write, dramatiq_pg_outbox._isolation\n"
        "assert writer.plan.batch_id == 'b' and written.rows == 1\n"
        f"print(sorted(m for m in {NOT_FOR_A_WRITE!r} if m in sys.modules))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    # Then none of the broker, its runtime, the outbox, the migrations or SQLAlchemy is imported
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_json_fast_path_encodes_exactly_like_dramatiq() -> None:
    from dramatiq.encoder import JSONEncoder, PickleEncoder

    from dramatiq_pg_outbox.spark import encode_rows

    fields: dict[str, Any] = {
        "conninfo": "", "schema": "dramatiq", "channel": "c", "queue_name": "q", "actor_name": "a",
        "batch_id": "b", "options": {"max_retries": 1, "note": "é"}, "delay_ms": 0, "notify": False,
    }  # fmt: skip
    # Columns: id (the key), then the args email, score, extra, then the kwarg column segment.
    rows = [(1, "x@example.com", 2.5, None, "gold"), ('k"2', "ü", float("nan"), [1, {"a": None}], "")]
    for encoder in (JSONEncoder(), PickleEncoder()):
        plan = Plan.build(
            key="id",
            args=["email", "score", "extra"],
            kwargs={"segment": "segment"},
            encoder=encoder,
            **fields,
        )
        for row, (message_id, ikey, payload) in zip(rows, encode_rows(plan, rows, 1234), strict=True):
            expected = {
                "queue_name": "q",
                "actor_name": "a",
                "args": [row[1], row[2], row[3]],
                "kwargs": {"segment": row[4]},
                "options": {"max_retries": 1, "note": "é", "idempotency_key": ikey},
                "message_id": message_id,
                "message_timestamp": 1234,
            }
            assert ikey == f"b:{row[0]}" and message_id == message_id_for("b", row[0])
            if isinstance(encoder, JSONEncoder):
                assert payload == encoder.encode(expected)
            else:
                assert encoder.decode(payload)["message_id"] == message_id


# -- analytics ---------------------------------------------------------------

BASE = "2026-11-21 10:00:00+00"


def _history(db: Any) -> None:
    """Known history: actor a over two minutes (retries, a dead letter), actor b in one minute."""
    rows = []
    ident = 0

    def add(actor: str, message: str, state: str, attempts: int, minute: int, second: int,
            wait_ms: int, run_ms: int, error: str | None = None) -> None:  # fmt: skip
        nonlocal ident
        ident += 1
        rows.append((ident, actor, message, state, attempts, minute, second, wait_ms, run_ms, error))

    for i in range(20):  # a, minute 0: 20 clean messages
        add("a", f"a{i}", "completed", 1, 0, i, 10 * (i + 1), 100 + i)
    for i in range(3):  # a, minute 1: 3 messages retried once, then fine
        add("a", f"r{i}", "completed", 1, 1, i, 5, 50, "ValueError")
        add("a", f"r{i}", "completed", 1, 1, 30 + i, 1000, 60)
    add("a", "dead", "failed", 2, 1, 50, 7, 8, "KeyError")  # delivered twice (crash), dead-lettered
    add("a", "dead", "completed", 1, 1, 40, 7, 8, "KeyError")
    for i in range(5):  # b, minute 0
        add("b", f"b{i}", "completed", 1, 0, 10 + i, 1, 2000)
    with db.cursor() as cur:
        cur.executemany(
            """
            INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts,
                enqueued_at, started_at, finished_at, error_type, payload)
            SELECT %s, 'default', %s, %s, %s, %s,
                   f - (w + r) * interval '1 ms', f - r * interval '1 ms', f, %s, '\\x'::bytea
            FROM (SELECT %s::timestamptz + %s * interval '1 minute' + %s * interval '1 second' AS f,
                         %s::int AS w, %s::int AS r) AS t
            """,
            [(i, a, m, s, n, e, BASE, mi, se, w, r) for i, a, m, s, n, mi, se, w, r, e in rows],
        )
        cur.execute(
            """
            INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, state, next_attempt_at,
                lease, owner, payload)
            SELECT 'default', 'a', 'p' || g, CASE WHEN g = 6 THEN 'processing' ELSE 'pending' END,
                   CASE WHEN g IN (4, 5) THEN now() + interval '1 hour' ELSE now() - interval '10 s' END,
                   CASE WHEN g = 6 THEN gen_random_uuid() END, NULL, '\\x'::bytea
            FROM generate_series(1, 6) AS g
            """
        )


def test_analytics_match_the_sql_functions(spark: Any, db: Any, database_url: str, tmp_path: Any) -> None:
    from dramatiq_pg_outbox.spark_analytics import run

    _history(db)
    analytics, written = run(database_url, tmp_path, spark=spark, bucket_seconds=60, partitions=3)
    for name in ("stats.csv", "attempts.csv", "errors.csv", "backlog.csv", "throughput.png", "latency.png"):
        assert written[name].is_file() and written[name].stat().st_size > 0, name
    assert (tmp_path / "parquet" / "stats").is_dir()

    got = {(r["actor_name"], r["bucket_start"].minute): r.asDict() for r in analytics.stats.collect()}
    sql_rows = db.execute("SELECT * FROM dramatiq.message_stats(interval '1 minute')").fetchall()
    names = [c.name for c in db.execute("SELECT * FROM dramatiq.message_stats() LIMIT 0").description]
    assert len(got) == len(sql_rows) == 3
    for values in sql_rows:
        expected = dict(zip(names, values, strict=True))
        row = got[(expected["actor_name"], expected["bucket_start"].minute)]
        for column in ("deliveries", "completed", "retried", "failed"):
            assert row[column] == expected[column], column
        for column in ("throughput_per_s", "failure_rate", "retry_rate"):
            assert row[column] == pytest.approx(expected[column]), column
        for column in ("wait_p50_ms", "run_p50_ms", "wait_p99_ms", "run_p99_ms"):
            # percentile_approx picks a sample, percentile_cont interpolates.
            assert row[column] == pytest.approx(expected[column], rel=0.1, abs=15), column
    a0, a1 = got[("a", 0)], got[("a", 1)]
    assert (a0["deliveries"], a0["completed"], a0["retried"], a0["failed"]) == (20, 20, 0, 0)
    assert (a1["deliveries"], a1["retried"], a1["failed"]) == (8, 4, 1)
    assert a1["failure_rate"] == pytest.approx(1 / 8) and a1["retry_rate"] == pytest.approx(4 / 8)

    attempts = sorted(tuple(r) for r in analytics.attempts.collect())
    assert attempts == sorted(
        tuple(r) for r in db.execute("SELECT actor_name, attempts, messages FROM dramatiq.message_attempts")
    )
    assert ("a", 2, 3) in attempts and ("a", 3, 1) in attempts and ("b", 1, 5) in attempts
    errors = [tuple(r) for r in analytics.errors.collect()]
    assert errors == [tuple(r) for r in db.execute("SELECT * FROM dramatiq.message_errors")]
    assert errors == [("a", "ValueError", 3, 0, 3, 1), ("a", "KeyError", 1, 1, 2, 2)]
    backlog = [tuple(r)[:5] for r in analytics.backlog.collect()]
    assert backlog == [("default", "a", 3, 2, 1)]
    assert backlog == [tuple(r)[:5] for r in db.execute("SELECT * FROM dramatiq.queue_backlog")]


def test_analytics_command_on_an_empty_history(db: Any, database_url: str, tmp_path: Any, spark: Any) -> None:
    from dramatiq_pg_outbox.spark_analytics import run

    analytics, written = run(database_url, tmp_path, spark=spark)
    assert analytics.stats.count() == 0 and written["stats.csv"].is_file()


def test_arrow_encodes_batches_byte_for_byte_like_the_row_encoder() -> None:
    import pyarrow as pa
    from dramatiq.encoder import PickleEncoder

    from dramatiq_pg_outbox.spark import encode_rows
    from dramatiq_pg_outbox.spark.encoding import batch_encodable, encode_batch

    rows = [
        (1, 'quote " and \\ backslash', True, 2.5, None, "gold"),
        (-7, "ünïcødé ✓ and\nnewline\ttab", False, -0.125, 3, ""),
        (123456789012, "", None, None, -1, None),
        (5, "plain ascii", True, float("nan"), 2**31 - 1, "x\u2028y"),
        (6, "\x7f and \x00", None, 1.0, 0, "'single'"),
    ]
    schema = pa.schema(
        [("id", pa.int64()), ("email", pa.string()), ("flag", pa.bool_()), ("score", pa.float64()),
         ("n", pa.int32()), ("segment", pa.large_string())]
    )  # fmt: skip
    batch = pa.RecordBatch.from_pylist([dict(zip(schema.names, row, strict=True)) for row in rows], schema)
    for options in ({"max_retries": 1}, {}):
        plan = Plan.build(
            key="id", args=["email", "flag", "score", "n"], kwargs={"segment": "segment", "again": "id"},
            conninfo="", schema="dramatiq", channel="c", queue_name="q", actor_name="a", batch_id='b-"1',
            options=options, delay_ms=0, notify=False, encoder=dramatiq.get_encoder(),
        )  # fmt: skip
        assert batch_encodable(plan, batch.schema)
        encoded = encode_batch(plan, batch.select(list(plan.columns)), 1234).to_pylist()
        python_rows = [tuple(d.values()) for d in batch.select(list(plan.columns)).to_pylist()]
        expected = [
            {"message_id": m, "idempotency_key": k, "payload": p.decode()}
            for m, k, p in encode_rows(plan, python_rows, 1234)
        ]
        assert encoded == expected
        for row in encoded:
            Message.decode(row["payload"].encode())
    # Timestamps, dates and decimals become text first (portable_batch): both encoders, same bytes
    from dramatiq_pg_outbox.spark.encoding import portable_batch

    dt = datetime
    base = {
        k: v for k, v in plan.__dict__.items() if k not in ("columns", "key", "args", "kwargs", "decimals")
    }

    typed = pa.RecordBatch.from_pydict(
        {
            "id": pa.array([1, 2], pa.int64()),
            "at": pa.array([dt.datetime(2026, 11, 27, 10, tzinfo=dt.timezone.utc), None],
                           pa.timestamp("us", tz="Europe/Paris")),
            "wall": pa.array([dt.datetime(2026, 11, 27, 10, 0, 0, 5), None], pa.timestamp("us")),
            "day": pa.array([dt.date(2026, 11, 27), None], pa.date32()),
            "amount": pa.array([decimal.Decimal("-0.10"), None], pa.decimal128(5, 2)),
        }
    )  # fmt: skip
    for decimals in ("string", "float"):
        plan = Plan.build(key="id", args=["at", "wall", "day", "amount"], decimals=decimals,
                          **base)  # fmt: skip
        portable = portable_batch(plan, typed.select(list(plan.columns)))
        assert batch_encodable(plan, portable.schema)
        by_column = encode_batch(plan, portable, 1234).to_pylist()
        by_row = [
            {"message_id": m, "idempotency_key": k, "payload": p.decode()}
            for m, k, p in encode_rows(plan, [tuple(d.values()) for d in portable.to_pylist()], 1234)
        ]
        assert by_column == by_row
        first = Message.decode(by_column[0]["payload"].encode()).args
        amount = "-0.10" if decimals == "string" else -0.1
        assert first == ("2026-11-27T10:00:00+00:00", "2026-11-27T10:00:00.000005", "2026-11-27", amount)
        assert Message.decode(by_column[1]["payload"].encode()).args == (None, None, None, None)
    # Types Arrow cannot encode like Dramatiq (decimals, dates) and other encoders go row by row.
    fields = {k: v for k, v in plan.__dict__.items() if k not in ("columns", "key", "args", "kwargs")}
    decimals = pa.schema([("id", pa.int64()), ("d", pa.decimal128(5, 2))])
    assert not batch_encodable(Plan.build(key="id", args=["d"], **fields), decimals)
    assert not batch_encodable(Plan.build(key="d", args=["id"], **fields), decimals)
    pickled = {**fields, "encoder": PickleEncoder()}
    assert not batch_encodable(Plan.build(key="id", args=["id"], **pickled), decimals)


def test_a_key_twice_in_one_partition_becomes_one_message(
    actor: Any, broker: PostgresBroker, db: Any
) -> None:
    """The plain insert meets the key again and the writer falls back to ON CONFLICT DO NOTHING."""
    import pyarrow as pa

    from dramatiq_pg_outbox.spark import write_arrow_partition

    plan = customer_id_plan(broker, "twice")
    batch = pa.RecordBatch.from_pydict({"customer_id": pa.array([1, 2, 1, 3], pa.int64())})
    assert write_arrow_partition(plan, [batch]) == (4, 3, 1)  # the second 1: repeated
    assert write_arrow_partition(plan, [batch]) == (4, 0, 0)  # all known: skipped
    assert count(db) == 3


def stage_writes(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record each write through the staging table (``spark.write._write_stage``): one True per call."""
    from dramatiq_pg_outbox.spark import write as spark_write

    staged: list[bool] = []
    write_stage = spark_write._write_stage

    def spy(*args: Any, **kwargs: Any) -> Any:
        staged.append(True)
        return write_stage(*args, **kwargs)

    monkeypatch.setattr(spark_write, "_write_stage", spy)
    return staged


def test_a_partition_of_new_keys_is_copied_straight_into_the_table_as_through_the_stage(
    actor: Any, broker: PostgresBroker, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: a partition that fits in memory and whose keys are all new is written without
    the staging table (_write_direct), the same rows as through it."""
    import dataclasses

    import pyarrow as pa

    from dramatiq_pg_outbox.spark import write as spark_write
    from dramatiq_pg_outbox.spark import write_arrow_partition

    plan = dataclasses.replace(customer_id_plan(broker, "direct"), priority=3)
    batches = [pa.RecordBatch.from_pydict({"customer_id": pa.array(range(i, i + 100), pa.int64())})
               for i in (0, 100, 200)]  # fmt: skip
    columns = (
        "queue_name, actor_name, message_id, idempotency_key, priority, slot, state, attempts, "
        "next_attempt_at = enqueued_at, convert_from(payload, 'UTF8')::jsonb - 'message_timestamp'"
    )

    def stored() -> list[Any]:
        return db.execute(f"SELECT {columns} FROM dramatiq.messages ORDER BY id").fetchall()

    staged = stage_writes(monkeypatch)
    assert write_arrow_partition(plan, batches) == (300, 300, 0)
    assert not staged  # written directly
    direct = stored()
    assert count(db, "SELECT count(*) FROM dramatiq.idempotency_keys") == 300
    db.execute("TRUNCATE dramatiq.messages, dramatiq.idempotency_keys")
    monkeypatch.setattr(spark_write, "DIRECT_BYTES", 0)
    assert write_arrow_partition(plan, batches) == (300, 300, 0)
    assert staged == [True]
    assert stored() == direct and len(direct) == 300
    assert direct[0][:8] == ("notifications", "notify_customer", message_id_for("direct", 0), "direct:0",
                             3, -1, "pending", 0)  # fmt: skip


def test_the_direct_write_skips_keys_known_by_any_means_and_counts_repeats(
    actor: Any, broker: PostgresBroker, db: Any
) -> None:
    """Every conflict of the direct write (a key waiting, archived, stored by an older version
    without its row in idempotency_keys, repeated in the partition) rolls it back, and the
    staging table then skips or counts those keys."""
    import pyarrow as pa

    from dramatiq_pg_outbox.spark import write_arrow_partition

    def batch(*ids: int) -> Any:
        return pa.RecordBatch.from_pydict({"customer_id": pa.array(ids, pa.int64())})

    plan = customer_id_plan(broker, "known")
    assert write_arrow_partition(plan, [batch(0, 1, 2)]) == (3, 3, 0)
    assert write_arrow_partition(plan, [batch(2, 3), batch(4, 3)]) == (4, 2, 1)  # 2 waits, 3 repeats
    # An older version's message (no row in idempotency_keys), waiting, and one in history
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload, idempotency_key, slot) "
        "VALUES ('notifications', 'notify_customer', 'm5', '\\x00', 'known:5', -1)"
    )
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, "
        "started_at, finished_at, payload, idempotency_key) VALUES (-6, 'notifications', 'notify_customer', "
        "'m6', 'completed', 1, now(), now(), now(), '\\x00', 'known:6')"
    )
    assert write_arrow_partition(plan, [batch(5, 7)]) == (2, 1, 0)
    assert write_arrow_partition(plan, [batch(6, 8)]) == (2, 1, 0)
    assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE idempotency_key LIKE 'known:%'") == 8
    assert write_arrow_partition(plan, [batch(*range(9))]) == (9, 0, 0)


def test_concurrent_duplicate_tasks_write_each_message_once_directly_or_not(
    actor: Any, broker: PostgresBroker, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative execution on the Arrow writer: twins claim the same keys by COPY (the
    direct write) or through the staging table (a partition too large to hold)."""
    import threading

    import pyarrow as pa

    from dramatiq_pg_outbox.spark import write as spark_write
    from dramatiq_pg_outbox.spark import write_arrow_partition

    batches = [pa.RecordBatch.from_pydict({"customer_id": pa.array(range(i, i + 1000), pa.int64())})
               for i in range(0, 5000, 1000)]  # fmt: skip
    for limit, batch_id in ((spark_write.DIRECT_BYTES, "held"), (0, "streamed")):
        monkeypatch.setattr(spark_write, "DIRECT_BYTES", limit)
        plan = customer_id_plan(broker, batch_id, notify=True)
        results: list[tuple[int, int, int]] = []

        def task(plan: Plan = plan, results: list[tuple[int, int, int]] = results) -> None:
            results.append(write_arrow_partition(plan, batches))

        threads = [threading.Thread(target=task) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(enqueued for _, enqueued, _ in results) == [0, 0, 5_000], batch_id
    assert count(db) == 10_000


def test_a_partition_over_the_direct_limit_or_delayed_streams_through_the_stage(
    actor: Any, broker: PostgresBroker, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import pyarrow as pa

    from dramatiq_pg_outbox.spark import write as spark_write
    from dramatiq_pg_outbox.spark import write_arrow_partition

    staged = stage_writes(monkeypatch)
    batches = [pa.RecordBatch.from_pydict({"customer_id": pa.array(range(i, i + 100), pa.int64())})
               for i in range(0, 1000, 100)]  # fmt: skip
    # Over the limit after 3 batches: the 3 held and the 7 still coming go through the stage
    monkeypatch.setattr(spark_write, "DIRECT_BYTES", batches[0].nbytes * 2)
    taken = iter(batches)
    assert write_arrow_partition(customer_id_plan(broker, "large"), taken) == (1000, 1000, 0)
    assert staged == [True] and next(taken, None) is None
    monkeypatch.setattr(spark_write, "DIRECT_BYTES", 64 << 20)
    delayed = dataclasses.replace(customer_id_plan(broker, "later"), delay_ms=60_000)
    assert write_arrow_partition(delayed, batches[:1]) == (100, 100, 0)
    assert staged == [True, True]
    assert count(
        db, "SELECT count(*) FROM dramatiq.messages WHERE next_attempt_at > now() + interval '50 s'"
    ) == (100)


def test_a_repeated_key_is_counted_or_with_on_duplicate_key_error_fails_before_any_write(
    spark: Any, actor: Any, broker: PostgresBroker, db: Any, database_url: str
) -> None:
    import dataclasses

    import pyarrow as pa

    from dramatiq_pg_outbox.spark import write_arrow_partition

    # Given customers 0-99 in four partitions, where customer 7 appears three times in one
    # partition and customer 8 twice in two partitions
    rows = [(i, f"c{i}@example.com", 0 if i < 50 else 1) for i in range(100)]
    rows += [(7, "x", 0), (7, "y", 0), (8, "z", 1)]
    df = spark.createDataFrame(rows, "customer_id long, email string, part int").repartitionByRange(2, "part")

    # When it is enqueued as it is: one message per customer, and what was dropped is counted
    result = enqueue_dataframe(df, actor, args=["customer_id", "email"], key="customer_id", batch_id="dup")
    assert (result.rows, result.enqueued, result.repeated, result.skipped) == (103, 100, 2, 1)
    assert count(db) == 100

    # And with on_duplicate_key="error": the whole DataFrame is checked first, nothing written
    with pytest.raises(EnqueueError, match=r"2 key\(s\) have more than one row, for example 7 \(3 rows\)"):
        enqueue_dataframe(df, actor, args=["customer_id"], key="customer_id", batch_id="dup2",
                          on_duplicate_key="error")  # fmt: skip
    assert count(db) == 100
    # A partition's writer refuses its own repeats under "error" (format("dramatiq")'s tasks)
    plan = dataclasses.replace(customer_id_plan(broker, "dup3"), on_duplicate_key="error")
    batch = pa.RecordBatch.from_pydict({"customer_id": pa.array([1, 2, 1], pa.int64())})
    with pytest.raises(EnqueueError, match=r"1 row\(s\) of a partition of batch 'dup3' have the key"):
        write_arrow_partition(plan, [batch])
    with pytest.raises(Exception, match=r"on_duplicate_key='error' refuses them"):
        write_messages(spark.createDataFrame([(5,), (5,)], "customer_id long").coalesce(1), database_url,
                       actor="notify_customer", batch="dup4", key="customer_id", args="customer_id",
                       on_duplicate_key="error")  # fmt: skip
    assert count(db) == 100
    with pytest.raises(Exception, match="option 'on_duplicate_key' is skip or error"):
        write_messages(df, database_url, actor="notify_customer", batch="dup5", key="customer_id",
                       on_duplicate_key="fail")  # fmt: skip


def test_a_data_source_write_records_what_it_did_for_write_counts(
    spark: Any, actor: Any, db: Any, database_url: str
) -> None:
    from dramatiq_pg_outbox.spark import write_counts

    # Given 300 customers, one of them twice in its partition, written twice with one batch id
    rows = [(i, f"c{i}@example.com") for i in range(300)] + [(7, "again")]
    df = spark.createDataFrame(rows, "customer_id long, email string").coalesce(1)
    options = {"actor": "notify_customer", "queue": "notifications", "batch": "counted",
               "key": "customer_id", "args": "customer_id,email"}  # fmt: skip
    write_messages(df, database_url, **options)
    write_messages(df, database_url, **options)
    # Then each write left its figures: the first enqueued 300 (one key repeated), the re-run none
    first, again = write_counts(database_url, "counted")
    assert (first.rows, first.enqueued, first.skipped, first.repeated, first.partitions) == (
        301,
        300,
        0,
        1,
        1,
    )
    assert (again.rows, again.enqueued, again.skipped, again.repeated) == (301, 0, 301, 0)
    assert first.batch_id == "counted" and first.seconds > 0
    assert write_counts(database_url, "never") == []


def test_a_null_key_in_an_arrow_batch_names_the_key_column(
    actor: Any, broker: PostgresBroker, db: Any
) -> None:
    import pyarrow as pa

    from dramatiq_pg_outbox.spark import write_arrow_partition

    plan = customer_id_plan(broker, "nulls")
    good = pa.RecordBatch.from_pydict({"customer_id": pa.array([1, 2], pa.int64())})
    bad = pa.RecordBatch.from_pydict({"customer_id": pa.array([3, None], pa.int64())})
    with pytest.raises(EnqueueError, match="'customer_id' \\(the key\\) is null in a row of batch 'nulls'"):
        write_arrow_partition(plan, [good, bad])
    assert count(db) == 0


def test_concurrent_duplicate_tasks_write_each_message_once(
    actor: Any, broker: PostgresBroker, db: Any
) -> None:
    """Speculative execution: two attempts of the same task run at the same time."""
    import threading

    plan = customer_id_plan(broker, "speculative", notify=True)
    rows = [(i,) for i in range(5_000)]
    results: list[tuple[int, int, int]] = []
    threads = [threading.Thread(target=lambda: results.append(write_partition(plan, rows))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(enqueued for _, enqueued, _ in results) == [0, 0, 5_000]
    assert count(db) == 5_000


def test_a_twin_task_whose_messages_were_archived_meanwhile_adds_nothing(
    actor: Any, broker: PostgresBroker, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31, defect 4: a task checks its keys, then a twin task commits them and a worker
    archives them, then the task inserts.  Before the keys table the plain insert met no key
    (archived rows leave the unique index), and the twin check, comparing xmin with the
    transaction's id while the rows were written in a savepoint, never fired: every key ended
    archived and pending again."""
    import psycopg

    from dramatiq_pg_outbox._queries import queries_for_schema
    from dramatiq_pg_outbox._runtime import fence_params
    from dramatiq_pg_outbox.spark import write as spark_write

    queries = queries_for_schema("dramatiq")
    plan = customer_id_plan(broker, "twins")
    rows = [(i,) for i in range(200)]
    twin: list[tuple[int, int, int]] = []
    paused: list[bool] = []

    def between_the_check_and_the_insert() -> None:
        # The twin task commits the same keys, and a worker claims and acks every message.
        twin.append(write_partition(plan, rows))
        claimed = db.execute(
            "UPDATE dramatiq.messages SET state = 'processing', attempts = 1, lease = gen_random_uuid(), "
            "acquired_at = now() WHERE idempotency_key LIKE 'twins:%%' RETURNING id, lease"
        ).fetchall()
        assert db.execute(queries["ack"], fence_params(claimed)).rowcount == 200

    class PausingCursor(psycopg.Cursor[Any]):
        """Runs the interleaving once, right after this task's spark_drop_known."""

        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            result = super().execute(query, params, **kwargs)
            if query == queries["spark_drop_known"] and not paused:
                paused.append(True)
                between_the_check_and_the_insert()
            return result

    real_connect = spark_write.connect

    def connect(conninfo: str) -> Any:
        conn = real_connect(conninfo)
        conn.cursor_factory = PausingCursor
        return conn

    monkeypatch.setattr(spark_write, "connect", connect)
    # When the task writes its partition around the twin and the archive
    assert write_partition(plan, rows) == (200, 0, 0)
    # Then the twin enqueued every key, this task none, and each key is stored once: in history
    assert twin == [(200, 200, 0)]
    assert count(db) == 0
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE idempotency_key LIKE 'twins:%'") == 200


def test_a_custom_encoder_takes_the_python_path(spark: Any, actor: Any, db: Any) -> None:
    from dramatiq.encoder import PickleEncoder

    rows = [(i, decimal.Decimal(i) / 4) for i in range(10)]
    df = spark.createDataFrame(rows, "customer_id long, balance decimal(10,2)")
    result = enqueue_dataframe(
        df, actor, args=["balance"], key="customer_id", batch_id="pickled", encoder=PickleEncoder()
    )
    assert result.enqueued == 10
    payload = db.execute(
        "SELECT payload FROM dramatiq.messages WHERE idempotency_key = 'pickled:3'"
    ).fetchone()[0]
    message = PickleEncoder().decode(bytes(payload))
    assert message["args"] == [decimal.Decimal("0.75")] and message["message_id"] == message_id_for(
        "pickled", 3
    )


# -- format("dramatiq"): the data source -------------------------------------------------


def write_messages(df: Any, database_url: str, **options: str) -> None:
    from dramatiq_pg_outbox.spark import register

    register(df.sparkSession)
    writer = df.write.format("dramatiq").option("url", database_url).mode("append")
    for name, value in options.items():
        writer = writer.option(name, value)
    writer.save()


def test_the_data_source_writes_the_messages_enqueue_dataframe_writes(
    spark: Any, actor: Any, db: Any, database_url: str
) -> None:
    # Given 1,000 customers written by format("dramatiq")
    source = {
        "actor": "notify_customer", "queue": "notifications", "batch": "s1", "key": "customer_id",
        "args": "customer_id,email", "kwargs": "segment=segment", "options": '{"max_retries": 2}',
    }  # fmt: skip
    write_messages(customers(spark, 1000), database_url, **source)
    # Then every row is one message, with the id, key and payload enqueue_dataframe gives it
    rows = db.execute(
        "SELECT idempotency_key, message_id, queue_name, actor_name, payload FROM dramatiq.messages"
    )
    by_key = {r[0]: r for r in rows.fetchall()}
    assert len(by_key) == 1000
    _, message_id, queue_name, actor_name, payload = by_key["s1:42"]
    assert message_id == message_id_for("s1", 42)
    assert (queue_name, actor_name) == ("notifications", "notify_customer")
    message = Message.decode(bytes(payload))
    assert list(message.args) == [42, "c42@example.com"] and message.kwargs == {"segment": "gold"}
    assert message.options == {"max_retries": 2, "idempotency_key": "s1:42"}
    # When the same batch is written again, in other partitions, and enqueue_dataframe adds to it
    write_messages(customers(spark, 1000, partitions=3), database_url, **source)
    again = enqueue_dataframe(
        customers(spark, 1000), actor, args=["customer_id", "email"], kwargs={"segment": "segment"},
        key="customer_id", batch_id="s1", options={"max_retries": 2},
    )  # fmt: skip
    # Then nothing is added: one code path, one key per row
    assert count(db) == 1000 and again.enqueued == 0
    # And a worker runs them
    worker = dramatiq.Worker(actor.broker, worker_timeout=100, worker_threads=4)
    worker.start()
    try:
        actor.broker.join("notifications", timeout=30_000)
    finally:
        worker.stop()
    assert count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'completed'") == 1000


def test_the_data_source_names_a_missing_or_bad_option(spark: Any, db: Any, database_url: str) -> None:
    df = customers(spark, 10)
    good = {"actor": "notify_customer", "batch": "s2", "key": "customer_id"}
    cases = [
        ({"actor": "notify_customer", "key": "customer_id"}, r"needs the option\(s\) \['batch'\]"),
        ({**good, "acter": "x"}, r"unknown option\(s\) \['acter'\]"),
        ({**good, "args": "customer_id,nope"}, r"option 'args' names the column 'nope'"),
        ({**good, "kwargs": "segment"}, r"option 'kwargs' takes name=column pairs"),
        ({**good, "delay": "soon"}, r"option 'delay' is a number of milliseconds"),
        ({**good, "options": "[1]"}, r"option 'options' is a JSON object"),
        ({**good, "options": '{"broker_priority": 300}'}, r"option 'options'.*broker_priority"),
        ({**good, "queue": "bad queue"}, r"option 'queue'"),
    ]
    for options, expected in cases:
        with pytest.raises(Exception, match=expected):
            write_messages(df, database_url, **options)
    with pytest.raises(Exception, match=r"only appends messages") as refused:
        df.write.format("dramatiq").option("url", database_url).options(**good).mode("overwrite").save()
    # The fix comes first: Spark's own refusal of its default mode suggests "Overwrite" too
    assert last_line(refused.value).startswith('ValueError: use .mode("append"): format("dramatiq")')
    assert count(db) == 0


def last_line(error: BaseException) -> str:
    """The last line of Spark's error, where the data source's own error is, but for the line
    ``SQLSTATE: 38000`` that Spark adds after the Python traceback it wraps."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if re.fullmatch(r"SQLSTATE: \w+", lines[-1]) and len(lines) > 1:
        lines.pop()
    return lines[-1]


@contextlib.contextmanager
def spark_jobs(spark: Any) -> Iterator[list[int]]:
    """The ids of the Spark jobs that the block ran (none: no task ran), filled at its end."""
    group = f"jobs-{uuid.uuid4().hex}"
    context = spark.sparkContext
    context.setJobGroup(group, "counted by a test")
    jobs: list[int] = []
    try:
        yield jobs
    finally:
        jobs.extend(context.statusTracker().getJobIdsForGroup(group))
        context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]


def test_a_write_to_a_database_that_is_not_ready_fails_before_any_task_naming_the_fix(
    spark: Any, actor: Any, admin_url: str, database_url: str
) -> None:
    from sqlalchemy.engine import make_url

    from dramatiq_pg_outbox.spark import register
    from dramatiq_pg_outbox.testing import scratch_database

    register(spark)
    # (No shuffle: Spark would run its stage before it plans the write, which runs none)
    df = spark.createDataFrame(
        [(i, f"c{i}@example.com") for i in range(10)], "customer_id long, email string"
    )
    source = {"actor": "notify_customer", "batch": "c1", "key": "customer_id", "args": "customer_id"}
    closed_port = "postgresql://nobody:pw-closed@127.0.0.1:1/none"
    missing = make_url(database_url).set(database=f"dpo_missing_{uuid.uuid4().hex[:8]}")
    with scratch_database(admin_url, "dpo_unmigrated") as unmigrated:
        unmigrated_url, secret = with_password(unmigrated)
        cases = [
            (
                closed_port,
                r"ConnectionFailed: cannot connect to PostgreSQL at 127\.0\.0\.1:1 "
                r"\(postgresql://nobody:\*\*\*@127\.0\.0\.1:1/none\): connection refused\. .* skip this "
                r'check with \.option\("check_database", "false"\)$',
            ),
            (
                missing.render_as_string(hide_password=False),
                rf"ConnectionRejected: PostgreSQL at .* has no database '{missing.database}'\. "
                r"Check the database name in the URL, or create it \(createdb dpo_missing_\w+\)$",
            ),
            (
                unmigrated_url,
                r"SchemaNotReady: The dramatiq-pg-outbox tables do not exist in schema 'dramatiq' of "
                r'.*\. Run: dramatiq-pg-outbox migrate --url "\$DATABASE_URL" --schema dramatiq '
                r"\(after setting DATABASE_URL to the URL of that database, its password included\)$",
            ),
        ]
        for url, expected in cases:
            # When the DataFrame is written there
            with spark_jobs(spark) as jobs, pytest.raises(Exception) as failed:
                write_messages(df, url, **source)
            assert jobs == [], url
            # Then save() fails while the write is planned, before any job or task, and the
            # last line of Spark's error is ours: once, naming the fix, without the password
            text = str(failed.value)
            assert re.search(expected, last_line(failed.value)), text
            cause = last_line(failed.value).split(": ", 1)[1]
            assert text.count(cause) == 1, text
            assert "pw-closed" not in text and secret not in text
        # And an unmigrated schema refuses enqueue_dataframe the same way, before any job
        with (
            spark_jobs(spark) as jobs,
            pytest.raises(SchemaNotReady, match="Run: dramatiq-pg-outbox migrate"),
        ):
            enqueue_dataframe(df, actor, key="customer_id", batch_id="c2", url=unmigrated_url)
        assert jobs == []
        # And a write to a migrated database (the check passes) writes as before
        write_messages(df, database_url, **source)
    # And with check_database false, the driver does not connect: the tasks fail instead
    with spark_jobs(spark) as jobs, pytest.raises(Exception, match="Connection refused"):
        write_messages(df, closed_port, check_database="false", **source)
    assert jobs != []
    with pytest.raises(Exception, match=r"option 'check_database' is true or false, not 'maybe'"):
        write_messages(df, database_url, check_database="maybe", **source)


def test_check_actor_refuses_an_actor_or_queue_no_live_worker_has_before_any_task(
    spark: Any, actor: Any, broker: PostgresBroker, start_worker: Any, db: Any, database_url: str
) -> None:
    from dramatiq_pg_outbox.spark import UnknownActor

    df = spark.createDataFrame(
        [(i, f"c{i}@example.com") for i in range(10)], "customer_id long, email string"
    )
    source = {"batch": f"a-{uuid.uuid4().hex[:6]}", "key": "customer_id", "args": "customer_id,email"}
    skip = r'skip this check with \.option\("check_actor", "false"\)$'
    # Given no live worker: the opt-in check refuses the write, before any job
    with spark_jobs(spark) as jobs, pytest.raises(Exception) as failed:
        write_messages(
            df, database_url, actor="notify_customer", queue="notifications", check_actor="true", **source
        )
    assert jobs == []
    assert re.search(r"UnknownActor: no live worker: no worker process heartbeated in the last 20 s.*" + skip,
                     last_line(failed.value)), str(failed.value)  # fmt: skip
    # Given a worker of queue "notifications" whose broker declares notify_customer
    start_worker(broker)
    consuming = "SELECT count(*) FROM dramatiq.workers WHERE 'notifications' = ANY (queues)"
    wait_for(lambda: count(db, consuming) == 1, 10, "the worker's row")
    written = "SELECT count(*) FROM dramatiq.idempotency_keys"  # waiting, running or finished
    cases = [
        (
            {"actor": "notify_custmer", "queue": "notifications"},
            r"UnknownActor: no live worker of queue 'notifications' declares actor 'notify_custmer' \(they "
            r"declare \['notify_customer'\]\): each message would be dead-lettered as ActorNotFound; did you "
            r"mean 'notify_customer'\? check the actor's name, or " + skip,
        ),
        (
            {"actor": "notify_customer", "queue": "notificatons"},
            r"UnknownActor: no live worker consumes queue 'notificatons' \(live workers consume "
            r"\['notifications'\]\): its messages would wait; check the option 'queue', or " + skip,
        ),
    ]
    for options, expected in cases:
        # When a write names an actor or a queue that no live worker has
        with spark_jobs(spark) as jobs, pytest.raises(Exception) as failed:
            write_messages(df, database_url, check_actor="true", **options, **source)
        # Then it fails on the driver, before any job, in one line naming the fix
        assert jobs == [], options
        assert re.search(expected, last_line(failed.value)), str(failed.value)
    # And enqueue_dataframe has the same check (a typo in the actor's name)
    with spark_jobs(spark) as jobs, pytest.raises(UnknownActor, match="did you mean 'notify_customer'"):
        enqueue_dataframe(df, "notify_custmer", queue_name="notifications", key="customer_id",
                          batch_id="a2", url=database_url, check_actor=True)  # fmt: skip
    assert jobs == []
    assert count(db, written) == 0
    # And the right actor and queue pass the check, and the messages are written
    write_messages(
        df, database_url, actor="notify_customer", queue="notifications", check_actor="true", **source
    )
    result = enqueue_dataframe(df, actor, key="customer_id", batch_id="a3", args=["customer_id"],
                               url=database_url, check_actor=True)  # fmt: skip
    assert result.enqueued == 10
    assert count(db, written) == 20
    # And without the option (its default), a typo is not checked: the messages are written
    write_messages(
        df, database_url, actor="notify_custmer", queue="notifications", **{**source, "batch": "a4"}
    )
    assert count(db, written) == 30
    with pytest.raises(Exception, match=r"option 'check_actor' is true or false, not 'yes'"):
        write_messages(df, database_url, actor="notify_customer", check_actor="yes", **source)


def test_a_jdbc_url_is_refused_with_its_libpq_form(spark: Any, actor: Any, db: Any) -> None:
    df = spark.createDataFrame([(1, "c1@example.com")], "customer_id long, email string")
    jdbc = "jdbc:postgresql://127.0.0.1:5432/app?user=app&password=s3cret-jdbc"
    source = {"actor": "notify_customer", "batch": "j1", "key": "customer_id"}
    expected = (
        r"option 'url': jdbc:postgresql://127\.0\.0\.1:5432/app\?user=app&password=\*\*\* is a JDBC URL; "
        r"write it without 'jdbc:', as libpq takes it: "
        r"postgresql://127\.0\.0\.1:5432/app\?user=app&password=\*\*\*$"
    )
    with spark_jobs(spark) as jobs, pytest.raises(Exception) as failed:
        write_messages(df, jdbc, **source)
    assert jobs == []
    assert re.search(expected, last_line(failed.value)) and "s3cret-jdbc" not in str(failed.value)
    with pytest.raises(ValueError, match="write it without 'jdbc:'") as direct:
        enqueue_dataframe(df, actor, key="customer_id", batch_id="j2", url=jdbc)
    assert "s3cret-jdbc" not in str(direct.value)


def test_reading_the_write_only_source_says_which_to_read(spark: Any) -> None:
    from dramatiq_pg_outbox.spark import register

    register(spark)
    line = 'ValueError: format("dramatiq") is write-only; read with dramatiq_history or dramatiq_backlog'
    for reader in (spark.read.format("dramatiq"), spark.read.format("dramatiq").schema("a int")):
        with pytest.raises(Exception) as failed:
            reader.option("url", "postgresql://nobody@127.0.0.1:1/none").load().collect()
        assert last_line(failed.value) == line, str(failed.value)


def test_the_data_source_fails_on_a_null_key_and_names_it(spark: Any, db: Any, database_url: str) -> None:
    rows = [(i, f"c{i}@example.com") for i in range(50)] + [(None, "nokey@example.com")]
    df = spark.createDataFrame(rows, "customer_id long, email string").coalesce(1)
    with pytest.raises(Exception, match=r"Column 'customer_id' \(the key\) is null in a row of batch 's3'"):
        write_messages(df, database_url, actor="notify_customer", batch="s3", key="customer_id", args="email")
    assert count(db) == 0


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Spark standalone cluster on this machine: a master and two workers of 1 core and 1 GB,
    shared by the cluster tests and stopped (every JVM) at the end of the session."""
    from dramatiq_pg_outbox.testing.spark_cluster import SparkStandaloneCluster

    logs = tmp_path_factory.mktemp("spark-cluster")
    cluster = SparkStandaloneCluster(workers=2, cores=1, memory="1g", log_dir=logs)
    with cluster:
        assert len(cluster.running()) >= 3  # the master and the workers
        yield cluster
    # No JVM, executor or Python worker of the cluster is left
    assert cluster.running() == []


def with_password(url: str) -> tuple[str, str]:
    """``url`` with a password in it, and the password: the URL's own, else a made-up one (which a
    server with trust authentication, as the test servers are, ignores)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.password:
        return url, str(parsed.password)
    secret = f"pw-{uuid.uuid4().hex}"
    return parsed.set(password=secret).render_as_string(hide_password=False), secret


def event_log_args(directory: Any) -> str:
    """``PYSPARK_SUBMIT_ARGS`` that make a driver write Spark's event log (every plan, property and
    task that the UI and the history server show) uncompressed into ``directory``."""
    directory.mkdir(exist_ok=True)
    return (
        f"--conf spark.eventLog.enabled=true --conf spark.eventLog.dir=file://{directory} "
        "--conf spark.eventLog.compress=false --conf spark.eventLog.rolling.enabled=false pyspark-shell"
    )


def files_text(directory: Any) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(directory.rglob("*")) if p.is_file())


@pytest.mark.parametrize("where", ["local", "cluster"])
def test_a_streaming_query_killed_mid_batch_writes_every_row_once_after_its_restart(
    db: Any, database_url: str, tmp_path: Any, where: str, request: pytest.FixtureRequest
) -> None:
    import json
    import signal
    import subprocess
    import sys

    # Given 4 files of 5,000 rows, one micro-batch each, written by two tasks per batch, and a
    # database URL with a password in it
    inputs, checkpoint, events = tmp_path / "in", tmp_path / "checkpoint", tmp_path / "events"
    inputs.mkdir()
    for f in range(4):
        lines = (
            json.dumps({"id": f * 5000 + i, "email": f"c{f * 5000 + i}@example.com"}) for i in range(5000)
        )
        (inputs / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    url, secret = with_password(database_url)
    # On a cluster: the driver here, the executors in the workers' JVMs, their Python workers
    # started by those (the package shipped to them by cluster_session)
    master = request.getfixturevalue("spark_cluster").master_url if where == "cluster" else ""
    command = [sys.executable, "-m", "tests.spark_stream_app", url, str(inputs), str(checkpoint), master]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYSPARK_SUBMIT_ARGS": event_log_args(events)}
    outputs: list[Any] = []

    def start() -> subprocess.Popen[bytes]:
        output = (tmp_path / f"driver-{len(outputs)}.log").open("wb")
        outputs.append(output)
        return subprocess.Popen(
            command, cwd=root, env=env, start_new_session=True, stdout=output, stderr=subprocess.STDOUT
        )

    # When the query (driver, executors, Python workers) is killed -9 once rows are committed
    query = start()

    def wrote() -> bool:
        assert query.poll() is None, "the query ended before it wrote anything"
        return count(db) > 0

    wait_for(wrote, 180, "the query's first committed rows")
    written = count(db)
    os.killpg(query.pid, signal.SIGKILL)
    query.wait(30)
    at_kill = count(db)
    assert 0 < written < 20_000
    # And restarted from its checkpoint until every file is processed
    again = start()
    try:
        assert again.wait(240) == 0, (tmp_path / "driver-1.log").read_text(errors="replace")[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(again.pid, signal.SIGKILL)  # the JVM may outlive its driver for a moment
        for output in outputs:
            output.close()
    # Then every row is exactly one message, all of one query (the checkpoint's)
    keys = [r[0] for r in db.execute("SELECT idempotency_key FROM dramatiq.messages").fetchall()]
    assert len(keys) == 20_000
    assert sorted(int(k.rsplit(":", 1)[1]) for k in keys) == list(range(20_000))
    assert len({k.split(":")[1] for k in keys}) == 1
    # And the password is nowhere: not in the plan the driver printed (explain, extended), the
    # event log (what the UI and the history server show: plans, properties, tasks), nor on a
    # cluster in the master's, the workers' and the executors' logs
    printed = (tmp_path / "driver-1.log").read_text(errors="replace")
    assert "== Physical Plan ==" in printed and "dramatiq" in printed
    killed = (tmp_path / "driver-0.log").read_text(errors="replace")
    shown = {"driver output": killed + printed, "event log": files_text(events)}
    assert shown["event log"], "no event log was written"
    if where == "cluster":
        # (the executors ran the driver's copy of the package, shipped by cluster_session)
        assert "/dramatiq_pg_outbox.zip/dramatiq_pg_outbox/__init__.py" in printed, printed[-3000:]
        shown["cluster logs"] = request.getfixturevalue("spark_cluster").logs()
        assert "dramatiq-pg-outbox-stream-test" in shown["cluster logs"]  # its executors' logs
    assert [name for name, text in shown.items() if secret in text] == []
    print(f"{where}: killed with {at_kill} of 20,000 rows written")


def test_the_pipeline_example_runs_on_a_cluster_without_showing_the_password(
    spark_cluster: Any, admin_url: str, tmp_path: Any
) -> None:
    import subprocess
    import sys

    # Given the example's server named by a URL with a password in it, and Spark's event log on
    url, secret = with_password(admin_url)
    events, report = tmp_path / "events", tmp_path / "report"
    env = {**os.environ, "DATABASE_URL": url, "PYSPARK_SUBMIT_ARGS": event_log_args(events)}
    # When the example runs against the standalone cluster (executors in the workers' JVMs)
    command = [
        sys.executable, "-m", "examples.spark_pipeline", "--master", spark_cluster.master_url,
        "--customers", "2000", "--processes", "1", "--threads", "4", "--out", str(report),
    ]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    # Then every check of its report passes and its files are written (by the executors)
    assert done.returncode == 0 and "\nOK: " in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"Spark {spark_cluster.master_url}" in done.stdout
    assert (report / "stats.csv").stat().st_size > 0 and (report / "parquet" / "stats").is_dir()
    # And the password shows nowhere: output, event log (plans, properties), cluster logs
    shown = {
        "output": done.stdout + done.stderr,
        "event log": files_text(events),
        "cluster logs": spark_cluster.logs(),
    }
    assert "spark-pipeline-example" in shown["cluster logs"]
    assert "BatchScan dramatiq_history" in shown["event log"]
    assert [name for name, text in shown.items() if secret in text] == []


# -- format("dramatiq_history") ----------------------------------------------------------


def _history_days(db: Any) -> None:
    """History over 2026-11-20 to 23, 10 rows per queue (q1, q2) and day; the 20th has no day
    partition (its rows are in history_default), the others have one."""
    db.execute("SELECT dramatiq.create_history_partitions(2, '2026-11-21'::date)")
    db.execute(
        """
        INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts,
            enqueued_at, started_at, finished_at, payload)
        SELECT row_number() OVER (), q, 'a', q || d || k, CASE WHEN k = 0 THEN 'failed' ELSE 'completed' END,
               1 + k % 2, f - interval '2 s', f - interval '1 s', f, '\\x'::bytea
        FROM unnest(ARRAY['q1', 'q2']) AS q,
             generate_series(20, 23) AS d,
             generate_series(0, 9) AS k,
             LATERAL (SELECT make_timestamptz(2026, 11, d, k, 0, 0.5, 'UTC') AS f) AS t
        """
    )
    in_default = db.execute("SELECT count(*) FROM dramatiq.history_default").fetchone()[0]
    assert in_default == 20


def _plan(df: Any) -> str:
    return str(df._jdf.queryExecution().executedPlan().toString())


def _pushed_filters(df: Any) -> str:
    """What the ``PushedFilters: [...]`` line of the history scan says in ``df.explain("formatted")``
    ("" without that line: nothing pushed)."""
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        df.explain("formatted")
    found = re.search(r"^\(\d+\) BatchScan dramatiq_history\n(.*?)\n\n", out.getvalue(), re.M | re.S)
    assert found, out.getvalue()
    lines = [line for line in found.group(1).splitlines() if line.startswith("PushedFilters: ")]
    return lines[0].removeprefix("PushedFilters: ") if lines else ""


def _ms(*moment: int) -> int:
    """Epoch milliseconds of a UTC moment (year, month, day[, hour[, minute[, second[, microsecond]]]])."""
    return int(datetime.datetime(*moment, tzinfo=datetime.timezone.utc).timestamp() * 1000)


def test_history_reads_one_partition_per_day_and_pushes_filters_exactly(
    spark: Any, db: Any, database_url: str
) -> None:
    from pyspark.sql import functions as F

    from dramatiq_pg_outbox.spark import register
    from dramatiq_pg_outbox.spark.history import HistoryDataSource, PushingHistoryDataSource

    _history_days(db)

    def fresh() -> Any:
        """A newly loaded history: Spark 4.3 runs a pushed read again for a reused DataFrame."""
        return spark.read.format("dramatiq_history").option("url", database_url).load()

    register(spark)
    # A time range reads the partitions of its days only
    assert fresh().count() == 80
    days = (
        spark.read.format("dramatiq_history").option("url", database_url)
        .option("since", "2026-11-21").option("until", "2026-11-23").load()
    )  # fmt: skip
    assert days.rdd.getNumPartitions() == 2 and days.count() == 40
    # The pushing reader, one query per loaded DataFrame (the only use that is right on 4.3):
    # filters on the queue and the finish time go to PostgreSQL, the rest stays with Spark
    x = _ms(2026, 11, 21, 5, 0, 0, 500_000)  # exactly when the rows of 05:00:00.5 on the 21st finished
    expected = db.execute(
        "SELECT count(*) FROM dramatiq.history WHERE queue_name = 'q1' AND attempts > 1 "
        "AND (extract(epoch FROM finished_at) * 1000)::bigint > %s",
        (x,),
    ).fetchone()[0]
    wanted = (F.col("queue_name") == "q1") & (F.col("finished_ms") > x) & (F.col("attempts") > 1)
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    try:
        spark.dataSource.register(PushingHistoryDataSource)
        picked = fresh().filter(wanted)
        plan = _plan(picked)
        spark_filter = next(line for line in plan.splitlines() if " Filter " in line)
        assert "(attempts#" in spark_filter and "> 1)" in spark_filter, plan
        assert " = q1)" not in spark_filter and f"> {x})" not in spark_filter, plan
        # explain("formatted") names what was pushed
        pushed = _pushed_filters(picked)
        assert "EqualTo(queue_name,q1)" in pushed and f"GreaterThan(finished_ms,{x})" in pushed, pushed
        assert "attempts" not in pushed, pushed
        assert picked.count() == expected == 12  # odd hours after 05:00 on the 21st, then all odd hours
        # Exactly at the boundary: the rows that finished at x itself
        assert fresh().filter(F.col("finished_ms") == x).count() == 2
        after = fresh().filter(F.col("finished_ms") > x).count()
        assert fresh().filter(F.col("finished_ms") >= x).count() == after + 2
        assert fresh().filter(F.col("finished_ms") <= x).count() == 80 - after
        assert fresh().filter(F.col("state").isin("failed")).count() == 8
        # The reader register() chooses on PySpark 4.3 pushes nothing, setting on or not
        spark.dataSource.register(HistoryDataSource)
        plain = fresh().filter(F.col("queue_name") == "q1")
        assert " = q1)" in _plan(plain) and _pushed_filters(plain) == ""
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")
        register(spark)
    # With pushdown off, the same filters are Spark's and give the same answers
    same = fresh().filter(wanted)
    assert " = q1)" in _plan(same) and same.count() == expected


def _history_rows(db: Any) -> dict[str, Any]:
    """3,000 finished messages, one every 70 s from 2026-11-20 00:00 UTC (into the 22nd), queues
    q0 to q2, one in ten failed; what SQL says the queries of :func:`_reuse_one_history` return."""
    db.execute("SELECT dramatiq.create_history_partitions(2, '2026-11-21'::date)")
    db.execute(
        """
        INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts,
            enqueued_at, started_at, finished_at, payload)
        SELECT g, 'q' || (g % 3), 'a', 'm' || g, CASE WHEN g % 10 = 0 THEN 'failed' ELSE 'completed' END,
               1, f - interval '2 s', f - interval '1 s', f, '\\x'::bytea
        FROM generate_series(1, 3000) AS g,
             LATERAL (SELECT timestamptz '2026-11-20 00:00:00+00' + g * interval '70 s' AS f) AS t
        """
    )

    def count(where: str) -> int:
        return int(db.execute(f"SELECT count(*) FROM dramatiq.history WHERE {where}").fetchone()[0])

    before = f"(extract(epoch FROM finished_at) * 1000)::bigint < {_ms(2026, 11, 21, 6)}"
    return {
        "count": 3000,
        "filtered count": count(before),
        "count again": 3000,
        "filter matching nothing": 0,
        "count after it": 3000,
        "count per state": {"completed": count("state = 'completed'"), "failed": count("state = 'failed'")},
    }


def _reuse_one_history(spark: Any, url: str) -> dict[str, Any]:
    """Issue 34's sequence of queries on one loaded history DataFrame."""
    from pyspark.sql import functions as F

    h = spark.read.format("dramatiq_history").option("url", url).load()
    got: dict[str, Any] = {"count": h.count()}
    got["filtered count"] = h.filter(F.col("finished_ms") < _ms(2026, 11, 21, 6)).count()
    got["count again"] = h.count()
    got["filter matching nothing"] = h.filter(F.col("finished_ms") < _ms(2026, 11, 1)).count()
    got["count after it"] = h.count()
    got["count per state"] = {r["state"]: r["count"] for r in h.groupBy("state").count().collect()}
    return got


def test_one_loaded_history_answers_each_query_with_pushdown_on(
    spark: Any, db: Any, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from dramatiq_pg_outbox.spark import register

    expected = _history_rows(db)
    assert 0 < expected["filtered count"] < 3000
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    try:
        with caplog.at_level(logging.INFO, logger="dramatiq_pg_outbox.spark.history"):
            register(spark)
        got = _reuse_one_history(spark, database_url)
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")
        register(spark)
    assert got == expected
    # PySpark 4.3 reruns the last pushed read: register() pushes nothing there and says so
    from dramatiq_pg_outbox.spark.history import spark_scopes_pushdown_per_scan

    assert not spark_scopes_pushdown_per_scan(spark)
    [line] = [r for r in caplog.records if r.name == "dramatiq_pg_outbox.spark.history"]
    assert line.levelname == "WARNING" and "pushes no filter" in line.getMessage()


def test_pushdown_enabled_after_register_is_said_at_the_call_and_reads_right(
    spark: Any, db: Any, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from dramatiq_pg_outbox.spark import register

    expected = _history_rows(db)
    # (Not spark.newSession(): it inherits the data sources and refuses to register them again.)
    assert spark.conf.get("spark.sql.python.filterPushdown.enabled") == "false"
    with caplog.at_level(logging.INFO, logger="dramatiq_pg_outbox.spark.history"):
        register(spark)
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    try:
        got = _reuse_one_history(spark, database_url)
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")
    assert got == expected
    [line] = [r for r in caplog.records if r.name == "dramatiq_pg_outbox.spark.history"]
    assert "pushes no filter" in line.getMessage() and "not later" in line.getMessage()


def test_history_names_a_bad_option(spark: Any, database_url: str) -> None:
    from dramatiq_pg_outbox.spark import register

    register(spark)
    for options, expected in [
        ({}, r"needs the option\(s\) \['url'\]"),
        ({"url": database_url, "since": "yesterday"}, "option 'since' is epoch milliseconds or an ISO"),
        ({"url": database_url, "sinse": "2026-11-01"}, r"unknown option\(s\) \['sinse'\]"),
        ({"url": "mysql://x/y"}, "option 'url' is not a PostgreSQL URL"),
    ]:
        with pytest.raises(Exception, match=expected):
            spark.read.format("dramatiq_history").options(**options).load().count()


# -- format("dramatiq_backlog") ----------------------------------------------------------


def test_the_backlog_reads_the_live_messages_in_id_ranges(spark: Any, db: Any, database_url: str) -> None:
    from pyspark.sql import functions as F

    from dramatiq_pg_outbox.spark import register

    # Given 1,000 live messages: due, delayed, prioritized, one being processed, with gaps in the ids
    db.execute(
        """
        INSERT INTO dramatiq.messages (id, queue_name, actor_name, message_id, state, attempts,
            next_attempt_at, lease, owner, acquired_at, priority, idempotency_key, payload, slot)
        SELECT g * 3, CASE WHEN g % 2 = 0 THEN 'emails' ELSE 'reports' END, 'a' || (g % 3), 'm' || g,
               CASE WHEN g = 7 THEN 'processing' ELSE 'pending' END, g % 4,
               now() + CASE WHEN g % 5 = 0 THEN interval '1 hour' ELSE interval '0' END,
               CASE WHEN g = 7 THEN gen_random_uuid() END, NULL, CASE WHEN g = 7 THEN now() END,
               CASE WHEN g % 10 = 0 THEN 3 ELSE 0 END, CASE WHEN g % 2 = 0 THEN 'k' || g END, '\\x'::bytea,
               CASE WHEN g % 2 = 0 THEN -1 ELSE dramatiq.message_slot() END  -- keyed: messages_vacuumed
        FROM generate_series(1, 1000) AS g
        """
    )
    register(spark)
    # When the backlog is read in 3 partitions
    backlog = spark.read.format("dramatiq_backlog").option("url", database_url).option("partitions", 3).load()
    # Then it is split into 3 id ranges and holds every message once, as SQL reads it
    assert backlog.rdd.getNumPartitions() == 3
    got = sorted(tuple(r) for r in backlog.collect())
    expected = sorted(
        tuple(r)
        for r in db.execute(
            """
            SELECT id, queue_name, actor_name, message_id, state, attempts, priority,
                   (extract(epoch FROM enqueued_at) * 1000)::bigint,
                   (extract(epoch FROM next_attempt_at) * 1000)::bigint,
                   (extract(epoch FROM acquired_at) * 1000)::bigint, idempotency_key
            FROM dramatiq.messages
            """
        )
    )
    assert len(got) == 1000 and got == expected
    assert backlog.filter(F.col("state") == "processing").select("acquired_ms").first()[0] is not None
    by_state = backlog.groupBy("queue_name", "state").count().collect()
    counts = {(r["queue_name"], r["state"]): r["count"] for r in by_state}
    assert counts == {("emails", "pending"): 500, ("reports", "pending"): 499, ("reports", "processing"): 1}
    # And an empty table reads as an empty DataFrame; a bad option is named
    db.execute("TRUNCATE dramatiq.messages")
    assert spark.read.format("dramatiq_backlog").option("url", database_url).load().count() == 0
    for options, message in [
        ({"url": database_url, "partitions": "0"}, "option 'partitions' is a whole number from 1"),
        ({"url": database_url, "partition": "2"}, r"unknown option\(s\) \['partition'\]"),
        ({}, r"needs the option\(s\) \['url'\]"),
    ]:
        with pytest.raises(Exception, match=message):
            spark.read.format("dramatiq_backlog").options(**options).load().count()


def test_a_loaded_backlog_dataframe_queried_again_reads_the_messages_enqueued_since(
    spark: Any, db: Any, database_url: str
) -> None:
    """PySpark 4.3 reruns a loaded DataFrame's planned partitions for a later query: with a
    closed id range the second count missed every message enqueued after the first (100, not 150)."""
    from dramatiq_pg_outbox.spark import register

    def add(first: int, n: int) -> None:
        db.execute(
            "INSERT INTO dramatiq.messages (id, queue_name, actor_name, message_id, payload, slot) "
            "SELECT g, 'q', 'a', 'm' || g, '\\x'::bytea, dramatiq.message_slot() "
            "FROM generate_series(%s::bigint, %s::bigint) AS g",
            (first, first + n - 1),
        )

    add(1, 100)
    register(spark)
    backlog = spark.read.format("dramatiq_backlog").option("url", database_url).option("partitions", 3).load()
    assert backlog.count() == 100
    add(1001, 50)
    assert backlog.count() == 150
    assert backlog.filter("id > 1000").count() == 50


def test_history_and_backlog_with_a_read_url_read_the_standby(spark: Any, standby: Any) -> None:
    from dramatiq_pg_outbox.spark import register

    primary = standby.primary
    queue = f"hq_{uuid.uuid4().hex[:8]}"

    def rows(source: str = "dramatiq_history") -> int:
        read = spark.read.format(source).option("url", primary.url).option("read_url", standby.url).load()
        return int(read.filter(f"queue_name = '{queue}'").count())

    register(spark)
    # Given the standby's replay paused, then history rows finished on the primary
    standby.pause_replay()
    with psycopg.connect(primary.url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, "
            "enqueued_at, started_at, finished_at, payload) "
            "SELECT 1e9 + k, %s, 'a', %s || k, 'completed', 1, now(), now(), now(), '\\x'::bytea "
            "FROM generate_series(1, 3) AS k",
            (queue, queue),
        )
    sender = PostgresBroker(url=primary.url)
    try:
        dramatiq.actor(lambda: None, broker=sender, queue_name=queue, actor_name=queue).send()
        # Then a read from the standby does not see them, and sees them once it has replayed
        assert rows() == 0 and rows("dramatiq_backlog") == 0
        standby.resume_replay()
        standby.wait_replayed()
        assert rows() == 3 and rows("dramatiq_backlog") == 1
    finally:
        sender.close()
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute("DELETE FROM dramatiq.history WHERE queue_name = %s", (queue,))
            conn.execute("DELETE FROM dramatiq.messages WHERE queue_name = %s", (queue,))
