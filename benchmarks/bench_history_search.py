"""Scenario history_search (issue 33): the dashboard's history search on a large history.

N finished rows (default 10,000,000; ``--history-rows``) spread evenly over the
last 30 days (one partition a day), 20 actors and 8 queues, each with a payload
as Dramatiq's JSONEncoder writes it (about 250 bytes: a customer id among
100,000 and an amount in ``args``, a note in ``kwargs``, options, the message id
and timestamp), one row in 50 failed; then ANALYZE.  Timed, each the first page
(50 rows) of the dashboard's own statement (``Store.history``, the one the
History page and ``dramatiq-pg-outbox history`` run), the first run and the
median of the next ``--runs``:

* an argument search (a customer id) restricted to one day and one actor (the
  issue's target: under 300 ms), then to one day, to one actor over 30 days, and
  unrestricted (30 days, any actor): each day searched is read in full, since no
  index serves the arguments (one would be a write on every ack);
* the newest page of the last 24 hours without a filter;
* a message id over 30 days, and the deliveries of a finished message of
  yesterday (``Store.deliveries``: the partitions from its timestamp on).

The searches run without the dashboard's 15 s statement limit, to state what
they cost.  Nothing here is compared with another system: the figures are
absolute, on this machine, as benchmarks/README.md reports them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from dramatiq_pg_outbox import upgrade
from dramatiq_pg_outbox.dashboard.store import HistoryFilter, Store

from .bench_common import Context, drop_database, markdown_table, recreate_database

DEFAULT_ROWS = 10_000_000
DAYS = 30
ACTORS = 20
CUSTOMERS = 100_000
TARGET_MS = 300

# One row per i; the customer id of row i is cust-(i * 7919 mod 100000), so each
# customer has N / 100,000 rows spread over the days and actors.
_LOAD = """
INSERT INTO bench.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at,
                           started_at, finished_at, error_type, error, payload)
SELECT i, 'q' || (i %% 8), 'actor' || (i %% 20), md5(i::text), CASE WHEN i %% 50 = 0 THEN 'failed'
       ELSE 'completed' END, 1, t - interval '2 s', t - interval '1 s', t,
       CASE WHEN i %% 50 = 0 THEN 'Declined' END, CASE WHEN i %% 50 = 0 THEN 'Declined: no funds' END,
       convert_to(format(
           '{"queue_name":"q%%s","actor_name":"actor%%s","args":["cust-%%s",%%s],'
           '"kwargs":{"note":"order %%s of the spring campaign"},'
           '"options":{"redis_message_id":"%%s","retries":0},"message_id":"%%s","message_timestamp":%%s}',
           i %% 8, i %% 20, (i * 7919) %% 100000, i %% 10000, i, md5(i::text), md5(i::text),
           (extract(epoch FROM t) * 1000)::bigint - 2000), 'UTF8')
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
     LATERAL (SELECT now() - (%(span)s::interval * (i - %(first)s) / %(count)s)) AS x(t)
"""


async def _timed(call: Callable[[], Awaitable[Any]], runs: int) -> tuple[float, float, Any]:
    """(first run ms, median of ``runs`` more ms, the first run's result)."""
    started = time.perf_counter()
    result = await call()
    first = (time.perf_counter() - started) * 1000
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        await call()
        times.append((time.perf_counter() - started) * 1000)
    return first, statistics.median(times) if times else first, result


async def _measure(url: str, now: dt.datetime, rows: int, runs: int) -> list[list[str]]:
    store = Store(url, "bench", "bench")
    store.search_timeout_ms = 0  # no limit: the figures say what a search costs
    await store.open()
    try:
        # A customer with a row of actor 7 on the day before yesterday: row i with i % 20 == 7.
        i = next(i for i in range(rows // 15, rows) if i % 20 == 7)
        customer = f"cust-{i * 7919 % CUSTOMERS}"
        finished = now - dt.timedelta(days=DAYS) * (i - 1) / rows
        day = finished.replace(hour=0, minute=0, second=0, microsecond=0)
        one_day = {"since": day, "until": day + dt.timedelta(days=1)}
        month = {"since": now - dt.timedelta(days=DAYS + 1)}
        cases: list[tuple[str, HistoryFilter]] = [
            ("arguments, one day, one actor", HistoryFilter(**one_day, actor_name="actor7", args=customer)),
            ("arguments, one day", HistoryFilter(**one_day, args=customer)),
            ("arguments, 30 days, one actor", HistoryFilter(**month, actor_name="actor7", args=customer)),
            ("arguments, 30 days (unrestricted)", HistoryFilter(**month, args=customer)),
            ("no filter, last 24 h (newest page)", HistoryFilter(since=now - dt.timedelta(days=1))),
            ("message id, 30 days", HistoryFilter(**month, message_id=f"{i:x}")),
        ]
        table = []
        for label, where in cases:
            first, median, found = await _timed(lambda w=where: store.history(w), runs)  # type: ignore[misc]
            table.append([label, f"{first:,.0f} ms", f"{median:,.0f} ms", f"{len(found)}"])
            print(f"  {label}: first {first:,.0f} ms, median {median:,.0f} ms, {len(found)} rows", flush=True)
        yesterday = now - dt.timedelta(days=1)
        message_id = (await store.history(HistoryFilter(since=yesterday - dt.timedelta(hours=1)), 1))[
            0
        ].message_id
        first, median, found = await _timed(lambda: store.deliveries(message_id, yesterday), runs)
        table.append(
            ["deliveries of a message of yesterday", f"{first:,.0f} ms", f"{median:,.0f} ms", f"{len(found)}"]
        )
        return table
    finally:
        await store.close()


def run(ctx: Context) -> dict[str, Any]:
    rows = int(
        os.environ.get("BENCH_HISTORY_ROWS", 10_000 if ctx.smoke else 300_000 if ctx.quick else DEFAULT_ROWS)
    )
    runs = 1 if ctx.smoke else max(ctx.runs, 5)
    name = "bench_history_search"
    recreate_database(ctx.admin_url, name)
    url = ctx.db_url(name)
    try:
        upgrade(url, schema="bench")
        with psycopg.connect(url, autocommit=True) as conn:
            today = conn.execute("SELECT (now() AT TIME ZONE 'UTC')::date").fetchone()[0]  # type: ignore[index]
            for back in range(1, DAYS + 2):
                conn.execute(
                    "SELECT bench.create_history_partitions(0, %s)", (today - dt.timedelta(days=back),)
                )
            print(f"  loading {rows:,} rows over {DAYS} days ...", flush=True)
            started = time.perf_counter()
            conn.execute(_LOAD, {"first": 1, "last": rows, "count": rows, "span": dt.timedelta(days=DAYS)})
            load_s = time.perf_counter() - started
            conn.execute("ANALYZE bench.history")
            now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
            size = conn.execute(
                "SELECT pg_size_pretty(sum(pg_total_relation_size(c.oid))) FROM pg_inherits AS i "
                "JOIN pg_class AS c ON c.oid = i.inhrelid WHERE i.inhparent = 'bench.history'::regclass"
            ).fetchone()[0]  # type: ignore[index]
        table = asyncio.run(_measure(url, now, rows, runs))
        print(f"  {rows:,} rows ({size}) loaded in {load_s:.0f} s", flush=True)
        return {
            "rows": rows,
            "size": size,
            "target_ms": TARGET_MS,
            "table": markdown_table([f"first page of 50 ({rows:,} rows, {DAYS} days, {ACTORS} actors)",
                                     "first run", f"median of {runs}", "rows"], table),
        }  # fmt: skip
    finally:
        drop_database(ctx.admin_url, name)
