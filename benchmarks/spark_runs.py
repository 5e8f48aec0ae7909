"""The measurements of the ``spark`` scenario inside one Spark application (one driver process).

``python -m benchmarks.spark_runs MASTER URL JSON [--rows N] [--runs R] [--stream-seconds S]``
is started by ``benchmarks/bench_spark.py``'s ``run`` once per Spark master (``local[2]``, then a
standalone cluster), because a process holds one SparkContext.  It writes its figures to JSON.

Batch, ``--runs`` rounds, each on freshly truncated tables, the cases interleaved:

- ``jdbc append``: ``df.write.format("jdbc").mode("append")`` of the rows (customer_id bigint,
  email text, segment text; batchsize 10,000) into a bare table without an index: the baseline;
- ``COPY floor, messages table``: the physical floor of the data source (issue 34): the same
  message rows (queue, actor, uuid5 id, idempotency key, JSON payload: the data source's bytes,
  by its encoder, in the executors), each task one binary COPY straight into the messages table
  and its indexes in one transaction (``bench_spark.copy_floor``): no staging table, no check of
  known keys, no NOTIFY (not idempotent);
- ``format("dramatiq")``: the same DataFrame written as messages by the data source (the
  executors encode a batch at a time with Arrow; a task of new keys COPYs them into
  ``idempotency_keys`` and its messages into the table, else it stages its rows, drops the
  known keys and INSERTs the rest; one NOTIFY per task), with a new batch id each round;
- ``enqueue_dataframe``: the same through the function (the same writer in each task; for
  scale);
- ``jdbc append, indexed messages``: for scale too, the message rows themselves (ids, keys and
  payloads built by the same encoder in the executors) appended by JDBC into a copy of the
  messages table with its indexes (``LIKE ... INCLUDING ALL``): what the table costs, without
  the staging and the history check (not idempotent).

Streaming, ``format("dramatiq")`` fed by Spark's ``rate`` source (2 partitions), default trigger:

- throughput: ``rate-micro-batch`` (the rate source that makes ``rowsPerBatch`` rows per
  micro-batch whatever the time, so the sink sets the pace), 100,000 rows per micro-batch;
  the rows of the micro-batches after the first over the sum of their durations (Spark's
  ``durationMs.triggerExecution``), checked against the rows committed;
- latency: a rate the sink keeps up with; for every row, from its ``timestamp`` (set by the rate
  source when it generates the row) to the moment its transaction's commit was seen (its NOTIFY
  received by a listening connection, which then reads which transactions are new), and to its
  ``enqueued_at`` (the writing transaction's start); p50 and p95 over the rows after the
  first third.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.bench_spark import BASELINE, FLOOR, batch_table, copy_floor, customers, message_rows
from dramatiq_pg_outbox.names import channel_for
from dramatiq_pg_outbox.spark import (
    cluster_session,
    enqueue_dataframe,
    jdbc_options,
    local_session,
    register,
)
from dramatiq_pg_outbox.urls import libpq_url

#: Rows per micro-batch when measuring the stream's throughput.
ROWS_PER_BATCH = 100_000
#: Rows per second offered when measuring the stream's latency.
LATENCY_RATE = 2_000


def execute(url: str, statement: str) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(statement).fetchone() if statement.lstrip().startswith("SELECT") else None
        if row is None:
            conn.execute(statement)
        return row[0] if row else None


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def batch(spark: Any, url: str, rows: int, partitions: int, runs: int) -> dict[str, list[float]]:
    """Seconds of each case in each round."""
    jdbc = jdbc_options(url)
    conninfo = libpq_url(url)
    df = customers(spark, rows, partitions)
    warm = customers(spark, 20_000, partitions)

    def append(frame: Any) -> None:
        frame.write.format("jdbc").options(**jdbc).option("dbtable", "plain_customers").option(
            "batchsize", "10000"
        ).mode("append").save()

    def source(frame: Any, batch_id: str) -> None:
        frame.write.format("dramatiq").option("url", url).option("actor", "notify_customer").option(
            "queue", "notifications"
        ).option("batch", batch_id).option("key", "customer_id").option("args", "customer_id,email").option(
            "kwargs", "segment=segment"
        ).mode("append").save()

    def function(frame: Any, batch_id: str) -> None:
        enqueue_dataframe(frame, "notify_customer", queue_name="notifications", key="customer_id",
                          args=["customer_id", "email"], kwargs={"segment": "segment"},
                          batch_id=batch_id, url=url)  # fmt: skip

    def jdbc_message_rows(frame: Any) -> Any:
        from pyspark.sql import functions as F

        prepared = message_rows(frame, "jdbc")
        return prepared.select(
            F.lit("notifications").alias("queue_name"), F.lit("notify_customer").alias("actor_name"),
            "message_id", "idempotency_key", F.col("payload").cast("binary").alias("payload"),
        )  # fmt: skip

    def append_messages(frame: Any) -> None:
        frame.write.format("jdbc").options(**jdbc).option("dbtable", "indexed_messages").option(
            "batchsize", "10000"
        ).mode("append").save()

    def fresh(table: str) -> None:
        execute(url, f"TRUNCATE {table}")
        execute(url, f"VACUUM ANALYZE {table}")

    # Warm up the JVMs, the Python workers and every code path.
    append(warm)
    source(warm, "warm-source")
    function(warm, "warm-function")
    fresh("indexed_messages")
    append_messages(jdbc_message_rows(warm))
    fresh("dramatiq.messages, dramatiq.idempotency_keys")
    copy_floor(warm, conninfo, "warm-floor")
    cases: dict[str, list[float]] = {
        BASELINE: [],
        FLOOR: [],
        'format("dramatiq")': [],
        "enqueue_dataframe": [],
        "jdbc append, indexed messages": [],
    }
    for i in range(runs):
        fresh("plain_customers")
        cases[BASELINE].append(timed(lambda: append(df)))
        fresh("dramatiq.messages, dramatiq.idempotency_keys")
        cases[FLOOR].append(timed(lambda i=i: copy_floor(df, conninfo, f"floor-{i}")))
        assert execute(url, "SELECT count(*) FROM dramatiq.messages") == rows
        fresh("dramatiq.messages, dramatiq.idempotency_keys")
        cases['format("dramatiq")'].append(timed(lambda i=i: source(df, f"source-{i}")))
        assert execute(url, "SELECT count(*) FROM dramatiq.messages") == rows
        fresh("dramatiq.messages, dramatiq.idempotency_keys")
        cases["enqueue_dataframe"].append(timed(lambda i=i: function(df, f"function-{i}")))
        assert execute(url, "SELECT count(*) FROM dramatiq.messages") == rows
        fresh("indexed_messages")
        cases["jdbc append, indexed messages"].append(timed(lambda: append_messages(jdbc_message_rows(df))))
        assert execute(url, "SELECT count(*) FROM indexed_messages") == rows
        print(f"  batch round {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in cases.items()),
              flush=True)  # fmt: skip
    assert execute(url, "SELECT count(*) FROM plain_customers") == rows
    fresh("dramatiq.messages, dramatiq.idempotency_keys")
    df.unpersist()
    return cases


class CommitWatcher:
    """When each writing transaction's commit was seen: a LISTEN connection that, on each NOTIFY
    (sent at commit by the writer) and every 100 ms, reads which transactions (xmin) are new."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CommitWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        floor = 0
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'LISTEN "{channel_for("dramatiq")}"')
            while not self._stop.is_set():
                for _ in conn.notifies(timeout=0.1, stop_after=1):
                    pass
                now = time.time()
                # Concurrent tasks interleave their ids: look back well past the newest id seen.
                rows = conn.execute(
                    "SELECT xmin::text, max(id) FROM dramatiq.messages WHERE id > %s GROUP BY 1", (floor,)
                ).fetchall()
                for xmin, top in rows:
                    self.seen.setdefault(xmin, now)
                    floor = max(floor, int(top) - 200_000)


def stream(spark: Any, url: str, rate: int, seconds: float, watch: bool) -> dict[str, Any]:
    """Run a rate source into format("dramatiq") for ``seconds``: rows/s and latencies.

    ``watch``: the ``rate`` source at ``rate`` rows per second, latencies measured; else
    ``rate-micro-batch`` with ``rate`` rows per micro-batch, rows/s of the micro-batches.
    """
    from pyspark.sql import functions as F

    execute(url, "TRUNCATE dramatiq.messages, dramatiq.idempotency_keys")
    if watch:
        source = spark.readStream.format("rate").option("rowsPerSecond", rate)
    else:
        source = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", rate)
    rows = (
        source.option("numPartitions", 2)
        .load()
        .select(F.col("value"), (F.unix_micros("timestamp") / 1000).cast("long").alias("ts_ms"))
    )
    checkpoint = tempfile.mkdtemp(prefix="bench-spark-stream-")
    watcher = CommitWatcher(url) if watch else None
    if watcher:
        watcher.__enter__()
    query = (
        rows.writeStream.format("dramatiq")
        .option("url", url)
        .option("actor", "notify_customer")
        .option("queue", "notifications")
        .option("batch", f"rate-{uuid.uuid4().hex[:8]}")
        .option("key", "value")
        .option("args", "value,ts_ms")
        .option("checkpointLocation", checkpoint)
        .start()
    )
    started = time.time()
    time.sleep(seconds / 3)
    first = (time.time(), execute(url, "SELECT count(*) FROM dramatiq.messages"))
    time.sleep(seconds * 2 / 3)
    last = (time.time(), execute(url, "SELECT count(*) FROM dramatiq.messages"))
    # Stopping cancels the running micro-batch, which Spark logs at length as errors.
    spark.sparkContext.setLogLevel("OFF")
    query.stop()
    spark.sparkContext.setLogLevel("ERROR")
    if watcher:
        time.sleep(0.5)
        watcher.__exit__()
    progress = [p for p in query.recentProgress if p.numInputRows]
    result: dict[str, Any] = {"batches": len(progress)}
    if watch:
        result["offered_rows_per_s"] = rate
        result["rows_per_s"] = (last[1] - first[1]) / (last[0] - first[0])
    else:
        steady = progress[1:] or progress  # the first micro-batch also starts the Python workers
        took = sum(p.durationMs["triggerExecution"] for p in steady) / 1000
        result["rows_per_batch"] = rate
        result["rows_per_s"] = sum(p.numInputRows for p in steady) / took if took else float("nan")
        result["rows_committed"] = last[1]
        result["rows_in_batches"] = sum(p.numInputRows for p in progress)
    if watcher:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TEMP TABLE seen (tx text PRIMARY KEY, at double precision)")
            with conn.cursor().copy("COPY seen FROM STDIN") as copy:
                for xmin, at in watcher.seen.items():
                    copy.write_row((xmin, at))
            measured = conn.execute(
                """
                SELECT s.at * 1000 - t.ts, extract(epoch FROM m.enqueued_at) * 1000 - t.ts, s.at IS NULL
                FROM dramatiq.messages AS m
                CROSS JOIN LATERAL (SELECT (convert_from(m.payload, 'UTF8')::jsonb -> 'args' ->> 1)::bigint
                                    AS ts) AS t
                LEFT JOIN seen AS s ON s.tx = m.xmin::text
                WHERE t.ts >= %s
                """,
                (int((started + seconds / 3) * 1000),),
            ).fetchall()
        visible = sorted(float(r[0]) for r in measured if not r[2])
        enqueued = sorted(float(r[1]) for r in measured)
        result.update(
            rows_measured=len(measured),
            rows_unseen=sum(1 for r in measured if r[2]),
            visible_p50_ms=percentile(visible, 50),
            visible_p95_ms=percentile(visible, 95),
            enqueued_p50_ms=percentile(enqueued, 50),
            enqueued_p95_ms=percentile(enqueued, 95),
        )
    shown = ", ".join(f"{k} {v:,.0f}" for k, v in result.items() if isinstance(v, (int, float)))
    print(f"  stream ({'latency' if watch else 'throughput'}): {shown}", flush=True)
    return result


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1] if len(values) > 1 else values[0]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("master", help="local[2] or spark://host:port")
    parser.add_argument("url", help="the database (migrated, with a plain_customers table)")
    parser.add_argument("json", type=Path, help="where the figures go")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stream-seconds", type=float, default=30)
    parser.add_argument(
        "--rows-per-batch", type=int, default=ROWS_PER_BATCH, help="micro-batch rows of the throughput stream"
    )
    args = parser.parse_args(argv)
    name = "bench-spark"
    if args.master.startswith("local"):
        spark = local_session(name, cores=args.master[6:-1], memory="2g")
    else:
        spark = cluster_session(args.master, name)
    register(spark)
    figures: dict[str, Any] = {"master": args.master, "cores": spark.sparkContext.defaultParallelism}
    try:
        figures["batch"] = batch(spark, args.url, args.rows, args.partitions, args.runs)
        print(batch_table({args.master: figures}, args.rows), flush=True)
        seconds = args.stream_seconds
        figures["stream_throughput"] = stream(spark, args.url, args.rows_per_batch, seconds, watch=False)
        figures["stream_latency"] = stream(spark, args.url, LATENCY_RATE, seconds, watch=True)
    finally:
        spark.stop()
    args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
