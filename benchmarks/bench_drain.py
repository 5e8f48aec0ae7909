"""Scenario 1 (drain) and 6 (connections): N queued no-op messages, workers started, msgs/s.

Per run and system: fresh storage, prefill N messages, start the worker
processes (spawned, ready and idle), then time from "go" to the N-th actor
completion.  Systems are interleaved within each run so that machine noise
spreads over all of them.  While draining, the parent samples
``pg_stat_activity`` of the system's own database (connections per process).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .bench_common import (
    OURS,
    POSTGRES_SYSTEMS,
    STUB,
    Context,
    Series,
    connection_count,
    db_name,
    fmt_rate,
    fmt_ratio,
    markdown_table,
)
from .bench_systems import WorkerGroup, getenv_int, install, prefill

#: Longest timed drain, in seconds: a slower system is rated on what it drained by then.
DRAIN_CAP_S = 40.0
#: Longest warm-up drain, in seconds.
WARMUP_CAP_S = 10.0
#: (processes, threads per process) configurations.
CONFIGS = ((1, 8), (2, 8))


def drain_once(
    ctx: Context,
    system: str,
    n: int,
    processes: int,
    threads: int,
    *,
    opts: dict[str, Any] | None = None,
    scenario: str = "drain",
    cap_s: float = DRAIN_CAP_S,
) -> tuple[float | None, int]:
    """Messages per second of one drain, and the most connections seen on the system's database.

    A drain still unfinished after ``cap_s`` seconds is rated on the messages done by then.
    """
    dbname = db_name(system, scenario)
    url = ctx.db_url(dbname)
    install(system, ctx.admin_url, dbname, url)
    if system != STUB:
        prefill(system, url, n)
    group = WorkerGroup(
        system, url, processes=processes, threads=threads, opts=opts, stub_prefill=n if system == STUB else 0
    )
    peak = [0]
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.is_set():
            try:
                peak[0] = max(peak[0], connection_count(ctx.admin_url, dbname))
            except Exception:
                pass
            stop_sampling.wait(0.05)

    try:
        group.start()
        sampler = None
        if system in POSTGRES_SYSTEMS:
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
        t0 = group.go()
        t1 = group.wait_for(n, cap_s)
        stop_sampling.set()
        if sampler is not None:
            sampler.join(2)
        if t1 is None:
            done = group.done
            elapsed = time.perf_counter() - t0
            return (done / elapsed if done else None), peak[0]
        return n / (t1 - t0), peak[0]
    finally:
        stop_sampling.set()
        group.close()


def run(ctx: Context) -> dict[str, Any]:
    n = getenv_int("BENCH_DRAIN_MESSAGES", 5_000 if ctx.quick else 20_000)
    series: dict[tuple[str, int, int], Series] = {}
    conns: dict[tuple[str, int], list[int]] = {}
    # Warm-up (untimed): server caches, catalogs and the OS page cache for every system,
    # so that the first system of the first run does not pay for a cold start.
    for system in ctx.systems:
        try:
            drain_once(ctx, system, 2_000, 1, 8, cap_s=WARMUP_CAP_S)
        except Exception as e:
            print(f"  drain warm-up {system}: FAILED {e!r}", flush=True)
    for run_no in range(ctx.runs):
        for processes, threads in CONFIGS:
            for system in ctx.systems:
                if system == STUB and processes > 1:
                    continue  # The StubBroker lives in one process.
                s = series.setdefault((system, processes, threads), Series())
                try:
                    rate, peak = drain_once(ctx, system, n, processes, threads)
                    if rate is None:
                        s.errors.append("no message drained within the cap")
                    else:
                        s.values.append(rate)
                    if peak:
                        conns.setdefault((system, processes), []).append(peak)
                    print(
                        f"  drain run {run_no + 1} {system} {processes}x{threads}: {fmt_rate(rate)} msgs/s"
                        + (f", peak connections {peak}" if peak else ""),
                        flush=True,
                    )
                except Exception as e:
                    s.errors.append(f"{type(e).__name__}: {e}")
                    print(f"  drain run {run_no + 1} {system} {processes}x{threads}: FAILED {e!r}")
    rows = []
    for system in ctx.systems:
        row = [system]
        for processes, threads in CONFIGS:
            s = series.get((system, processes, threads))
            ours = series.get((OURS, processes, threads))
            if s is None:
                row += ["n/a", "", ""]
                continue
            if not s.values:
                row += ["failed: " + "; ".join(sorted(set(s.errors)))[:120], "", ""]
                continue
            row += [
                fmt_rate(s.median),
                s.spread(),
                fmt_ratio(ours.median if ours else None, s.median) if system != OURS else "1.00x",
            ]
        rows.append(row)
    header = ["system", "1x8 msgs/s (median)", "1x8 min-max", "ours / it (1x8)"]
    header += ["2x8 msgs/s (median)", "2x8 min-max", "ours / it (2x8)"]
    table = markdown_table(header, rows)
    conn_rows = []
    for (system, processes), peaks in sorted(conns.items()):
        expected = f"{processes} x (4 + 1) = {processes * 5}" if system == OURS else ""
        conn_rows.append([system, str(processes), str(max(peaks)), expected])
    conn_table = markdown_table(
        ["system", "worker processes", "peak connections seen", "README formula (pool_size + 1 per process)"],
        conn_rows,
    )
    return {
        "n": n,
        "runs": ctx.runs,
        "table": table,
        "connections_table": conn_table,
        "raw": {f"{k[0]} {k[1]}x{k[2]}": {"values": v.values, "errors": v.errors} for k, v in series.items()},
    }
