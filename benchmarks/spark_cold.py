"""The first write of a Spark session against the later ones, and the connections a write holds (issue 34).

Cold start (``benchmarks/README.md`` section 21)::

    python -m benchmarks.spark_cold URL [--rows 200000] [--partitions 4] [--sessions 3] [--writes 4]

Each session is a fresh driver process (a new JVM, new Python daemons and workers) on
``local[2]`` (``--cores``).  In it the same DataFrame (``spark.range``, cached and counted
before the first write: no Python has run yet) is written ``--writes`` times, the table
truncated between; the first write is compared with the later ones.  Each case runs in
sessions of its own:

- ``dramatiq``: ``format("dramatiq")`` after ``register(spark)``, a new batch id each write;
- ``toy``: a Python data source whose Arrow writer reads its batches and writes nothing, and
  whose ``commit()`` does nothing: Spark's own cost of a Python data source write;
- ``toy+imports``: the same, its ``writer()``, ``write()`` and ``commit()`` importing what
  unpickling ``format("dramatiq")``'s objects imports (``dramatiq_pg_outbox.spark.source``):
  the toy plus this package's imports, no database;
- ``noop``: ``format("noop")``, no Python at all;
- ``jdbc``: a JDBC append into a bare table.

Each write's seconds are split with the JVM's job events (``spark.eventLog``): ``plan``, from
``save()`` to the job's submission (the planner's Python process runs ``writer()``: for
``format("dramatiq")``, the options and the driver's database check), ``tasks`` (the job), and
``commit``, from the job's end to ``save()``'s return (``commit()`` in a Python process:
``format("dramatiq")`` records the write in ``spark_writes``).

Connections (``--connections``)::

    python -m benchmarks.spark_cold URL --connections [--rows 1000000] [--partitions 16] [--cores 4]

One session on ``local[4]``: ``format("dramatiq")`` writes a DataFrame of ``--partitions``
partitions, then the same after ``df.coalesce(2)`` and ``df.coalesce(1)`` (after one unmeasured
write, for warm workers), while a thread counts every ~20 ms the connections of
``pg_stat_activity`` named ``dramatiq-pg-outbox-spark`` (the tasks', the driver's check and the
commit's record): the peak, the write's seconds and the seconds with at least one such
connection open.

``URL``: a database migrated by ``dramatiq-pg-outbox migrate`` (a scratch one: its messages are
truncated).  ``--code before=DIR --code after=DIR`` runs each session on the package of a
checkout (its directory first on ``PYTHONPATH``, which the Python workers inherit, and the
session's working directory), the checkouts alternating; without it, the package that
``PYTHONPATH`` or the installation gives.  ``--warm-workers`` first runs a ``mapInArrow`` that
imports nothing, so that the tasks' Python workers are running before the first write.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

#: The cases of the cold-start measurement, in the order they run.
CASES = ("dramatiq", "toy", "toy+imports", "noop", "jdbc")
#: The bare table of the ``jdbc`` case.
JDBC_TABLE = "cold_customers"
#: What the Spark integration names its connections (``dramatiq_pg_outbox.spark.options.connect``).
APPLICATION_NAME = "dramatiq-pg-outbox-spark"
#: The line of a session's figures on its stdout.
RESULT = "RESULT "
ROOT = Path(__file__).resolve().parent.parent


def execute(url: str, statement: str) -> Any:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement)
        return cur.fetchone()[0] if cur.description else None  # type: ignore[index]


def session(cores: str, events: str | None = None) -> Any:
    """A ``local[cores]`` session as the project builds them (``local_session``), with the job events
    logged to ``events`` when given."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName("spark-cold")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "2g")
    )
    if os.path.isfile("/usr/share/java/postgresql.jar"):
        builder = builder.config("spark.jars", "/usr/share/java/postgresql.jar")
    if events:
        builder = builder.config("spark.eventLog.enabled", "true").config("spark.eventLog.dir", events)
        builder = builder.config("spark.eventLog.compress", "false")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def customers(spark: Any, rows: int, partitions: int) -> Any:
    """The benchmarks' customers (as ``bench_spark.customers``), cached and counted: JVM only."""
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


# -- the toy data source: Spark's own cost of a Python data source write ----------------------
# Defined in the session's __main__ (this module run with -m): Spark pickles the classes by value,
# so the planner's and the tasks' Python processes import nothing of this repository for them.


def toy_classes() -> Any:
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    @dataclass
    class ToyWritten(WriterCommitMessage):
        rows: int

    class ToyWriter(DataSourceArrowWriter):
        def __init__(self, imports: bool) -> None:
            self.imports = imports

        def write(self, iterator: Iterator[Any]) -> ToyWritten:
            if self.imports:
                import dramatiq_pg_outbox.spark.source  # noqa: F401
            return ToyWritten(sum(batch.num_rows for batch in iterator))

        def commit(self, messages: list[Any]) -> None:
            if self.imports:
                import dramatiq_pg_outbox.spark.source  # noqa: F401

    class ToySource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "cold_toy"

        def writer(self, schema: Any, overwrite: bool) -> ToyWriter:
            imports = self.options.get("imports") == "true"
            if imports:
                import dramatiq_pg_outbox.spark.source  # noqa: F401
            return ToyWriter(imports)

    return ToySource


def writer(spark: Any, case: str, url: str) -> tuple[Any, Any]:
    """(a function writing a DataFrame as ``case``, one emptying what it wrote)."""
    if case == "dramatiq":
        from dramatiq_pg_outbox.spark import register

        register(spark)
        batches = iter(range(1_000_000))

        def write(df: Any) -> None:
            batch = f"cold-{time.time_ns()}-{next(batches)}"
            df.write.mode("append").format("dramatiq").option("url", url).option(
                "actor", "notify_customer"
            ).option("queue", "notifications").option("batch", batch).option("key", "customer_id").option(
                "args", "customer_id,email"
            ).option("kwargs", "segment=segment").save()

        return write, lambda: execute(url, "TRUNCATE dramatiq.messages, dramatiq.idempotency_keys")
    if case in ("toy", "toy+imports"):
        spark.dataSource.register(toy_classes())
        imports = "true" if case == "toy+imports" else "false"
        return (
            lambda df: df.write.mode("append").format("cold_toy").option("imports", imports).save(),
            lambda: None,
        )
    if case == "noop":
        return lambda df: df.write.mode("overwrite").format("noop").save(), lambda: None
    if case == "jdbc":
        from dramatiq_pg_outbox.spark import jdbc_options

        columns = "customer_id bigint, email text, segment text"
        execute(url, f"CREATE TABLE IF NOT EXISTS {JDBC_TABLE} ({columns})")
        options = jdbc_options(url)

        def append(df: Any) -> None:
            df.write.format("jdbc").options(**options).option("dbtable", JDBC_TABLE).option(
                "batchsize", "10000"
            ).mode("append").save()

        return append, lambda: execute(url, f"TRUNCATE {JDBC_TABLE}")
    raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def jobs(events: str) -> list[tuple[float, float]]:
    """(submission, completion) epoch seconds of each job of the session's event log."""
    started: dict[int, float] = {}
    done: list[tuple[float, float]] = []
    for path in sorted(p for p in Path(events).rglob("*") if p.is_file() and not p.name.startswith(".")):
        with path.open() as lines:
            for line in lines:
                event = json.loads(line)
                if event["Event"] == "SparkListenerJobStart":
                    started[event["Job ID"]] = event["Submission Time"] / 1000
                elif event["Event"] == "SparkListenerJobEnd" and event["Job ID"] in started:
                    done.append((started[event["Job ID"]], event["Completion Time"] / 1000))
    return sorted(done)


def split(windows: list[tuple[float, float]], events: str) -> list[dict[str, float]]:
    """Each write's seconds as plan, tasks and commit (see the module's documentation)."""
    spans = jobs(events)
    parts: list[dict[str, float]] = []
    for began, ended in windows:
        inside = [j for j in spans if began <= j[0] <= ended]
        if not inside:
            parts.append({})
            continue
        first, last = inside[0][0], max(j[1] for j in inside)
        parts.append({"plan": first - began, "tasks": last - first, "commit": ended - last})
    return parts


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user and system, with their reaped children's) of this process's descendants,
    by kind: ``jvm`` (the driver's JVM) and ``python`` (Spark's Python daemons, planners and
    workers); empty where ``/proc`` is not there.  Under a load that comes and goes, a write's CPU
    time varies less than its seconds."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents: dict[int, int] = {}
    used: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (name, sum(int(f) for f in fields[11:15]) / tick)
    totals = {"jvm": 0.0, "python": 0.0}
    for pid, (name, seconds) in used.items():
        ancestor = parents.get(pid)
        while ancestor and ancestor != os.getpid():
            ancestor = parents.get(ancestor)
        if ancestor:
            totals["jvm" if name == "java" else "python"] += seconds
    return totals


def _count(batches: Iterator[Any]) -> Iterator[Any]:
    """A task that starts a Python worker, imports only pyarrow and counts its rows."""
    import pyarrow as pa

    yield pa.RecordBatch.from_pydict({"rows": [sum(batch.num_rows for batch in batches)]})


def cold_session(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh session of ``args.child``: the seconds of each write, and their parts."""
    events = tempfile.mkdtemp(prefix="spark-cold-events-")
    started = time.perf_counter()
    spark = session(args.cores, events)
    figures: dict[str, Any] = {"case": args.child, "session_s": time.perf_counter() - started}
    try:
        df = customers(spark, args.rows, args.partitions)
        if args.warm_workers:
            started = time.perf_counter()
            df.mapInArrow(_count, "rows long").collect()
            figures["warm_s"] = time.perf_counter() - started
        began = time.perf_counter()
        write, empty = writer(spark, args.child, args.url)
        figures["register_s"] = time.perf_counter() - began
        windows, seconds, cpu = [], [], []
        for _ in range(args.writes):
            empty()
            before = cpu_seconds()
            began = time.time()
            write(df)
            windows.append((began, time.time()))
            after = cpu_seconds()
            seconds.append(windows[-1][1] - began)
            cpu.append({kind: after[kind] - before[kind] for kind in after})
        empty()
        figures["seconds"] = seconds
        figures["cpu"] = cpu
        if args.child != "noop":
            # Which copy of the package the Python workers run (after the writes: not a warm-up).
            def where(batches: Iterator[Any]) -> Iterator[Any]:
                import pyarrow as pa

                import dramatiq_pg_outbox

                yield pa.RecordBatch.from_pydict({"path": [dramatiq_pg_outbox.__file__]})

            figures["worker_package"] = df.limit(1).mapInArrow(where, "path string").first()["path"]
    finally:
        spark.stop()
    figures["parts"] = split(windows, events)
    shutil.rmtree(events, ignore_errors=True)
    return figures


# -- the connections of a write ------------------------------------------------------------------


class Sampler:
    """Reads the connections named ``APPLICATION_NAME`` every ``period`` seconds, in a thread:
    ``samples`` holds (when, [(backend pid, seconds since its connection began)])."""

    def __init__(self, url: str, period: float = 0.02) -> None:
        self.url, self.period = url, period
        self.samples: list[tuple[float, list[tuple[int, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True, application_name="spark-cold-sampler") as conn:
            while not self._stop.is_set():
                at = time.perf_counter()
                rows = conn.execute(
                    "SELECT pid, extract(epoch FROM clock_timestamp() - backend_start)::float8 "
                    "FROM pg_stat_activity WHERE application_name = %s",
                    (APPLICATION_NAME,),
                ).fetchall()
                self.samples.append((at, [(int(pid), float(age)) for pid, age in rows]))
                self._stop.wait(max(0.0, self.period - (time.perf_counter() - at)))


#: A connection open longer than this is a task's (the driver's check and record take milliseconds).
HELD = 0.5


def connections(args: argparse.Namespace) -> dict[str, Any]:
    """Peak connections and seconds of format("dramatiq") writes, as is and coalesced."""
    from pyspark.sql import DataFrame

    spark = session(args.cores)
    figures: dict[str, Any] = {"cores": spark.sparkContext.defaultParallelism, "cases": []}
    try:
        df: DataFrame = customers(spark, args.rows, args.partitions)
        write, empty = writer(spark, "dramatiq", args.url)
        empty()
        write(customers(spark, 20_000, args.partitions))  # unmeasured: warm workers
        for _ in range(args.repeat):
            for n in (None, 2, 1):
                frame = df if n is None else df.coalesce(n)
                empty()
                with Sampler(args.url) as sampler:
                    time.sleep(0.1)
                    began = time.perf_counter()
                    write(frame)
                    ended = time.perf_counter()
                    time.sleep(0.2)
                samples = sampler.samples
                seen = [at for at, rows in samples if rows]
                period = (samples[-1][0] - samples[0][0]) / max(1, len(samples) - 1)
                case = {
                    "write": f"{args.partitions} partitions" if n is None else f"coalesce({n})",
                    "tasks": frame.rdd.getNumPartitions(),
                    "peak": max((len(rows) for _, rows in samples), default=0),
                    "peak_held": max((sum(age > HELD for _, age in rows) for _, rows in samples), default=0),
                    "opened": len({pid for _, rows in samples for pid, _ in rows}),
                    "seconds": ended - began,
                    "open_s": (seen[-1] - seen[0]) if seen else 0.0,
                    "connection_s": sum(len(rows) for _, rows in samples) * period,
                    "samples": len(samples),
                    "period_ms": period * 1000,
                }
                figures["cases"].append(case)
                print(
                    f"  {case['write']:>14}: {case['tasks']:>2} tasks, peak {case['peak']} connections "
                    f"({case['peak_held']} open over {HELD} s), {case['opened']} seen in all, "
                    f"{case['seconds']:.2f} s, a connection open {case['open_s']:.2f} s, "
                    f"{case['connection_s']:.1f} connection-seconds ({case['samples']} samples, "
                    f"every {case['period_ms']:.0f} ms)",
                    flush=True,
                )
        empty()
    finally:
        spark.stop()
    return figures


# -- the parent: one process per session --------------------------------------------------------


def run_session(args: argparse.Namespace, case: str, label: str, code: Path) -> dict[str, Any]:
    """One session of ``case`` in a process of its own, on the package of the checkout ``code``."""
    command = [sys.executable, str(Path(__file__).resolve()), args.url, "--child", case]
    command += ["--rows", str(args.rows), "--partitions", str(args.partitions)]
    command += ["--writes", str(args.writes), "--cores", args.cores]
    command += ["--warm-workers"] if args.warm_workers else []
    env = dict(os.environ)
    if label:  # the checkout first, for the driver and (inherited) the Python workers
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"the {case} session failed (exit {done.returncode})")
    figures: dict[str, Any] = json.loads(lines[-1][len(RESULT) :])
    figures["label"] = label
    return figures


def describe(figures: dict[str, Any]) -> str:
    first, *later = figures["seconds"]
    parts = figures["parts"]

    def part(p: dict[str, float]) -> str:
        return f"plan {p['plan']:.2f} + tasks {p['tasks']:.2f} + commit {p['commit']:.2f}" if p else "?"

    later_parts = [p for p in parts[1:] if p]
    keys = ("plan", "tasks", "commit")
    mean_later = {k: statistics.mean(p[k] for p in later_parts) for k in keys} if later_parts else {}
    cpu = [c["python"] for c in figures["cpu"]]
    return (
        f"first {first:.2f} s ({part(parts[0])}), later {', '.join(f'{s:.2f}' for s in later)} s "
        f"(mean {part(mean_later)}); Python CPU {cpu[0]:.2f} s then "
        f"{', '.join(f'{c:.2f}' for c in cpu[1:])} s; session {figures['session_s']:.1f} s, "
        f"register {figures['register_s']:.2f} s"
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per checkout and case: the median first write, the median later one, their difference, and
    the medians of their parts."""
    rows = []
    for label, case in dict.fromkeys((r["label"], r["case"]) for r in results):
        mine = [r for r in results if (r["label"], r["case"]) == (label, case)]
        firsts = [r["seconds"][0] for r in mine]
        laters = [s for r in mine for s in r["seconds"][1:]]
        row: dict[str, Any] = {
            "code": label,
            "case": case,
            "sessions": len(mine),
            "first_s": median(firsts),
            "first_range": (min(firsts), max(firsts)),
            "later_s": median(laters),
            "extra_s": median(firsts) - median(laters),
        }
        for kind in ("python", "jvm"):
            row[f"first_{kind}_cpu_s"] = median([r["cpu"][0][kind] for r in mine])
            row[f"later_{kind}_cpu_s"] = median([c[kind] for r in mine for c in r["cpu"][1:]])
        for part in ("plan", "tasks", "commit"):
            row[f"first_{part}_s"] = median([r["parts"][0].get(part, float("nan")) for r in mine])
            row[f"later_{part}_s"] = median([p.get(part, float("nan")) for r in mine for p in r["parts"][1:]])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url", help="a migrated scratch database (its messages are truncated)")
    parser.add_argument("--rows", type=int, help="rows written (200,000; 1,000,000 with --connections)")
    parser.add_argument("--partitions", type=int, help="of the DataFrame (4; 16 with --connections)")
    parser.add_argument("--sessions", type=int, default=3, help="fresh sessions per case")
    parser.add_argument("--writes", type=int, default=4, help="writes per session, the first one cold")
    parser.add_argument("--cores", help="local[CORES] (default 2; 4 with --connections)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument(
        "--code", action="append", default=[], metavar="LABEL=DIR",
        help="run the sessions on the package of the checkout DIR (repeat it: the checkouts alternate)",
    )  # fmt: skip
    parser.add_argument(
        "--warm-workers", action="store_true",
        help="before the first write, start the Python workers with a mapInArrow that imports nothing",
    )  # fmt: skip
    parser.add_argument("--connections", action="store_true", help="measure the connections of a write")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the connections measurement")
    parser.add_argument("--json", type=Path, help="also write the figures there")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rows = args.rows or (1_000_000 if args.connections else 200_000)
    args.partitions = args.partitions or (16 if args.connections else 4)
    args.cores = args.cores or ("4" if args.connections else "2")
    if args.child:
        print(RESULT + json.dumps(cold_session(args)), flush=True)
        return 0
    if args.connections:
        print(f'connections: format("dramatiq") of {args.rows:,} rows on local[{args.cores}]', flush=True)
        figures: Any = connections(args)
    else:
        cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        codes = [(label, Path(d).resolve()) for label, _, d in (c.partition("=") for c in args.code)]
        print(
            f"cold start: {args.rows:,} rows, {args.partitions} partitions, local[{args.cores}], "
            f"{args.writes} writes per session, {args.sessions} sessions per case"
            + (", Python workers started first" if args.warm_workers else ""),
            flush=True,
        )
        results = []
        for i in range(args.sessions):
            # Interleaved: a load that comes and goes touches every case and checkout alike.
            for case in cases:
                for label, code in codes or [("", ROOT)]:
                    results.append(run_session(args, case, label, code))
                    print(f"  session {i + 1} {label:>6} {case:>11}: {describe(results[-1])}", flush=True)
        places = sorted({r.get("worker_package", "") for r in results} - {""})
        print(f"  the Python workers ran {places}", flush=True)
        figures = {"sessions": results, "summary": summary(results)}
        print(
            "code   case         first: median (range)   later   extra    plan first/later  "
            "tasks first/later  commit first/later  Python CPU first/later  JVM CPU first/later"
        )
        for row in figures["summary"]:
            lo, hi = row["first_range"]
            print(
                f"{row['code']:<6} {row['case']:<12} {row['first_s']:5.2f} s ({lo:5.2f}-{hi:5.2f})  "
                f"{row['later_s']:5.2f} s {row['extra_s']:+5.2f} s  "
                + "  ".join(
                    f"{row[f'first_{p}_s']:6.2f}/{row[f'later_{p}_s']:.2f} s"
                    for p in ("plan", "tasks", "commit")
                )
                + "".join(
                    f"  {row[f'first_{k}_cpu_s']:10.2f}/{row[f'later_{k}_cpu_s']:.2f} s"
                    for k in ("python", "jvm")
                )
            )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
