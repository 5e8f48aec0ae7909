"""Scenario 1 (drain) and 6 (connections): N queued no-op messages, workers started, msgs/s.

Per run and system: fresh storage, prefill N messages, start the worker
processes (spawned, ready and idle), then time from "go" to the N-th actor
completion.  Systems are interleaved within each run so that machine noise
spreads over all of them.  While draining, the parent samples
``pg_stat_activity`` of the system's own database (connections per process).

Whole-box CPU per message: the machine's busy time (``/proc/stat``, every CPU,
idle and iowait excluded) from "go" to the N-th completion, divided by N; it
includes PostgreSQL, Redis or RabbitMQ, the worker processes and this parent's
polling.  The floor row (issue 23) adds two parts measured in the same run: the
StubBroker's drain (Dramatiq's own cost, no I/O) and the raw-SQL
claim-and-archive of the same N rows in our tables (``raw_sql_once``: one
connection claims 100 due rows with one ``UPDATE ... FOR UPDATE SKIP LOCKED``
and archives them with one ``DELETE ... INSERT INTO history``, nothing else).
No broker on Dramatiq and PostgreSQL can cost less than their sum.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg

from .bench_common import (
    OURS,
    POSTGRES_SYSTEMS,
    STUB,
    Context,
    Series,
    busy_jiffies,
    connection_count,
    cpu_ms_per_message,
    db_name,
    fmt_rate,
    fmt_ratio,
    markdown_table,
)
from .bench_systems import QUEUE, WorkerGroup, getenv_int, install, prefill

#: Longest timed drain, in seconds: a slower system is rated on what it drained by then.
DRAIN_CAP_S = 40.0
#: Longest warm-up drain, in seconds.
WARMUP_CAP_S = 10.0
#: (processes, threads per process) configurations.
CONFIGS = ((1, 8), (2, 8))
#: Rows per claim of the raw-SQL floor (pgqueuer's larger batch).
RAW_BATCH = 100
#: The floor row's name in the tables.
FLOOR = "floor: StubBroker + raw SQL"

#: The raw-SQL floor's two statements (our tables, our claim order, no watermark, no clock,
#: no fence beyond the ids): claim a batch, archive it.
RAW_CLAIM = """
WITH c AS (
    SELECT id FROM dramatiq.messages
    WHERE queue_name = %(queue)s AND state = 'pending' AND next_attempt_at <= now()
    ORDER BY next_attempt_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED
)
UPDATE dramatiq.messages AS m
SET state = 'processing', attempts = m.attempts + 1, lease = %(lease)s, owner = %(owner)s, acquired_at = now()
WHERE m.id = ANY (ARRAY(SELECT id FROM c))
RETURNING m.id, m.payload
"""
RAW_ARCHIVE = """
WITH done AS (DELETE FROM dramatiq.messages WHERE id = ANY(%(ids)s::bigint[]) RETURNING *)
INSERT INTO dramatiq.history
    (id, queue_name, actor_name, message_id, state, attempts, enqueued_at, started_at, payload)
SELECT id, queue_name, actor_name, message_id, 'completed', attempts, enqueued_at, acquired_at, payload
FROM done
"""


def raw_sql_once(ctx: Context, n: int) -> tuple[float, float]:
    """The raw-SQL claim-and-archive of ``n`` prefilled rows: (msgs/s, whole-box CPU ms per message)."""
    dbname = db_name(OURS, "floor")
    url = ctx.db_url(dbname)
    install(OURS, ctx.admin_url, dbname, url)
    prefill(OURS, url, n)
    owner = uuid.uuid4()
    with psycopg.connect(url, autocommit=True) as conn:
        # Generic plans, as the broker's connections run them.
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute("VACUUM ANALYZE dramatiq.messages")
        done = 0
        busy0, t0 = busy_jiffies(), time.perf_counter()
        while done < n:
            params = {"queue": QUEUE, "limit": RAW_BATCH, "lease": uuid.uuid4(), "owner": owner}
            rows = conn.execute(RAW_CLAIM, params, prepare=True).fetchall()
            if not rows:
                break
            conn.execute(RAW_ARCHIVE, {"ids": [row[0] for row in rows]}, prepare=True)
            done += len(rows)
        elapsed, busy = time.perf_counter() - t0, busy_jiffies() - busy0
    return done / elapsed, cpu_ms_per_message(busy, done)


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
) -> tuple[float | None, int, float | None]:
    """Messages per second of one drain, the most connections seen on the system's database,
    and the whole-box CPU per message in milliseconds (None for a drain that did not finish).

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
        busy0 = busy_jiffies()
        t0 = group.go()
        t1 = group.wait_for(n, cap_s)
        busy = busy_jiffies() - busy0
        stop_sampling.set()
        if sampler is not None:
            sampler.join(2)
        if t1 is None:
            done = group.done
            elapsed = time.perf_counter() - t0
            return (done / elapsed if done else None), peak[0], None
        return n / (t1 - t0), peak[0], cpu_ms_per_message(busy, n)
    finally:
        stop_sampling.set()
        group.close()


def run(ctx: Context) -> dict[str, Any]:
    n = getenv_int("BENCH_DRAIN_MESSAGES", 500 if ctx.smoke else 5_000 if ctx.quick else 20_000)
    series: dict[tuple[str, int, int], Series] = {}
    cpu: dict[tuple[str, int, int], Series] = {}
    raw_rate, raw_cpu = Series(), Series()
    conns: dict[tuple[str, int], list[int]] = {}
    # Warm-up (untimed): server caches, catalogs and the OS page cache for every system,
    # so that the first system of the first run does not pay for a cold start.
    for system in ctx.systems:
        try:
            drain_once(ctx, system, 200 if ctx.smoke else 2_000, 1, 8, cap_s=WARMUP_CAP_S)
        except Exception as e:
            ctx.failed(f"drain warm-up {system}", e)
    floor = STUB in ctx.systems and OURS in ctx.systems
    for run_no in range(ctx.runs):
        if floor:
            rate, per_message = raw_sql_once(ctx, n)
            raw_rate.values.append(rate)
            raw_cpu.values.append(per_message)
            print(
                f"  drain run {run_no + 1} raw SQL claim-and-archive: {fmt_rate(rate)} msgs/s, "
                f"{per_message:.4f} ms CPU/msg",
                flush=True,
            )
        for processes, threads in CONFIGS:
            for system in ctx.systems:
                if system == STUB and processes > 1:
                    continue  # The StubBroker lives in one process.
                s = series.setdefault((system, processes, threads), Series())
                c = cpu.setdefault((system, processes, threads), Series())
                try:
                    rate, peak, per_message = drain_once(ctx, system, n, processes, threads)
                    if rate is None:
                        s.errors.append(
                            ctx.failed(
                                f"drain run {run_no + 1} {system} {processes}x{threads}",
                                "no message drained within the cap",
                            )
                        )
                    else:
                        s.values.append(rate)
                    if per_message is not None:
                        c.values.append(per_message)
                    if peak:
                        conns.setdefault((system, processes), []).append(peak)
                    print(
                        f"  drain run {run_no + 1} {system} {processes}x{threads}: {fmt_rate(rate)} msgs/s"
                        + (f", {per_message:.4f} ms CPU/msg" if per_message is not None else "")
                        + (f", peak connections {peak}" if peak else ""),
                        flush=True,
                    )
                except Exception as e:
                    s.errors.append(ctx.failed(f"drain run {run_no + 1} {system} {processes}x{threads}", e))
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
    # CPU per message, and the floor: the StubBroker's drain plus the raw-SQL claim-and-archive.
    cpu_median = {key: c.median for key, c in cpu.items() if c.median is not None}
    stub_cpu = cpu_median.get((STUB, 1, 8))
    floor_cpu = stub_cpu + raw_cpu.median if stub_cpu is not None and raw_cpu.median is not None else None
    cpu_rows = []
    for system in ctx.systems:
        row = [system]
        for processes, threads in CONFIGS:
            theirs = cpu_median.get((system, processes, threads))
            if theirs is None:
                row += ["n/a", ""]
                continue
            values = cpu[(system, processes, threads)].values
            mine = cpu_median.get((OURS, processes, threads))
            row += [f"{theirs:.4f} ({min(values):.4f}-{max(values):.4f})", fmt_ratio(mine, theirs)]
        cpu_rows.append(row)
    if floor_cpu is not None:
        cells = []
        for processes, threads in CONFIGS:
            cells += [f"{floor_cpu:.4f}", fmt_ratio(cpu_median.get((OURS, processes, threads)), floor_cpu)]
        cpu_rows.append([FLOOR, *cells])
    cpu_header = ["system", "1x8 CPU ms/msg (median, min-max)", "ours / it (1x8)"]
    cpu_header += ["2x8 CPU ms/msg (median, min-max)", "ours / it (2x8)"]
    cpu_table = markdown_table(cpu_header, cpu_rows)
    floor_note = (
        f"floor = StubBroker 1x8 drain {stub_cpu:.4f} ms + raw SQL claim-and-archive "
        f"{raw_cpu.median:.4f} ms ({fmt_rate(raw_rate.median)} msgs/s on one connection, "
        f"batches of {RAW_BATCH}) per message, medians of {len(raw_cpu.values)} runs"
        if floor_cpu is not None and stub_cpu is not None and raw_cpu.median is not None
        else "floor not measured (needs the systems StubBroker and dramatiq-pg-outbox)"
    )
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
        "cpu_table": cpu_table,
        "floor": floor_note,
        "connections_table": conn_table,
        "raw": {f"{k[0]} {k[1]}x{k[2]}": {"values": v.values, "errors": v.errors} for k, v in series.items()},
        "raw_cpu": {f"{k[0]} {k[1]}x{k[2]}": v.values for k, v in cpu.items()},
        "raw_sql": {"msgs_per_s": raw_rate.values, "cpu_ms_per_msg": raw_cpu.values},
    }
