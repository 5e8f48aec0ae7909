"""Rate-limiter backends: acquisitions per second of Dramatiq's concurrent and window limiters.

``python -m benchmarks.run --scenarios rate_limits`` (issue 19).  Backends, measured
in the same run, in interleaved rounds:

- ``ours`` (``rate_limits.PostgresBackend``, logged tables, as migrated);
- ``ours, UNLOGGED`` (the same after ``ALTER TABLE ... SET UNLOGGED``: what a crash-unsafe
  table would gain);
- Dramatiq's ``RedisBackend`` (Redis on 127.0.0.1:6379);
- iddqueue 0.13's ``PostgresRateLimiterBackend`` (a transaction with advisory locks per
  operation), when installed.

Three cases, 8 threads in one process each: ``free`` (limit 8: every acquisition succeeds;
one acquisition is an ``incr`` and a ``decr``), ``contended`` (limit 1: threads
compete, ``raise_on_failure=False``; admitted acquisitions per second), and ``window``
(a ``WindowRateLimiter`` of 60 one-second buckets whose limit is never reached: one
acquisition is an ``incr_and_sum`` over the window).  Every
PostgreSQL backend gets a database of its own on the benchmark's durable server
(fsync and synchronous_commit on).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dramatiq.rate_limits import ConcurrentRateLimiter, WindowRateLimiter

from .bench_common import Context, Series, db_name, drop_database, fmt_rate, markdown_table, recreate_database

#: Seconds each case runs per backend and round.
SECONDS = 3.0
THREADS = 8
CASES = (("free", THREADS), ("contended", 1), ("window", 10**9))


def _backends(ctx: Context) -> dict[str, Any]:
    """name -> backend, each on its own database (Redis flushed)."""
    from dramatiq_pg_outbox import PostgresBroker, upgrade
    from dramatiq_pg_outbox.rate_limits import PostgresBackend

    found: dict[str, Any] = {}
    for name, unlogged in (("ours", False), ("ours, UNLOGGED", True)):
        database = db_name(name, "rate_limits")
        recreate_database(ctx.admin_url, database)
        url = ctx.db_url(database)
        upgrade(url)
        broker = PostgresBroker(url=url, pool_size=THREADS)
        if unlogged:
            import psycopg

            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("ALTER TABLE dramatiq.rate_limits SET UNLOGGED")
        found[name] = PostgresBackend(broker=broker, cleanup_interval=None)
    try:
        import redis
        from dramatiq.rate_limits.backends import RedisBackend

        client = redis.Redis()
        client.flushdb()
        found["Dramatiq RedisBackend"] = RedisBackend(client=client)
    except Exception as e:  # Redis absent: say so in the table
        print(f"  rate_limits: RedisBackend skipped ({e!r})", flush=True)
    try:
        import psycopg
        from iddqueue.rate_limits import PostgresRateLimiterBackend
        from iddqueue.schema import generate_coordination_sql

        database = db_name("iddqueue", "rate_limits")
        recreate_database(ctx.admin_url, database)
        url = ctx.db_url(database)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(generate_coordination_sql())
        found["iddqueue 0.13"] = PostgresRateLimiterBackend(url=url)
    except Exception as e:  # iddqueue absent (pip install iddqueue tenacity)
        print(f"  rate_limits: iddqueue skipped ({e!r})", flush=True)
    return found


def acquisitions_per_second(
    backend: Any, key: str, limit: int, seconds: float = SECONDS
) -> tuple[float, float, float]:
    """(admitted acquisitions/s, attempts/s, client CPU us per attempt) of THREADS threads
    for ``seconds`` on one limiter (the CPU: ``time.process_time`` of this process, every
    thread, less sensitive than the rates to a durable COMMIT's wait for the disk).

    The limiter is a ``ConcurrentRateLimiter``, or, for a ``key`` of the ``window`` case, a
    ``WindowRateLimiter`` of 60 s.
    """
    limiter: Any = (
        WindowRateLimiter(backend, key, limit=limit, window=60)
        if key.startswith("bench-window")
        else ConcurrentRateLimiter(backend, key, limit=limit, ttl=60_000)
    )
    stop = time.monotonic() + seconds
    counts = [[0, 0] for _ in range(THREADS)]

    def work(slot: list[int]) -> None:
        while time.monotonic() < stop:
            with limiter.acquire(raise_on_failure=False) as acquired:
                slot[0] += bool(acquired)
                slot[1] += 1

    threads = [threading.Thread(target=work, args=(slot,)) for slot in counts]
    started, cpu = time.monotonic(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    attempts = sum(c[1] for c in counts)
    return sum(c[0] for c in counts) / elapsed, attempts / elapsed, 1e6 * cpu / max(attempts, 1)


def run(ctx: Context) -> dict[str, Any]:
    backends = _backends(ctx)
    seconds = 0.5 if ctx.smoke else SECONDS
    series: dict[tuple[str, str], Series] = {}
    cpu: dict[tuple[str, str], Series] = {}
    try:
        for run_no in range(ctx.runs):
            for case, limit in CASES:
                for name, backend in backends.items():
                    s = series.setdefault((name, case), Series())
                    try:
                        key = f"bench-{case}-{run_no}"
                        admitted, attempts, us = acquisitions_per_second(backend, key, limit, seconds)
                        s.values.append(admitted)
                        s.notes.append(f"{attempts:.0f}")
                        cpu.setdefault((name, case), Series()).values.append(us)
                        print(
                            f"  rate_limits run {run_no + 1} {name} {case}: {admitted:,.0f} acquisitions/s "
                            f"({attempts:,.0f} attempts/s, {us:,.0f} us of client CPU per attempt)",
                            flush=True,
                        )
                    except Exception as e:
                        s.errors.append(ctx.failed(f"rate_limits run {run_no + 1} {name} {case}", e))
    finally:
        for name, backend in backends.items():
            close = getattr(backend, "close", None)
            if close is not None:
                close()
            if name != "Dramatiq RedisBackend":
                drop_database(
                    ctx.admin_url, db_name("iddqueue" if "iddqueue" in name else name, "rate_limits")
                )
    ours = {case: series.get(("ours", case)) for case, _ in CASES}
    rows = []
    for name in backends:
        row = [name]
        for case, _ in CASES:
            s = series.get((name, case))
            mine = ours[case]
            if s is None or not s.values:
                row += ["failed", "", ""]
                continue
            ratio = f"{mine.median / s.median:.2f}x" if mine and mine.median and s.median else "-"
            row += [fmt_rate(s.median), s.spread(), ratio]
        rows.append(row)
    header = ["backend"]
    for case, limit in CASES:
        header += [f"{case} (limit {limit}) acquisitions/s", "min-max", "ours / it"]
    cpu_rows = [
        [name, *(f"{cpu[(name, case)].median:,.0f}" if (name, case) in cpu else "-" for case, _ in CASES)]
        for name in backends
    ]
    cpu_header = ["backend", *(f"{case}: client CPU us per attempt (median)" for case, _ in CASES)]
    return {
        "seconds_per_case": seconds,
        "threads": THREADS,
        "runs": ctx.runs,
        "table": markdown_table(header, rows) + "\n\n" + markdown_table(cpu_header, cpu_rows),
        "raw": {
            f"{k[0]} {k[1]}": {
                "values": v.values,
                "attempts": v.notes,
                "cpu_us_per_attempt": cpu[k].values if k in cpu else [],
                "errors": v.errors,
            }
            for k, v in series.items()
        },
    }
