"""Spark pipeline, end to end, with one command (from the repository root)::

    pip install -e '.[spark]'          # plus Java 17; JDBC jar optional (see README)
    python -m examples.spark_pipeline [--customers 200000] [--out DIR] [--master spark://HOST:7077]

1. A scratch database gets the broker's tables and a ``customers`` table
   (``--customers`` rows).
2. ``dramatiq examples.spark_pipeline.tasks`` workers start (real CLI worker
   processes).
3. Spark reads the customers and ``enqueue_dataframe`` turns every row into a
   ``notify_customer`` message, written by the executors (batch id
   ``newsletter-<date>``).
4. The workers notify every customer (the ``notifications`` table counts
   deliveries per customer); a few first attempts fail and are retried.
5. The same enqueue runs again with the same batch id: it must add nothing.
6. The workers stop; the analytics job reads the history and writes tables
   and charts to ``--out``.
7. The report checks: every customer notified exactly once, the re-run added
   nothing.  Exit status 0 when all checks pass.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

REPO_ROOT = Path(__file__).resolve().parents[2]
TASKS_MODULE = "examples.spark_pipeline.tasks"
QUEUE = "notifications"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.spark_pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--customers", type=int, default=200_000, help="rows in the customers table")
    parser.add_argument("--partitions", type=int, default=4, help="Spark partitions (= connections)")
    parser.add_argument("--processes", type=int, default=2, help="dramatiq worker processes")
    parser.add_argument("--threads", type=int, default=8, help="threads per worker process")
    parser.add_argument("--bucket", type=int, default=10, help="analytics time bucket, seconds")
    parser.add_argument("--timeout", type=float, default=900, help="longest wait for the workers, seconds")
    parser.add_argument("--master", default="", help="a cluster's URL (spark://host:7077); default local[*]")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "spark_pipeline_report")
    return parser.parse_args(argv)


def create_tables(url: str, customers: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """
            CREATE TABLE customers (
                customer_id bigint PRIMARY KEY,
                email       text NOT NULL,
                segment     text NOT NULL,
                signed_up   date NOT NULL
            );
            INSERT INTO customers
            SELECT g, 'customer' || g || '@example.com',
                   (ARRAY['basic', 'basic', 'basic', 'plus', 'gold'])[1 + g % 5],
                   date '2020-01-01' + (g % 1500)
            FROM generate_series(1, %s) AS g;
            CREATE TABLE notifications (
                customer_id bigint PRIMARY KEY,
                segment     text NOT NULL,
                deliveries  integer NOT NULL,
                at          timestamptz NOT NULL DEFAULT now()
            );
            """.replace("%s", str(int(customers)))
        )


def read_customers(spark: Any, url: str, partitions: int, customers: int) -> Any:
    """The customers table as a DataFrame: JDBC when a driver jar is there, else generated alike."""
    from pyspark.sql import functions as F

    from dramatiq_pg_outbox.spark import jdbc_jar, jdbc_options

    if jdbc_jar() is not None:
        return (
            spark.read.format("jdbc")
            .options(**jdbc_options(url))
            .option("dbtable", "customers")
            .option("partitionColumn", "customer_id")
            .option("lowerBound", "1")
            .option("upperBound", str(customers + 1))
            .option("numPartitions", str(partitions))
            .load()
        )
    print("  (no PostgreSQL JDBC jar: the DataFrame is generated with the same rows instead of read)")
    segments = F.array(*[F.lit(s) for s in ("basic", "basic", "basic", "plus", "gold")])
    return spark.range(1, customers + 1, numPartitions=partitions).select(
        F.col("id").alias("customer_id"),
        F.concat(F.lit("customer"), F.col("id").cast("string"), F.lit("@example.com")).alias("email"),
        F.element_at(segments, (F.col("id") % 5 + 1).cast("int")).alias("segment"),
    )


def wait_for_workers(url: str, expected: int, worker: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    last_print = 0.0
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            queued, notified = conn.execute(
                "SELECT (SELECT count(*) FROM dramatiq.messages WHERE queue_name = %s), "
                "(SELECT count(*) FROM notifications)",
                (QUEUE,),
            ).fetchone() or (0, 0)
            if queued == 0 and notified >= expected:
                return True
            if worker.poll() is not None:
                print(f"  workers exited with status {worker.returncode}")
                return False
            if time.monotonic() - last_print > 10:
                print(f"  ... {notified:,} customers notified, {queued:,} messages queued")
                last_print = time.monotonic()
            time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from dramatiq_pg_outbox import upgrade
    from dramatiq_pg_outbox.spark import cluster_session, enqueue_dataframe, local_session
    from dramatiq_pg_outbox.spark_analytics import run as run_analytics
    from dramatiq_pg_outbox.testing import mask_password, postgres_server, scratch_database

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from examples._workers import dramatiq_workers

    print(f"spark pipeline: {args.customers:,} customers, {args.partitions} partitions, "
          f"{args.processes} worker processes x {args.threads} threads, "
          f"Spark {args.master or 'local[*]'}")  # fmt: skip
    problems: list[str] = []
    with postgres_server() as admin_url, scratch_database(admin_url, "spark_pipeline") as url:
        print(f"  database   {mask_password(url)} (dropped at exit)")
        upgrade(url)
        create_tables(url, args.customers)
        os.environ["EXAMPLE_DATABASE_URL"] = url
        from examples.spark_pipeline.tasks import broker, notify_customer

        # On a cluster, cluster_session sets the executors' Python and ships this package to them.
        name = "spark-pipeline-example"
        spark = cluster_session(args.master, name) if args.master else local_session(name)
        batch_id = f"newsletter-{time.strftime('%Y-%m-%d')}"
        log_path = Path(tempfile.gettempdir()) / f"spark_pipeline_workers_{os.getpid()}.log"
        try:
            with dramatiq_workers(
                TASKS_MODULE, args.processes, args.threads, log_path, {"EXAMPLE_DATABASE_URL": url}
            ) as worker:
                customers = read_customers(spark, url, args.partitions, args.customers)
                columns = {"args": ["customer_id", "email", "segment"], "key": "customer_id"}
                first = enqueue_dataframe(customers, notify_customer, batch_id=batch_id, **columns)
                print(f"  enqueue    {first.enqueued:,} messages from {first.rows:,} rows in "
                      f"{first.partitions} partitions, {first.seconds:.1f} s "
                      f"({first.rows_per_second:,.0f} rows/s), batch {batch_id!r}")  # fmt: skip
                started = time.monotonic()
                drained = wait_for_workers(url, args.customers, worker, args.timeout)
                took = time.monotonic() - started
                print(f"  workers    drained in {took:.1f} s after the enqueue")
                if not drained:
                    problems.append(f"the workers did not drain the queue within {args.timeout:.0f} s")
                again = enqueue_dataframe(customers, notify_customer, batch_id=batch_id, **columns)
                print(f"  re-run     same batch id: {again.enqueued:,} enqueued, {again.skipped:,} skipped")
                time.sleep(1.0)
            analytics_started = time.monotonic()
            _, written = run_analytics(url, args.out, spark=spark, bucket_seconds=args.bucket)
            print(f"  analytics  {time.monotonic() - analytics_started:.1f} s -> {args.out}")
            problems += report(url, args.customers, first, again)
        finally:
            spark.stop()
            broker.close()
        print("\nfiles:")
        for name, path in written.items():
            print(f"  {name:<18} {path}")
    if problems:
        print("\nFAILED: " + "\n        ".join(problems))
        print(f"workers' log: {log_path}")
        return 1
    print("\nOK: every customer's message was processed exactly once; re-running the enqueue with the "
          "same batch id added nothing.")  # fmt: skip
    return 0


def report(url: str, customers: int, first: Any, again: Any) -> list[str]:
    problems: list[str] = []
    with psycopg.connect(url) as conn:
        missing, notified, duplicates, min_d, max_d = conn.execute(
            """
            SELECT (SELECT count(*) FROM customers c
                    WHERE NOT EXISTS (SELECT 1 FROM notifications n WHERE n.customer_id = c.customer_id)),
                   count(*), count(*) FILTER (WHERE deliveries > 1), min(deliveries), max(deliveries)
            FROM notifications
            """
        ).fetchone() or (None, 0, None, None, None)
        stats = conn.execute(
            "SELECT sum(deliveries), sum(completed), sum(retried), sum(failed) "
            "FROM dramatiq.message_stats(interval '1 hour')"
        ).fetchone()
        per_message = conn.execute(
            "SELECT count(DISTINCT message_id), "
            "count(*) FILTER (WHERE state = 'completed' AND error_type IS NULL) "
            "FROM dramatiq.history WHERE queue_name = %s",
            (QUEUE,),
        ).fetchone()
        errors = conn.execute("SELECT error_type, total FROM dramatiq.message_errors").fetchall()
        leftover = conn.execute("SELECT count(*) FROM dramatiq.messages").fetchone()
    print("\nreport")
    print(f"  customers                 {customers:,}")
    print(f"  messages enqueued         {first.enqueued:,} (one per customer)")
    print(f"  customers notified        {notified:,}; missing {missing:,}; twice or more {duplicates:,}")
    print(f"  deliveries per customer   min {min_d}, max {max_d}")
    if stats:
        print(f"  history                   {stats[0]:,} deliveries: {stats[1]:,} completed, "
              f"{stats[2]:,} retried, {stats[3]:,} failed")  # fmt: skip
    if per_message:
        print(f"  distinct messages         {per_message[0]:,}, each completed once: {per_message[1]:,}")
    for error_type, total in errors:
        print(f"  error type                {error_type}: {total:,} attempt(s) (retried)")
    print(f"  re-run, same batch id     {again.enqueued:,} added, {again.skipped:,} skipped")
    print(f"  messages left in queue    {leftover[0] if leftover else '?'}")
    if first.enqueued != customers:
        problems.append(f"{first.enqueued} messages enqueued for {customers} customers")
    if missing or notified != customers:
        problems.append(f"{missing} customers were not notified")
    if duplicates or max_d != 1:
        problems.append(f"{duplicates} customers were notified more than once")
    if per_message and (per_message[0] != customers or per_message[1] != customers):
        problems.append(f"history has {per_message[0]} messages, {per_message[1]} completed without error")
    if again.enqueued != 0 or again.skipped != customers:
        problems.append(f"the re-run with the same batch id added {again.enqueued} messages")
    if leftover and leftover[0]:
        problems.append(f"{leftover[0]} messages left in the queue")
    return problems
