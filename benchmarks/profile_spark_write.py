"""Where the time of one ``format("dramatiq")`` task goes, without Spark around it.

    python -m benchmarks.profile_spark_write [--rows 250000] [--runs 3]

One executor task of the data source (and of ``enqueue_dataframe``) gets Arrow batches and
writes them in one transaction (``spark/write.py``'s ``write_arrow_partition``).  This runs the
same code on one partition of ``--rows`` customer rows (customer_id, email, segment: the
``spark`` scenario's), in this process, adding one step at a time, each timed (best of
``--runs``; 4, 4b and 7 take turns in each round):

1. every batch encoded column at a time: uuid5 id, idempotency key, JSON payload
   (``encode_batch``);
2. ... and written as CSV by Arrow;
3. ... and COPY'd into the staging table (transaction rolled back);
4. the whole task (``write_arrow_partition``) on new keys, committed (table truncated first):
   the direct write of a partition that fits in memory (every key claimed by a COPY into
   ``idempotency_keys``, looked up in history, the messages COPYed into the table, NOTIFY);
4b. the same task through the staging table (``DIRECT_BYTES`` 0: the path of a larger
   partition, or of one with keys taken already): 3, then the known keys dropped, the INSERT
   into the messages table claiming the keys, the NOTIFY, committed;
5. for scale: the same Arrow batches appended to a bare table by COPY (what a JDBC append does
   with the customer rows, minus JDBC's batched INSERTs);
6. for scale: the row-by-row encoder of custom encoders (``encode_rows``), alone;
7. the floor (issue 34): the same message rows COPYed straight into the messages table, no
   key claimed or checked, no NOTIFY (``bench_spark.floor_writer``, the Spark benchmark's
   floor row), committed (table truncated first).

The database: ``$DATABASE_URL``, else the local server, else a throwaway one (a scratch
database either way).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import dramatiq
import psycopg
from pyarrow import csv

from benchmarks.bench_spark import floor_writer
from dramatiq_pg_outbox import upgrade
from dramatiq_pg_outbox._queries import queries_for_schema
from dramatiq_pg_outbox.spark import Plan, write_arrow_partition
from dramatiq_pg_outbox.spark import write as spark_write
from dramatiq_pg_outbox.spark.encoding import arrow_rows, encode_batch, encode_rows
from dramatiq_pg_outbox.testing import postgres_server, scratch_database
from dramatiq_pg_outbox.urls import libpq_url


def batches(rows: int, size: int = 10_000) -> list[Any]:
    import pyarrow as pa

    out = []
    for start in range(0, rows, size):
        ids = list(range(start, min(rows, start + size)))
        out.append(
            pa.RecordBatch.from_pydict(
                {
                    "customer_id": pa.array(ids, pa.int64()),
                    "email": [f"customer{i}@example.com" for i in ids],
                    "segment": ["gold" if i % 10 == 0 else "basic" for i in ids],
                }
            )
        )
    return out


def best(runs: int, step: Callable[[], Any], before: Callable[[], Any] = lambda: None) -> float:
    times = []
    for _ in range(runs):
        before()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return min(times)


def best_interleaved(
    runs: int, steps: dict[str, Callable[[], Any]], before: Callable[[], Any]
) -> dict[str, float]:
    """The best time of each step, the steps taking turns in each of ``runs`` rounds (a shared
    machine's load then weighs on each alike)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, step in steps.items():
            before()
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: min(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    data = batches(args.rows)
    no_header = csv.WriteOptions(include_header=False)
    with postgres_server() as admin_url, scratch_database(admin_url, "profile_spark") as url:
        upgrade(url)
        plan = Plan.build(
            key="customer_id", args=["customer_id", "email"], kwargs={"segment": "segment"},
            conninfo=libpq_url(url),
            schema="dramatiq", channel="dramatiq_pg_outbox.dramatiq", queue_name="notifications",
            actor_name="notify_customer", batch_id="profile", options={}, delay_ms=0, notify=True,
            encoder=dramatiq.get_encoder(),
        )  # fmt: skip
        queries = queries_for_schema("dramatiq")

        def encode() -> None:
            for batch in data:
                encode_batch(plan, batch, 0)

        def encode_csv() -> None:
            for batch in data:
                csv.write_csv(encode_batch(plan, batch, 0), io.BytesIO(), no_header)

        def copy_only() -> None:
            with psycopg.connect(plan.conninfo) as conn, conn.cursor() as cur:
                cur.execute(queries["spark_stage"])
                with cur.copy(queries["spark_copy_text"]) as copy:
                    for batch in data:
                        buffer = io.BytesIO()
                        csv.write_csv(encode_batch(plan, batch, 0), buffer, no_header)
                        copy.write(buffer.getvalue())
                conn.rollback()

        def row_by_row() -> None:
            for _ in encode_rows(plan, arrow_rows(data), 0):
                pass

        def truncate() -> None:
            with psycopg.connect(plan.conninfo, autocommit=True) as conn:
                conn.execute("TRUNCATE dramatiq.messages, dramatiq.idempotency_keys")
                conn.execute("VACUUM ANALYZE dramatiq.messages")

        def whole() -> None:
            assert write_arrow_partition(plan, data) == (args.rows, args.rows, 0)

        def staged() -> None:
            limit, spark_write.DIRECT_BYTES = spark_write.DIRECT_BYTES, 0
            try:
                whole()
            finally:
                spark_write.DIRECT_BYTES = limit

        def floor() -> None:
            assert floor_writer(plan)(data) == args.rows

        def plain_copy() -> None:
            with psycopg.connect(plan.conninfo) as conn, conn.cursor() as cur:
                cur.execute("CREATE TEMP TABLE plain (customer_id bigint, email text, segment text)")
                with cur.copy("COPY plain FROM STDIN (FORMAT BINARY)") as copy:
                    copy.set_types(["int8", "text", "text"])
                    for row in arrow_rows(data):
                        copy.write_row(row)
                conn.commit()

        committed = {
            "4 whole task, direct": whole,
            "4b whole task, staged": staged,
            "7 floor: COPY into messages": floor,
        }
        steps = {
            "1 encode (Arrow)": best(args.runs, encode),
            "2 + CSV": best(args.runs, encode_csv),
            "3 + COPY to staging": best(args.runs, copy_only),
            **best_interleaved(args.runs, committed, truncate),
            "5 bare-table COPY of the rows": best(args.runs, plain_copy),
            "6 row-by-row encode (alone)": best(args.runs, row_by_row),
        }
    print(f"\none task of {args.rows:,} rows, best of {args.runs}")
    print(f"{'step':<36}{'seconds':>9}{'us/row':>9}{'share of 4':>12}{'vs floor':>10}")
    for name, seconds in steps.items():
        share = seconds / steps["4 whole task, direct"]
        floor_ratio = seconds / steps["7 floor: COPY into messages"]
        print(f"{name:<36}{seconds:>9.2f}{seconds / args.rows * 1e6:>9.1f}{share:>12.0%}{floor_ratio:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
