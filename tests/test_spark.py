"""Spark integration: bulk enqueue from DataFrames and the analytics job.

Runs on a session-scoped ``local[2]`` SparkSession with the UI off.  Skipped
only when Java or pyspark is absent (``pip install '.[spark]'``).
"""

from __future__ import annotations

import decimal
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import Message

from dramatiq_pg_outbox import PostgresBroker

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install '.[spark]')")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Java is not installed (Spark needs a JVM)", allow_module_level=True)

from dramatiq_pg_outbox.spark import (  # noqa: E402
    _Plan,
    enqueue_dataframe,
    message_id_for,
    write_partition,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
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


def test_a_retried_task_adds_nothing(actor: Any, broker: PostgresBroker, db: Any) -> None:
    plan = _Plan.build(
        key="customer_id",
        args=["customer_id"],
        conninfo=broker.conninfo,
        schema="dramatiq",
        channel="dramatiq_pg_outbox.dramatiq",
        queue_name="notifications",
        actor_name="notify_customer",
        batch_id="retry",
        options={},
        delay_ms=0,
        notify=False,
        encoder=dramatiq.get_encoder(),
    )
    rows = [(i,) for i in range(100)]
    assert write_partition(plan, rows) == (100, 100)
    # The same task run again (Spark retried it after its commit): nothing new.
    assert write_partition(plan, rows) == (100, 0)
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
    with pytest.raises(Exception, match=r"Column 'customer_id' \(the key\) is null"):
        enqueue_dataframe(df, actor, args=["email"], key="customer_id", batch_id="b5")
    assert count(db) == 0


def test_an_unencodable_argument_fails_the_job_naming_the_column(spark: Any, actor: Any, db: Any) -> None:
    rows = [(i, decimal.Decimal("9.99") if i == 7 else None) for i in range(20)]
    df = spark.createDataFrame(rows, "customer_id long, balance decimal(10,2)").coalesce(1)
    with pytest.raises(Exception, match=r"Column 'balance' of the row with customer_id=7 cannot be encoded"):
        enqueue_dataframe(df, actor, args=["customer_id", "balance"], key="customer_id", batch_id="b6")
    assert count(db) == 0


def test_bad_parameters_are_refused_before_any_job(spark: Any, actor: Any) -> None:
    df = customers(spark, 3)
    with pytest.raises(ValueError, match="not in the DataFrame"):
        enqueue_dataframe(df, actor, args=["nope"], key="customer_id", batch_id="b7")
    with pytest.raises(ValueError, match="batch_id"):
        enqueue_dataframe(df, actor, key="customer_id", batch_id="")
    with pytest.raises(ValueError, match="queue_name"):
        enqueue_dataframe(df, "notify_customer", key="customer_id", batch_id="b7", url="postgresql://x/y")


def test_max_partitions_caps_connections(spark: Any, actor: Any, db: Any) -> None:
    result = enqueue_dataframe(
        customers(spark, 200, partitions=8), actor, args=["customer_id"], key="customer_id",
        batch_id="b8", max_partitions=2,
    )  # fmt: skip
    assert (result.enqueued, result.partitions) == (200, 2)


def test_the_json_fast_path_encodes_exactly_like_dramatiq() -> None:
    from dramatiq.encoder import JSONEncoder, PickleEncoder

    from dramatiq_pg_outbox.spark import _encode_rows

    fields: dict[str, Any] = {
        "conninfo": "", "schema": "dramatiq", "channel": "c", "queue_name": "q", "actor_name": "a",
        "batch_id": "b", "options": {"max_retries": 1, "note": "é"}, "delay_ms": 0, "notify": False,
    }  # fmt: skip
    # Columns: id (the key), then the args email, score, extra, then the kwarg column segment.
    rows = [(1, "x@example.com", 2.5, None, "gold"), ('k"2', "ü", float("nan"), [1, {"a": None}], "")]
    for encoder in (JSONEncoder(), PickleEncoder()):
        plan = _Plan.build(
            key="id",
            args=["email", "score", "extra"],
            kwargs={"segment": "segment"},
            encoder=encoder,
            **fields,
        )
        for row, (message_id, ikey, payload) in zip(rows, _encode_rows(plan, rows, 1234), strict=True):
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
