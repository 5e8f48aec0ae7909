"""Message history -> insight, with PySpark.

Command::

    python -m dramatiq_pg_outbox.spark_analytics --url postgresql://app@db/app --out report/
        [--schema dramatiq] [--bucket 60] [--since 2026-11-01T00:00:00Z] [--master local[*]]

reads the history table (finished deliveries) and the live messages table
(backlog) into DataFrames and writes, to ``--out``:

==================  ==========================================================
``stats``           per actor and time bucket (of ``finished_at``): deliveries,
                    completed, retried (the actor raised and Retries enqueued a
                    retry: a completed history row with ``error_type``), failed
                    (dead-lettered), throughput (deliveries/s), failure and retry
                    rates, latency percentiles p50/p90/p99 in milliseconds of
                    enqueue -> start (``wait``, which includes any delay, such as
                    a retry's backoff) and start -> finish (``run``, up to the
                    batched acknowledgement)
``attempts``        per actor: how many messages needed n deliveries (retries and
                    redeliveries after a crash both count)
``errors``          per actor: the most frequent error types (retried and failed)
``backlog``         per queue and actor: pending (due), delayed, processing,
                    age of the oldest due message
==================  ==========================================================

each as Parquet (``parquet/<name>/``, written by Spark, so ``--out`` may be a
cluster path) and as CSV (``<name>.csv``), plus ``throughput.png`` and
``latency.png``.  The same aggregates exist as SQL (migration 0003:
``message_stats(bucket)``, ``message_attempts``, ``message_errors``,
``queue_backlog``); they answer faster on a small history, Spark is for a
history too large for one query.

Reading: history through ``format("dramatiq_history")``
(:mod:`dramatiq_pg_outbox.spark.history`), one Spark partition per UTC day;
the backlog in id ranges (``--partitions``); one connection per running task,
with psycopg, so no JDBC driver is needed.  Times are read as epoch
milliseconds (no time-zone conversions).
Percentiles are ``percentile_approx`` (the SQL functions compute exact ones).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .names import DEFAULT_SCHEMA, validate_schema_name
from .store.spark import IdRange, SparkStore
from .urls import libpq_url

__all__ = ["Analytics", "compute", "main", "read_backlog", "read_history", "write_report"]

_BACKLOG_COLUMNS = "queue_name string, actor_name string, state string, due boolean, age_ms long"


@dataclass
class Analytics:
    """The result DataFrames of :func:`compute`."""

    stats: Any
    attempts: Any
    errors: Any
    backlog: Any

    def tables(self) -> dict[str, Any]:
        return {
            "stats": self.stats,
            "attempts": self.attempts,
            "errors": self.errors,
            "backlog": self.backlog,
        }


def _read_backlog_ranges(
    spark: Any, conninfo: str, store: SparkStore, columns: str, bounds: IdRange | None, partitions: int
) -> Any:
    """A DataFrame of the live messages of ids in ``bounds`` (``backlog_rows``) read by the executors."""
    if bounds is None:
        return spark.createDataFrame([], columns)
    lo, hi = bounds.lo, bounds.hi
    partitions = max(1, min(partitions, hi - lo + 1))
    step = math.ceil((hi - lo + 1) / partitions)
    ranges = [(lo + i * step, min(lo + (i + 1) * step, hi + 1)) for i in range(partitions)]
    arrow_schema = _arrow_schema(columns)

    def read(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from ._isolation import connect

        with connect(conninfo, application_name="dramatiq-pg-outbox-analytics") as conn:
            for batch in batches:
                for start, stop in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist(), strict=True):
                    with conn.cursor(name="dpo_analytics") as cur:
                        cur.itersize = 50_000
                        store.backlog_rows(cur, lo=start, hi=stop)
                        while rows := cur.fetchmany(50_000):
                            columns = zip(*rows, strict=True)
                            arrays = [
                                pa.array(col, type=f.type)
                                for col, f in zip(columns, arrow_schema, strict=True)
                            ]
                            yield pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)

    frame = spark.createDataFrame(ranges, "lo long, hi long").repartition(len(ranges))
    return frame.mapInArrow(read, columns)


def _arrow_schema(ddl: str) -> Any:
    """The pyarrow schema of a flat ``"name type, ..."`` DDL string (long, int, string, boolean)."""
    import pyarrow as pa

    kinds = {"long": pa.int64(), "int": pa.int32(), "string": pa.string(), "boolean": pa.bool_()}
    fields = [part.split() for part in ddl.split(",")]
    return pa.schema([(name, kinds[kind]) for name, kind in fields])


def _bounds(conninfo: str, store: SparkStore) -> IdRange | None:
    from ._isolation import connect

    with connect(conninfo) as conn:
        return store.backlog_id_range(conn)


def read_history(
    spark: Any, url: str, *, schema: str = DEFAULT_SCHEMA, since: str | None = None, partitions: int = 8
) -> Any:
    """The history table as a DataFrame (no payloads, no error texts), times in epoch ms.

    Read by ``format("dramatiq_history")`` (:mod:`dramatiq_pg_outbox.spark.history`): one Spark
    partition per UTC day, from ``since`` (an ISO date or time, or epoch ms) on.  ``partitions``
    is not used (the days decide); it stays for callers that pass it.
    """
    from .spark.history import register

    register(spark)
    reader = spark.read.format("dramatiq_history").option("url", url).option("schema", schema)
    if since is not None:
        reader = reader.option("since", since)
    return reader.load()


def read_backlog(spark: Any, url: str, *, schema: str = DEFAULT_SCHEMA, partitions: int = 2) -> Any:
    """The live messages table as a DataFrame: queue, actor, state, due, age of due rows in ms."""
    conninfo = libpq_url(url)
    store = SparkStore(validate_schema_name(schema))
    bounds = _bounds(conninfo, store)
    return _read_backlog_ranges(spark, conninfo, store, _BACKLOG_COLUMNS, bounds, partitions)


def compute(history: Any, backlog: Any, *, bucket_seconds: int = 60, top_errors: int = 5) -> Analytics:
    """Aggregate a history DataFrame (see :func:`read_history`) and a backlog one."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if bucket_seconds < 1:
        raise ValueError(f"bucket_seconds must be at least 1, not {bucket_seconds!r}")
    b = int(bucket_seconds)
    retried = (F.col("state") == "completed") & F.col("error_type").isNotNull()
    wait_ms = F.col("started_ms") - F.col("enqueued_ms")
    run_ms = F.col("finished_ms") - F.col("started_ms")
    stats = (
        history.withColumn(
            "bucket_start", F.timestamp_seconds(F.floor(F.col("finished_ms") / (1000 * b)) * b)
        )
        .groupBy("actor_name", "bucket_start")
        .agg(
            F.count(F.lit(1)).alias("deliveries"),
            F.count(F.when((F.col("state") == "completed") & F.col("error_type").isNull(), 1)).alias(
                "completed"
            ),
            F.count(F.when(retried, 1)).alias("retried"),
            F.count(F.when(F.col("state") == "failed", 1)).alias("failed"),
            F.percentile_approx(wait_ms, [0.5, 0.9, 0.99]).alias("wait"),
            F.percentile_approx(run_ms, [0.5, 0.9, 0.99]).alias("run"),
        )
        .select(
            "actor_name",
            "bucket_start",
            "deliveries",
            "completed",
            "retried",
            "failed",
            (F.col("deliveries") / F.lit(float(b))).alias("throughput_per_s"),
            (F.col("failed") / F.col("deliveries")).alias("failure_rate"),
            (F.col("retried") / F.col("deliveries")).alias("retry_rate"),
            *[
                F.col(kind)[i].alias(f"{kind}_p{p}_ms")
                for kind in ("wait", "run")
                for i, p in enumerate((50, 90, 99))
            ],
        )
        .orderBy("actor_name", "bucket_start")
    )
    attempts = (
        history.groupBy("actor_name", "message_id")
        .agg(F.sum("attempts").alias("attempts"))
        .groupBy("actor_name", "attempts")
        .agg(F.count(F.lit(1)).alias("messages"))
        .orderBy("actor_name", "attempts")
    )
    rank = Window.partitionBy("actor_name").orderBy(F.desc("total"), F.asc("error_type"))
    errors = (
        history.where(F.col("error_type").isNotNull())
        .groupBy("actor_name", "error_type")
        .agg(
            F.count(F.when(F.col("state") == "completed", 1)).alias("retried"),
            F.count(F.when(F.col("state") == "failed", 1)).alias("failed"),
            F.count(F.lit(1)).alias("total"),
        )
        .withColumn("rank", F.row_number().over(rank))
        .where(F.col("rank") <= top_errors)
        .orderBy("actor_name", "rank")
    )
    due = (F.col("state") == "pending") & F.col("due")
    backlog_table = (
        backlog.groupBy("queue_name", "actor_name")
        .agg(
            F.count(F.when(due, 1)).alias("pending"),
            F.count(F.when((F.col("state") == "pending") & ~F.col("due"), 1)).alias("delayed"),
            F.count(F.when(F.col("state") == "processing", 1)).alias("processing"),
            F.coalesce(F.max(F.when(due, F.col("age_ms"))) / 1000.0, F.lit(0.0)).alias("oldest_due_age_s"),
        )
        .orderBy("queue_name", "actor_name")
    )
    return Analytics(stats=stats, attempts=attempts, errors=errors, backlog=backlog_table)


def write_report(analytics: Analytics, out: str | Path, *, charts: bool = True) -> dict[str, Path]:
    """Write Parquet (by Spark), CSV and PNG charts (on the driver) into ``out``; return the file paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    frames: dict[str, Any] = {}
    for name, frame in analytics.tables().items():
        frame.write.mode("overwrite").parquet(str(out / "parquet" / name))
        written[f"{name}.parquet"] = out / "parquet" / name
        # The aggregates are small: one row per actor and bucket at most.
        pdf = frame.toPandas()
        pdf.to_csv(out / f"{name}.csv", index=False)
        written[f"{name}.csv"] = out / f"{name}.csv"
        frames[name] = pdf
    if charts:
        written.update(_charts(frames["stats"], out))
    return written


def _charts(stats: Any, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    actors = list(stats.groupby("actor_name")["deliveries"].sum().sort_values(ascending=False).index[:6])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for actor in actors:
        rows = stats[stats["actor_name"] == actor]
        ax.plot(rows["bucket_start"], rows["throughput_per_s"], marker=".", label=actor)
    ax.set_title("Throughput (deliveries per second, by finish time)")
    ax.set_ylabel("messages / s")
    ax.grid(alpha=0.3)
    if actors:
        ax.legend()
    fig.autofmt_xdate()
    fig.tight_layout()
    paths["throughput.png"] = out / "throughput.png"
    fig.savefig(paths["throughput.png"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for ax, kind, title in ((axes[0], "wait", "enqueue -> start"), (axes[1], "run", "start -> finish")):
        for actor in actors:
            rows = stats[stats["actor_name"] == actor]
            for p, style in ((50, "-"), (90, "--"), (99, ":")):
                ax.plot(
                    rows["bucket_start"], rows[f"{kind}_p{p}_ms"], style, marker=".", label=f"{actor} p{p}"
                )
        ax.set_title(f"Latency {title}")
        ax.set_ylabel("ms")
        ax.set_yscale("symlog")
        ax.grid(alpha=0.3)
    if actors:
        axes[1].legend(fontsize=7)
    fig.autofmt_xdate()
    fig.tight_layout()
    paths["latency.png"] = out / "latency.png"
    fig.savefig(paths["latency.png"], dpi=110)
    plt.close(fig)
    return paths


def run(
    url: str,
    out: str | Path,
    *,
    schema: str = DEFAULT_SCHEMA,
    bucket_seconds: int = 60,
    since: str | None = None,
    partitions: int | None = None,
    top_errors: int = 5,
    spark: Any = None,
) -> tuple[Analytics, dict[str, Path]]:
    """Read, aggregate and write the report (a local session is created when ``spark`` is None)."""
    from .spark import local_session

    session = spark if spark is not None else local_session("dramatiq-pg-outbox-analytics")
    parts = partitions or max(2, session.sparkContext.defaultParallelism * 2)
    history = read_history(session, url, schema=schema, since=since, partitions=parts).cache()
    backlog = read_backlog(session, url, schema=schema)
    analytics = compute(history, backlog, bucket_seconds=bucket_seconds, top_errors=top_errors)
    written = write_report(analytics, out)
    history.unpersist()
    return analytics, written


def _summary(out: Path) -> str:
    import pandas as pd

    stats = pd.read_csv(out / "stats.csv")
    if stats.empty:
        return "no finished messages in history"
    totals = stats.groupby("actor_name")[["deliveries", "completed", "retried", "failed"]].sum()
    lines = [totals.to_string()]
    errors = pd.read_csv(out / "errors.csv")
    if not errors.empty:
        lines += ["", "top error types:", errors.to_string(index=False)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dramatiq_pg_outbox.spark_analytics",
        description="Aggregate dramatiq-pg-outbox message history with PySpark.",
    )
    parser.add_argument("--url", default=os.environ.get("DATABASE_URL"), help="database URL ($DATABASE_URL)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--schema", default=DEFAULT_SCHEMA)
    parser.add_argument("--bucket", type=int, default=60, help="bucket width in seconds (default 60)")
    parser.add_argument("--since", help="only history finished at or after this time (ISO 8601)")
    parser.add_argument("--partitions", type=int, help="backlog id ranges read in parallel (connections)")
    parser.add_argument("--top-errors", type=int, default=5)
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("--url or $DATABASE_URL is required")
    try:
        _, written = run(
            args.url,
            args.out,
            schema=args.schema,
            bucket_seconds=args.bucket,
            since=args.since,
            partitions=args.partitions,
            top_errors=args.top_errors,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_summary(Path(args.out)))
    print()
    for name, path in written.items():
        print(f"{name:<20} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
