"""Spark bulk enqueue vs a plain Spark JDBC append, same rows, same run.

``python -m benchmarks.run --scenarios spark [--spark-rows N]`` (the ``spark`` scenario, issue 21):
``run`` below measures, in one Spark application on ``local[2]`` and then in one on a standalone
cluster started here (a master and two workers of 1 core; executors in their own JVMs), the
data source ``df.write.format("dramatiq")`` against a plain JDBC append of the same rows and
against its physical floor (each task COPYing the same message rows straight into the messages
table, :func:`copy_floor`; issue 34), and a stream from Spark's ``rate`` source through
``writeStream.format("dramatiq")``: rows per second, and each row's latency from its timestamp
to its commit (see ``spark_runs.py``).

The standalone script compares ``enqueue_dataframe`` with the JDBC append in more cases:

    python benchmarks/bench_spark.py                 # 1,000,000 rows
    python benchmarks/bench_spark.py --rows 200000 --partitions 4 --repeat 3

What is compared (each on a freshly truncated table, best of ``--repeat``):

- ``jdbc append``: ``df.write.jdbc(mode="append")`` of the customer rows
  (customer_id bigint, email text, segment text) into a bare table with no
  index, the fastest thing Spark does out of the box (batchsize 10,000;
  ``--rewrite-batched`` also turns on the driver's multi-row rewrite).
- ``enqueue_dataframe``: the same rows as Dramatiq messages (encoded JSON
  payloads, uuid5 ids, idempotency keys) into the broker's messages table,
  with its indexes and the history check.
- ``re-run (no-op)``: the same enqueue again with the same batch id, which
  adds nothing.
- ``python-encoded``: the enqueue with the payloads encoded per row in the
  executors' Python (the path taken for custom encoders and types Arrow
  cannot encode like Dramatiq) instead of a batch at a time.
- ``jdbc append (messages)``: for scale, a plain JDBC append of the rows that
  ``enqueue_dataframe`` writes (message id, key, JSON payload, built by the
  same encoder) into a bare table: the cost of the message format
  alone, without the queue table's indexes and the idempotency checks.

Needs the ``[spark]`` extra, Java 17 and the PostgreSQL JDBC jar (Debian:
``apt-get install libpostgresql-jdbc-java``).  The server: ``$DATABASE_URL``,
else the local one on 127.0.0.1:5432, else a throwaway one (a scratch
database is created and dropped either way).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psycopg
from dramatiq.encoder import JSONEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dramatiq_pg_outbox import upgrade
from dramatiq_pg_outbox.spark import (
    Plan,
    enqueue_dataframe,
    jdbc_jar,
    jdbc_options,
    local_session,
)
from dramatiq_pg_outbox.testing import postgres_server, scratch_database

#: The scenario's database.
DATABASE = "bench_spark"
#: The batch case that the others are compared to: the bare JDBC append of the customer rows.
BASELINE = "jdbc append"
#: The batch case of the physical floor (:func:`copy_floor`), the others' second reference.
FLOOR = "COPY floor, messages table"


class PythonJSONEncoder(JSONEncoder):
    """Dramatiq's JSON encoder under another type: forces the per-row Python encoding path."""


def customers(spark: Any, rows: int, partitions: int) -> Any:
    from pyspark.sql import functions as F

    df = (
        spark.range(0, rows, numPartitions=partitions)
        .select(
            F.col("id").alias("customer_id"),
            F.concat(F.lit("customer"), F.col("id").cast("string"), F.lit("@example.com")).alias("email"),
            F.when(F.col("id") % 10 == 0, "gold").otherwise("basic").alias("segment"),
        )
        .cache()
    )
    df.count()
    return df


def message_plan(batch_id: str, conninfo: str = "") -> Plan:
    """The write plan of the ``customers()`` rows as ``notify_customer`` messages (key
    customer_id, args customer_id and email, kwarg segment): the data source's, for the
    baselines that build the same message rows."""
    return Plan.build(
        key="customer_id", args=["customer_id", "email"], kwargs={"segment": "segment"},
        conninfo=conninfo, schema="dramatiq", channel="", queue_name="notifications",
        actor_name="notify_customer", batch_id=batch_id, options={}, delay_ms=0, notify=False,
        encoder=JSONEncoder(),
    )  # fmt: skip


def message_rows(frame: Any, batch_id: str) -> Any:
    """The rows enqueue_dataframe writes for ``customers()`` (id, key, JSON payload), built by the
    same encoder (``encode_batch``, in the executors), for a bare JDBC append of the message rows."""
    from dramatiq_pg_outbox.spark.encoding import encode_batch

    plan = message_plan(batch_id)

    def encode(batches: Any) -> Any:
        for batch in batches:
            yield encode_batch(plan, batch.select(list(plan.columns)), 0)

    return frame.select(*plan.columns).mapInArrow(
        encode, "message_id string, idempotency_key string, payload string"
    )


#: The columns of the messages table that the COPY floor fills (the others take their
#: defaults, as in the data source's insert: ``enqueued_at`` and ``next_attempt_at`` now(),
#: ``state`` pending, ``attempts`` 0).
FLOOR_COLUMNS = ("queue_name", "actor_name", "message_id", "idempotency_key", "payload", "priority", "slot")


def copy_floor(frame: Any, conninfo: str, batch_id: str) -> int:
    """The physical floor of the data source's write: each task COPYs its message rows straight
    into the messages table (:func:`floor_writer`, in a ``mapInArrow``); the rows written.

    The rows are the data source's (``customers()`` rows encoded by ``encode_batch`` in the
    executors: the same queue, actor, uuid5 ids, idempotency keys and JSON payload bytes), in
    the same Arrow batches.
    """
    import pyarrow as pa

    plan = message_plan(batch_id, conninfo)
    task = floor_writer(plan)

    def write(batches: Any) -> Any:
        yield pa.RecordBatch.from_pydict({"rows": [task(batches)]})

    selected = frame.select(*plan.columns)
    return sum(int(r["rows"]) for r in selected.mapInArrow(write, "rows long").collect())


def floor_writer(plan: Plan) -> Callable[[Iterable[Any]], int]:
    """One task of the floor: its Arrow batches (``plan.columns``) as messages in one transaction.

    One connection, one ``COPY dramatiq.messages (...) FROM STDIN (FORMAT BINARY)`` whose rows
    Arrow frames a batch at a time (``copy_binary_rows``, the data source's: no Python per row
    but the uuid5 of ``encode_batch``), ``slot`` -1 (the partition of keyed messages,
    ``messages_vacuumed``, as the data source), into the table and all its indexes,
    committed.  No staging table, no claim or check of the keys (no row in
    ``idempotency_keys``, no join with history), no NOTIFY: not idempotent, a lower bound.
    Returns the function (a closure: Spark pickles it by value, so the executors need only
    the package).
    """
    columns = list(plan.columns)
    statement = f"COPY {plan.schema}.messages ({', '.join(FLOOR_COLUMNS)}) FROM STDIN (FORMAT BINARY)"
    constants = (plan.queue_name.encode(), plan.actor_name.encode())
    tail = (plan.priority.to_bytes(2, "big", signed=True), (-1).to_bytes(2, "big", signed=True))

    def write(batches: Iterable[Any]) -> int:
        from dramatiq_pg_outbox.spark.encoding import (
            COPY_BINARY_HEADER,
            COPY_BINARY_TRAILER,
            copy_binary_rows,
            encode_batch,
        )

        now_ms = int(time.time() * 1000)
        written = 0
        with psycopg.connect(plan.conninfo) as conn, conn.cursor() as cur, cur.copy(statement) as copy:
            copy.write(COPY_BINARY_HEADER)
            for batch in batches:
                if batch.num_rows:
                    message_id, key, payload = encode_batch(plan, batch.select(columns), now_ms).columns
                    copy.write(copy_binary_rows([*constants, message_id, key, payload, *tail]))
                    written += batch.num_rows
            copy.write(COPY_BINARY_TRAILER)
        return written

    return write


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each case; the best is reported")
    parser.add_argument("--rewrite-batched", action="store_true", help="reWriteBatchedInserts=true for JDBC")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if jdbc_jar() is None:
        print("No PostgreSQL JDBC jar: apt-get install -y libpostgresql-jdbc-java", file=sys.stderr)
        return 2

    with postgres_server() as admin_url, scratch_database(admin_url, "bench_spark") as url:
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE plain_customers (customer_id bigint, email text, segment text)")
            conn.execute("CREATE TABLE plain_messages (message_id text, idempotency_key text, payload text)")
        spark = local_session("bench-spark", memory="2g")
        cores = spark.sparkContext.defaultParallelism
        df = customers(spark, args.rows, args.partitions)
        warm = customers(spark, 20_000, args.partitions)
        jdbc = jdbc_options(url)
        if args.rewrite_batched:
            jdbc["url"] += "&reWriteBatchedInserts=true"

        def truncate(table: str) -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(f"TRUNCATE {table}")
                conn.execute(f"VACUUM ANALYZE {table}")

        def jdbc_append(frame: Any, table: str = "plain_customers") -> None:
            frame.write.format("jdbc").options(**jdbc).option("dbtable", table).option(
                "batchsize", "10000"
            ).mode("append").save()

        def enqueue(frame: Any, batch_id: str, encoder: Any = None) -> Any:
            return enqueue_dataframe(
                frame,
                "notify_customer",
                queue_name="notifications",
                args=["customer_id", "email"],
                kwargs={"segment": "segment"},
                key="customer_id",
                batch_id=batch_id,
                url=url,
                encoder=encoder,
            )

        # Warm up the JVM, the Python workers and both code paths.
        jdbc_append(warm)
        enqueue(warm, "warmup")
        enqueue(warm, "warmup-python", PythonJSONEncoder())
        plain: list[float] = []
        ours: list[float] = []
        rerun: list[float] = []
        python_path: list[float] = []
        plain_messages: list[float] = []

        for i in range(args.repeat):
            truncate("plain_customers")
            plain.append(timed(lambda: jdbc_append(df))[0])
            truncate("plain_messages")
            plain_messages.append(timed(lambda: jdbc_append(message_rows(df, "plain"), "plain_messages"))[0])
            truncate("dramatiq.messages, dramatiq.idempotency_keys")
            seconds, result = timed(lambda i=i: enqueue(df, f"bench-{i}"))
            assert result.enqueued == args.rows, result
            ours.append(seconds)
            seconds, again = timed(lambda i=i: enqueue(df, f"bench-{i}"))
            assert again.enqueued == 0 and again.skipped == args.rows, again
            rerun.append(seconds)
            truncate("dramatiq.messages, dramatiq.idempotency_keys")
            seconds, result = timed(lambda i=i: enqueue(df, f"bench-py-{i}", PythonJSONEncoder()))
            assert result.enqueued == args.rows, result
            python_path.append(seconds)
        with psycopg.connect(url) as conn:
            stored = conn.execute("SELECT count(*) FROM dramatiq.messages").fetchone()
            plain_rows = conn.execute("SELECT count(*) FROM plain_customers").fetchone()
        spark.stop()

    assert stored is not None and plain_rows is not None
    assert stored[0] == args.rows and plain_rows[0] == args.rows
    best = {
        "jdbc append": min(plain),
        "enqueue_dataframe": min(ours),
        "re-run (no-op)": min(rerun),
        "python-encoded": min(python_path),
        "jdbc append (messages)": min(plain_messages),
    }
    print(
        f"\n{args.rows:,} rows, {args.partitions} partitions, local[{cores}], best of {args.repeat}, "
        f"JDBC reWriteBatchedInserts={'on' if args.rewrite_batched else 'off'}"
    )
    print(f"{'case':<24}{'seconds':>10}{'rows/s':>14}")
    for name, seconds in best.items():
        print(f"{name:<24}{seconds:>10.2f}{args.rows / seconds:>14,.0f}")
    ratio = best["enqueue_dataframe"] / best["jdbc append"]
    verdict = "within" if ratio <= 2 else "NOT within"
    print(f"\nenqueue_dataframe takes {ratio:.2f}x the time of the plain JDBC append ({verdict} the 2x goal)")
    if args.json:
        figures = {
            "rows": args.rows,
            "partitions": args.partitions,
            "cores": cores,
            "seconds": best,
            "all_runs": {
                "jdbc append": plain,
                "enqueue_dataframe": ours,
                "re-run (no-op)": rerun,
                "python-encoded": python_path,
                "jdbc append (messages)": plain_messages,
            },
            "ratio": ratio,
        }
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def _check_wrote(ctx: Any, where: str, figures: dict[str, Any]) -> None:
    """A smoke run's check: every case of the batch timed, and both streams wrote rows."""
    if not figures["batch"] or not all(figures["batch"].values()):
        ctx.failed(f"spark {where} batch", f"a case has no time: {figures['batch']}")
    if not figures["stream_throughput"].get("rows_committed"):
        ctx.failed(f"spark {where} stream (throughput)", "no row committed")
    if not figures["stream_latency"].get("rows_measured"):
        ctx.failed(f"spark {where} stream (latency)", "no row committed after the first third of the run")


def batch_table(figures: dict[str, Any], rows: int) -> str:
    """The batch cases of ``spark_runs`` (``{master: figures}``) as a Markdown table: each case's
    median seconds, its spread, rows per second, and its ratio to the bare JDBC append and to
    the COPY floor of the same master."""
    from benchmarks.bench_common import markdown_table

    out = []
    for where, f in figures.items():
        cases = {name: statistics.median(values) for name, values in f["batch"].items()}
        base, floor = cases[BASELINE], cases.get(FLOOR)
        for name, value in cases.items():
            spread = f"{min(f['batch'][name]):.2f}-{max(f['batch'][name]):.2f}"
            ratio = "1.00x (baseline)" if name == BASELINE else f"{value / base:.2f}x"
            to_floor = "-" if floor is None else "1.00x (floor)" if name == FLOOR else f"{value / floor:.2f}x"
            out.append([where, name, f"{value:.2f}", spread, f"{rows / value:,.0f}", ratio, to_floor])
    return markdown_table(
        ["spark", "case", "seconds (median)", "min-max", "rows/s", "vs jdbc append", "vs floor"], out
    )


def run(ctx: Any) -> dict[str, Any]:
    """The ``spark`` scenario of ``python -m benchmarks.run`` (see the module's documentation)."""
    import subprocess
    import tempfile

    from benchmarks.bench_common import drop_database, markdown_table, recreate_database
    from benchmarks.bench_systems import getenv_int
    from dramatiq_pg_outbox.testing.spark_cluster import SparkStandaloneCluster

    if importlib.util.find_spec("pyspark") is None:
        return {"skipped": "pyspark is not installed (pip install -e '.[spark]')"}
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return {"skipped": "no Java (apt-get install -y openjdk-17-jre-headless)"}
    if jdbc_jar() is None:
        return {"skipped": "no PostgreSQL JDBC jar: apt-get install -y libpostgresql-jdbc-java"}
    rows = getenv_int("BENCH_SPARK_ROWS", 1_000 if ctx.smoke else 200_000 if ctx.quick else 1_000_000)
    seconds = getenv_int("BENCH_SPARK_STREAM_SECONDS", 10 if ctx.smoke else 15 if ctx.quick else 30)
    # A smoke run: local[2] only (the tests start a standalone cluster; the script is the same),
    # the throughput stream's micro-batches as small as the batch.
    masters = ("local[2]",) if ctx.smoke else ("local[2]", "cluster")
    per_batch = ["--rows-per-batch", str(rows)] if ctx.smoke else []
    url = ctx.db_url(DATABASE)
    recreate_database(ctx.admin_url, DATABASE)
    upgrade(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE plain_customers (customer_id bigint, email text, segment text)")
        conn.execute("CREATE TABLE indexed_messages (LIKE dramatiq.messages INCLUDING ALL)")
    root = Path(__file__).resolve().parent.parent
    figures: dict[str, Any] = {}
    try:
        for where in masters:
            with contextlib.ExitStack() as stack:
                master = where
                if where == "cluster":
                    cluster = stack.enter_context(SparkStandaloneCluster(workers=2, cores=1, memory="2g"))
                    master = cluster.master_url
                out = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "figures.json"
                command = [sys.executable, "-m", "benchmarks.spark_runs", master, url, str(out), "--rows",
                           str(rows), "--runs", str(ctx.runs), "--stream-seconds", str(seconds)]  # fmt: skip
                command += per_batch
                print(f"  {where}: {' '.join(command[2:4])} ...", flush=True)
                env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
                subprocess.run(command, cwd=root, env=env, check=True, timeout=3600)
                figures[where] = json.loads(out.read_text())
                if ctx.smoke:
                    _check_wrote(ctx, where, figures[where])
    finally:
        drop_database(ctx.admin_url, DATABASE)
    stream_rows = []
    for where, f in figures.items():
        t, lat = f["stream_throughput"], f["stream_latency"]
        stream_rows.append([
            where, f"{t['rows_per_s']:,.0f}", f"{lat['offered_rows_per_s']:,}", f"{lat['rows_per_s']:,.0f}",
            f"{lat['visible_p50_ms']:,.0f}", f"{lat['visible_p95_ms']:,.0f}",
            f"{lat['enqueued_p50_ms']:,.0f}", f"{lat['enqueued_p95_ms']:,.0f}",
            f"{lat['rows_measured']:,} ({lat['rows_unseen']} unseen)",
        ])  # fmt: skip
    table = batch_table(figures, rows)
    stream_table = markdown_table(
        ["spark", "max rows/s (rate-micro-batch)", "offered rows/s", "rows/s",
         "row -> commit seen p50 ms", "p95 ms", "row -> enqueued_at p50 ms", "p95 ms", "rows measured"],
        stream_rows,
    )  # fmt: skip
    return {"rows": rows, "runs": ctx.runs, "stream_seconds": seconds, "figures": figures,
            "batch_table": table, "stream_table": stream_table}  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    sys.exit(main())
