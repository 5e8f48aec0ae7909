"""Scenario 5 (sustained run): our broker at a steady rate; is the hot table bounded?

A producer thread enqueues ``rate`` messages per second (a multi-row insert
every 50 ms) for ``seconds``; a 1 x 8 ``Worker`` consumes them.  Every
``SAMPLE_S`` seconds the parent records the hot table's size, live and dead
tuples, autovacuum runs, the history table's size and the consumer lag.
Default 60 s x 2,000/s = 120k messages; the issue's 1M messages is
``--sustained-seconds 200 --sustained-rate 5000``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg

from .bench_common import OURS, Context, markdown_table
from .bench_systems import WorkerGroup, install, make_message

#: Seconds between two samples.
SAMPLE_S = 5.0
#: Producer tick, in seconds.
TICK_S = 0.05

#: Sizes and counters of the partitioned tables, summed over their partitions.
STATS_SQL = """
SELECT (SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('dramatiq.messages')),
       sum(s.n_live_tup), sum(s.n_dead_tup), sum(s.autovacuum_count), sum(s.autoanalyze_count),
       (SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('dramatiq.history')),
       (SELECT count(*) FROM dramatiq.messages)
FROM pg_stat_user_tables AS s
WHERE s.relid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages'))
"""


def run(ctx: Context) -> dict[str, Any]:
    if OURS not in ctx.systems:
        return {"table": "not run (our broker not selected)"}
    seconds = int(os.environ.get("BENCH_SUSTAINED_SECONDS", 3 if ctx.smoke else 20 if ctx.quick else 60))
    rate = int(os.environ.get("BENCH_SUSTAINED_RATE", 500 if ctx.smoke else 2_000))
    dbname = "bench_sustained_ours"
    url = ctx.db_url(dbname)
    install(OURS, ctx.admin_url, dbname, url)
    total = seconds * rate
    group = WorkerGroup(OURS, url, processes=1, threads=8)
    sent = [0]
    stop = threading.Event()

    def produce() -> None:
        from dramatiq_pg_outbox import PostgresBroker
        from dramatiq_pg_outbox._runtime import StoredMessage

        broker = PostgresBroker(url=url)
        per_tick = max(1, round(rate * TICK_S))
        t_next = time.perf_counter()
        try:
            while sent[0] < total and not stop.is_set():
                n = min(per_tick, total - sent[0])
                broker.runtime.enqueue(
                    [StoredMessage.of(make_message(i)) for i in range(sent[0], sent[0] + n)], notify=True
                )
                sent[0] += n
                t_next += TICK_S
                delay = t_next - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
        finally:
            broker.close()

    samples: list[list[str]] = []
    try:
        group.start()
        t0 = group.go()
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        deadline = t0 + seconds * 3 + 60  # bounded even if the worker falls far behind
        with psycopg.connect(url, autocommit=True) as conn:
            next_sample = t0
            while time.perf_counter() < deadline:
                now = time.perf_counter()
                if now >= next_sample:
                    row = conn.execute(STATS_SQL).fetchone() or ()
                    size, live, dead, av, aa, hist, rows = row
                    samples.append(
                        [
                            f"{now - t0:.0f}",
                            f"{sent[0]:,}",
                            f"{group.done:,}",
                            f"{sent[0] - group.done:,}",
                            f"{rows:,}",
                            f"{size / 1024:,.0f}",
                            f"{live:,}",
                            f"{dead:,}",
                            str(av),
                            str(aa),
                            f"{hist / 1024 / 1024:,.1f}",
                        ]
                    )
                    next_sample += SAMPLE_S
                if group.done >= total:
                    break
                time.sleep(0.05)
        elapsed = time.perf_counter() - t0
        done = group.done
        stop.set()
        producer.join(10)
    finally:
        stop.set()
        group.close()
    table = markdown_table(
        [
            "t (s)",
            "sent",
            "done",
            "lag",
            "rows in messages",
            "messages size (KiB)",
            "n_live_tup",
            "n_dead_tup",
            "autovacuums",
            "autoanalyzes",
            "history size (MiB)",
        ],
        samples,
    )
    return {
        "seconds": seconds,
        "rate": rate,
        "total": total,
        "done": done,
        "elapsed_s": round(elapsed, 1),
        "table": table,
    }
