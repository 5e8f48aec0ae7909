"""Concurrency keys and fair claims (issue 35): the keyed drain, the limiter, fairness.

``python -m benchmarks.run --scenarios concurrency`` measures, on our broker only, with
Dramatiq's ``Worker`` in spawned processes of 8 threads and an actor whose body sleeps
``BENCH_CONCURRENCY_SLEEP_MS`` (default 2 ms, so that a limit of 1 matters):

1. ``keyed``: N messages (``BENCH_CONCURRENCY_MESSAGES``, default 100,000) over K keys
   (``BENCH_CONCURRENCY_KEYS``, default N / 100), each key's messages sent together (key
   ``i // (N / K)``: a burst of 100 per key), drained by 1 process x 8 threads:

   - ``unkeyed``: the same messages without a key (the plain claim);
   - ``keyed, limit 1``: ``concurrency_key`` per message, ``concurrency_limit`` 1;
   - ``ConcurrentRateLimiter``: no key; the actor's body runs inside
     ``ConcurrentRateLimiter(PostgresBackend(broker=broker), f"key:{k}", limit=1).acquire()``
     (one backend per process, on the broker's pool); ``RateLimitExceeded`` goes to Dramatiq's
     ``Retries`` with the settings of ``BENCH_CONCURRENCY_RETRIES`` (default
     ``20,15000,604800000``: Dramatiq's defaults, max_retries, min_backoff and max_backoff in
     ms).  Capped at ``BENCH_CONCURRENCY_LIMITER_CAP`` seconds (default 600), run once
     (``BENCH_CONCURRENCY_LIMITER_RUNS``); what is left at the cap is reported.

   The unkeyed and keyed drains are interleaved in each round.  Reported: wall time to
   drain, messages per second, attempts (actor calls, and the history rows), retries
   (history rows completed with an error), dead letters (history rows failed).

2. ``fairness``: one key with B messages (``BENCH_FAIR_BIG``, default 200,000) enqueued
   first, then 100 keys with 20 messages each.  ``before``: the same messages without keys
   (FIFO: the small keys' messages are behind the backlog); ``after, limit 8``: every key at
   ``concurrency_limit`` 8; ``after, big key limit 1``: the big key at 1, the small keys at 8
   (capped at ``BENCH_FAIR_LIMIT1_CAP`` seconds, default 120: the big key then drains at one
   message at a time); ``after, limit 10,000``: every key at a limit no key reaches here
   (the keyed claim's rotation over the keys without a limit that binds: what fairness
   alone costs).  ``BENCH_FAIR_CASES`` (default ``before,after8,big1,wide``) selects them.
   Reported: time from "go" until every small key's message finished
   (and the median small message), total drain time and rate, in 1 x 8 and, with
   ``BENCH_FAIR_CONFIGS=1x8,2x8``, 2 x 8.

3. ``explain``: ``EXPLAIN (ANALYZE, BUFFERS)`` of a claim of 100 (claim_keys, then claim_keyed
   on the keys it locked, rolled back; the plain claim on the same messages without keys) on
   part 1's queue and on the fairness queue, freshly filled and ANALYZEd, median of 15.

``BENCH_CONCURRENCY_PARTS`` (default ``keyed,fairness,explain``) selects the parts.
``--smoke``: each case once on a few hundred messages, the limiter with short backoffs.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import psycopg

from .bench_common import OURS, Context, fmt_rate, markdown_table
from .bench_systems import ACTOR, QUEUE, getenv_int, install

#: Worker threads per process.
THREADS = 8
#: Messages per enqueue statement of the prefill.
FILL_BATCH = 5_000
#: Longest keyed / unkeyed drain, in seconds (a slower one is rated on what it drained).
DRAIN_CAP_S = 600.0
#: Small keys of the fairness case, and messages per small key.
SMALL_KEYS = 100
SMALL_EACH = 20
#: Limit of every key in the fairness case "after" (and of the small keys with the big one at 1).
FAIR_LIMIT = 8
#: The limit of the fairness case where no limit binds (``wide``).
WIDE_LIMIT = 10_000


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


# -- worker processes ---------------------------------------------------------------------------


class Shared:
    """Counters and per-message finish times shared with the worker processes."""

    def __init__(self, ctx: Any, slots: int) -> None:
        #: Actor bodies that finished (the message completed).
        self.done = ctx.Value("q", 0)
        #: Actor calls (every delivery, retries included).
        self.attempts = ctx.Value("q", 0)
        #: Calls that raised RateLimitExceeded.
        self.limited = ctx.Value("q", 0)
        #: time.time() at which each message's body finished, by message index (0: not yet).
        self.finished = ctx.Array("d", max(slots, 1), lock=False)
        self.ready = ctx.Semaphore(0)
        self.go = ctx.Event()
        self.stop = ctx.Event()


def _bump(value: Any) -> None:
    with value.get_lock():
        value.value += 1


def worker_process(
    url: str, threads: int, shared: Shared, limiter: bool, sleep_s: float, actor_options: dict[str, Any]
) -> None:
    """One worker process: the actor, Dramatiq's Worker, released by go, stopped by stop."""
    logging.basicConfig(level=logging.CRITICAL)
    import dramatiq
    from dramatiq import Worker
    from dramatiq.errors import RateLimitExceeded
    from dramatiq.rate_limits import ConcurrentRateLimiter

    from dramatiq_pg_outbox import PostgresBroker
    from dramatiq_pg_outbox.rate_limits import PostgresBackend

    broker = PostgresBroker(url=url)
    dramatiq.set_broker(broker)
    backend = PostgresBackend(broker=broker) if limiter else None

    @dramatiq.actor(queue_name=QUEUE, actor_name=ACTOR, **actor_options)
    def work(i: int, key: str | None) -> None:
        _bump(shared.attempts)
        if backend is not None and key is not None:
            try:
                with ConcurrentRateLimiter(backend, f"key:{key}", limit=1).acquire():
                    time.sleep(sleep_s)
            except RateLimitExceeded:
                _bump(shared.limited)
                raise
        elif sleep_s:
            time.sleep(sleep_s)
        if 0 <= i < len(shared.finished):
            shared.finished[i] = time.time()
        _bump(shared.done)

    broker.declare_queue(QUEUE)
    worker = Worker(broker, worker_threads=threads, worker_timeout=100)
    shared.ready.release()
    shared.go.wait()
    worker.start()
    shared.stop.wait()
    worker.stop()
    broker.close()


class Group:
    """``processes`` spawned worker processes, ready and idle until ``go()``."""

    def __init__(
        self,
        url: str,
        processes: int,
        slots: int,
        *,
        limiter: bool = False,
        sleep_s: float = 0.0,
        actor_options: dict[str, Any] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.shared = Shared(ctx, slots)
        self.procs = [
            ctx.Process(
                target=worker_process,
                args=(url, THREADS, self.shared, limiter, sleep_s, actor_options or {"max_retries": 0}),
                daemon=True,
            )
            for _ in range(processes)
        ]

    def __enter__(self) -> Group:
        for p in self.procs:
            p.start()
        for _ in self.procs:
            if not self.shared.ready.acquire(timeout=120):
                raise RuntimeError("worker process did not become ready")
        return self

    def go(self) -> tuple[float, float]:
        """(perf_counter, time.time) at go."""
        t0, wall = time.perf_counter(), time.time()
        self.shared.go.set()
        return t0, wall

    @property
    def done(self) -> int:
        return int(self.shared.done.value)

    def wait_for(self, n: int, cap_s: float) -> float | None:
        """perf_counter() when ``n`` bodies finished, or None if ``cap_s`` passed first."""
        deadline = time.perf_counter() + cap_s
        while time.perf_counter() < deadline:
            if self.shared.done.value >= n:
                return time.perf_counter()
            if not any(p.is_alive() for p in self.procs):
                return None
            time.sleep(0.005)
        return None

    def __exit__(self, *exc: object) -> None:
        self.shared.go.set()
        self.shared.stop.set()
        deadline = time.monotonic() + 30
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)


# -- storage ------------------------------------------------------------------------------------


def fresh(ctx: Context, case: str) -> str:
    """A new database with the schema for one case; its URL."""
    dbname = f"bench_concurrency_{case}"
    url = ctx.db_url(dbname)
    install(OURS, ctx.admin_url, dbname, url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return str(url)


#: Statements named in the server-time summary, by a fragment of their text.
STATEMENTS = (
    ("claim_keys", "pg_try_advisory_xact_lock"),
    ("claim_keyed", "least(keys.free"),
    ("claim", "WITH candidates AS"),
    ("ack", "WITH done AS"),
    ("rate limiter", "rate_limits"),
)


def reset_statements(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


def statements(url: str) -> dict[str, dict[str, float]]:
    """Server time of the claim, ack and rate-limiter statements of this database since the reset:
    name -> calls, rows per call, mean and max exec ms (pg_stat_statements)."""
    out: dict[str, dict[str, float]] = {}
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT s.query, s.calls, s.rows, s.total_exec_time, s.max_exec_time "
                "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
                "WHERE d.datname = current_database()"
            ).fetchall()
    except psycopg.Error as e:  # pg_stat_statements not loaded (--pg-url)
        print(f"  concurrency: no pg_stat_statements ({e})", flush=True)
        return out
    for query, calls, nrows, total, top in rows:
        for name, fragment in STATEMENTS:
            if fragment in query:
                o = out.setdefault(name, {"calls": 0, "rows": 0, "total_ms": 0.0, "max_ms": 0.0})
                o["calls"] += calls
                o["rows"] += nrows
                o["total_ms"] += total
                o["max_ms"] = max(o["max_ms"], top)
                break
    for o in out.values():
        o["mean_ms"] = o["total_ms"] / max(o["calls"], 1)
        o["rows_per_call"] = o["rows"] / max(o["calls"], 1)
    return out


def fmt_statements(found: dict[str, dict[str, float]]) -> str:
    return "; ".join(
        f"{name} {o['calls']:,.0f} calls {o['mean_ms']:.2f} ms mean ({o['rows_per_call']:.1f} rows)"
        for name, o in found.items()
    )


def fill(url: str, items: list[tuple[str | None, int | None]], *, keyed: bool) -> None:
    """Queue one message per item, in order: args (index, key); with ``keyed``, the key and
    limit as the message's ``concurrency_key`` / ``concurrency_limit``."""
    from dramatiq import Message

    from dramatiq_pg_outbox import PostgresBroker
    from dramatiq_pg_outbox._runtime import StoredMessage

    broker = PostgresBroker(url=url)
    try:
        for lo in range(0, len(items), FILL_BATCH):
            batch = []
            for i in range(lo, min(len(items), lo + FILL_BATCH)):
                key, limit = items[i]
                options: dict[str, Any] = {}
                if keyed and key is not None:
                    options = {"concurrency_key": key, "concurrency_limit": limit}
                msg: Any = Message(
                    queue_name=QUEUE, actor_name=ACTOR, args=(i, key), kwargs={}, options=options
                )
                batch.append(StoredMessage.of(msg))
            broker.runtime.enqueue(batch, notify=False)
    finally:
        broker.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE dramatiq.messages")


def outcome(url: str) -> dict[str, Any]:
    """After a run: history rows by outcome, what is left in messages and when it falls due."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE state = 'completed' AND error_type IS NULL),"
            " count(*) FILTER (WHERE state = 'completed' AND error_type IS NOT NULL),"
            " count(*) FILTER (WHERE state = 'failed') FROM dramatiq.history"
        ).fetchone()
        assert row is not None
        left = conn.execute(
            "SELECT payload, extract(epoch FROM next_attempt_at - now())::float8 FROM dramatiq.messages"
        ).fetchall()
    retries: dict[int, int] = {}
    due_in = []
    for payload, seconds in left:
        n = int(json.loads(bytes(payload)).get("options", {}).get("retries", 0))
        retries[n] = retries.get(n, 0) + 1
        due_in.append(seconds)
    return {
        "history_rows": int(row[0]),
        "completed": int(row[1]),
        "retried": int(row[2]),
        "dead_letters": int(row[3]),
        "left": len(left),
        "left_by_retries": dict(sorted(retries.items())),
        "left_due_later": sum(1 for s in due_in if s > 0),
        "left_last_due_in_s": max(due_in) if due_in else None,
    }


# -- part 1: the keyed drain ----------------------------------------------------------------------


def keyed_items(
    n: int, keys: int, *, limit: int = 1, order: str = "grouped"
) -> list[tuple[str | None, int | None]]:
    """Message i's key: ``grouped``, each key's messages sent together (a burst per key);
    ``interleaved``, round-robin over the keys."""
    per = max(1, n // keys)
    if order == "interleaved":
        return [(f"k{i % keys:05d}", limit) for i in range(n)]
    return [(f"k{min(i // per, keys - 1):05d}", limit) for i in range(n)]


def drain_case(
    ctx: Context,
    case: str,
    n: int,
    keys: int,
    sleep_s: float,
    *,
    cap_s: float,
    retries: tuple[int | None, int, int] | None = None,
    order: str = "grouped",
) -> dict[str, Any]:
    """One run of a part-1 case: ``unkeyed``, ``keyed`` or ``limiter``."""
    url = fresh(ctx, "drain")
    fill(url, keyed_items(n, keys, order=order), keyed=case == "keyed")
    reset_statements(url)
    options: dict[str, Any] = {"max_retries": 0}
    if case == "limiter" and retries is not None:
        options = {"max_retries": retries[0], "min_backoff": retries[1], "max_backoff": retries[2]}
    load = os.getloadavg()[0]
    with Group(url, 1, n, limiter=case == "limiter", sleep_s=sleep_s, actor_options=options) as group:
        t0, wall0 = group.go()
        t1 = group.wait_for(n, cap_s)
        elapsed = (t1 if t1 is not None else time.perf_counter()) - t0
        done = group.done
        ends = sorted(group.shared.finished[i] - wall0 for i in range(n) if group.shared.finished[i])
        attempts, limited = int(group.shared.attempts.value), int(group.shared.limited.value)
    result: dict[str, Any] = {
        "case": case,
        "n": n,
        "keys": keys,
        "seconds": elapsed,
        "drained": t1 is not None,
        "done": done,
        "rate": done / elapsed if elapsed else None,
        "attempts": attempts,
        "rate_limited": limited,
        # Seconds from go until this share of the N messages had completed (None: not reached).
        "done_at": {
            f"{p:g}%": (ends[math.ceil(p / 100 * n) - 1] if math.ceil(p / 100 * n) <= len(ends) else None)
            for p in (50, 90, 99, 99.9)
        },
        "load1": load,
        **outcome(url),
        "statements": statements(url),
    }
    print(
        f"  concurrency {case}: {done:,}/{n:,} in {elapsed:.1f} s ({fmt_rate(result['rate'])} msgs/s), "
        f"{attempts:,} attempts, {limited:,} RateLimitExceeded, {result['dead_letters']} dead letters, "
        f"{result['left']:,} left, load {load:.2f}; done at {_done_at(result['done_at'])}"
        f"\n    {fmt_statements(result['statements'])}",
        flush=True,
    )
    return result


def _done_at(done_at: dict[str, float | None]) -> str:
    return ", ".join(f"{p} {'-' if s is None else f'{s:,.1f} s'}" for p, s in done_at.items())


def expected_default_tail(
    max_retries: int = 20, min_backoff_ms: int = 15_000, max_backoff_ms: int = 7 * 86_400_000
) -> list[tuple[int, float, float]]:
    """Dramatiq's Retries backoff (compute_backoff, jitter): for retry r = 1..max_retries, the
    expected delay before it and the expected time from the first failure, in seconds."""
    out = []
    total = 0.0
    for r in range(max_retries):
        base = min_backoff_ms * 2**r
        if base * 2 <= max_backoff_ms:
            mean = base * 1.5
        elif base >= max_backoff_ms:
            mean = max_backoff_ms * 0.75
        else:  # uniform(base, 2 base), the part above the cap replaced by uniform(cap/2, cap)
            below = (max_backoff_ms - base) / base
            mean = below * (base + max_backoff_ms) / 2 + (1 - below) * max_backoff_ms * 0.75
        total += mean / 1000
        out.append((r + 1, mean / 1000, total))
    return out


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.0f} s"
    if seconds < 7_200:
        return f"{seconds / 60:,.1f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 86_400:,.1f} days"


def part1(ctx: Context) -> dict[str, Any]:
    n = getenv_int("BENCH_CONCURRENCY_MESSAGES", 400 if ctx.smoke else 100_000)
    keys = getenv_int("BENCH_CONCURRENCY_KEYS", max(1, n // 100))
    sleep_s = _env_float("BENCH_CONCURRENCY_SLEEP_MS", 2.0) / 1000
    default_retries = "20,100,2000" if ctx.smoke else "20,15000,604800000"
    spec = os.environ.get("BENCH_CONCURRENCY_RETRIES", default_retries).split(",")
    retries = (None if spec[0] in ("", "none") else int(spec[0]), int(spec[1]), int(spec[2]))
    cap = _env_float("BENCH_CONCURRENCY_LIMITER_CAP", 5 if ctx.smoke else 600)
    limiter_runs = getenv_int("BENCH_CONCURRENCY_LIMITER_RUNS", 1)
    wanted = os.environ.get("BENCH_CONCURRENCY_CASES", "unkeyed,keyed,limiter").split(",")
    order = os.environ.get("BENCH_CONCURRENCY_ORDER", "grouped")
    results: dict[str, list[dict[str, Any]]] = {"unkeyed": [], "keyed": [], "limiter": []}
    for run_no in range(ctx.runs):
        # Interleaved: each round runs every case once, the limiter in the first rounds only.
        cases = ["unkeyed", "keyed"] + (["limiter"] if run_no < limiter_runs else [])
        cases = [c for c in cases if c in wanted]
        for case in cases:
            try:
                results[case].append(
                    drain_case(
                        ctx,
                        case,
                        n,
                        keys,
                        sleep_s,
                        cap_s=cap if case == "limiter" else DRAIN_CAP_S,
                        retries=retries,
                        order=order,
                    )
                )
            except Exception as e:
                ctx.failed(f"concurrency run {run_no + 1} {case}", e)
    for case in ("unkeyed", "keyed"):
        for r in results[case]:
            if not r["drained"]:
                ctx.failed(
                    f"concurrency {case}", f"{r['done']:,} of {n:,} drained within {DRAIN_CAP_S:.0f} s"
                )
    rows = []
    base = statistics.median(r["rate"] for r in results["unkeyed"]) if results["unkeyed"] else None
    names = {
        "unkeyed": "unkeyed (no key, plain claim)",
        "keyed": "keyed, limit 1 (concurrency_key)",
        "limiter": "ConcurrentRateLimiter(limit=1) + Retries",
    }
    for case, runs in results.items():
        if not runs:
            continue
        rate = statistics.median(r["rate"] for r in runs)
        seconds = statistics.median(r["seconds"] for r in runs)
        drained = all(r["drained"] for r in runs)
        rows.append(
            [
                names[case],
                str(len(runs)),
                f"{seconds:,.1f}" + ("" if drained else f" (cap; {runs[0]['done']:,} done)"),
                fmt_rate(rate),
                f"{min(r['rate'] for r in runs):,.0f}-{max(r['rate'] for r in runs):,.0f}",
                f"{rate / base:.2f}x" if base else "-",
                f"{statistics.median(r['attempts'] for r in runs):,.0f}",
                f"{statistics.median(r['retried'] for r in runs):,.0f}",
                f"{statistics.median(r['dead_letters'] for r in runs):,.0f}",
                f"{statistics.median(r['left'] for r in runs):,.0f}",
                _done_at(runs[0]["done_at"]),
                ", ".join(f"{r['load1']:.1f}" for r in runs),
            ]
        )
    header = [
        "case",
        "runs",
        "wall s (median)",
        "msgs/s (median)",
        "min-max",
        "vs unkeyed",
        "attempts",
        "retries (history)",
        "dead letters",
        "left at the end",
        "done at (run 1)",
        "load (1 min) per run",
    ]
    left_rows = []
    for r in results["limiter"]:
        for level, count in r["left_by_retries"].items():
            left_rows.append([str(level), f"{count:,}"])
    tail = expected_default_tail(*(20 if retries[0] is None else retries[0], retries[1], retries[2]))
    tail_rows = [[str(r), _duration(mean), _duration(total)] for r, mean, total in tail]
    return {
        "messages": n,
        "keys": keys,
        "order": order,
        "sleep_ms": sleep_s * 1000,
        "retries": {"max_retries": retries[0], "min_backoff": retries[1], "max_backoff": retries[2]},
        "limiter_cap_s": cap,
        "keyed_table": markdown_table(header, rows),
        "limiter_left_table": markdown_table(["retries so far", "messages left"], left_rows),
        "retry_tail_table": markdown_table(
            ["retry", "expected backoff before it", "expected time since the first failure"], tail_rows
        ),
        "raw": results,
    }


# -- part 2: fairness ---------------------------------------------------------------------------


def fair_items(
    big: int, big_limit: int, small_limit: int = FAIR_LIMIT
) -> list[tuple[str | None, int | None]]:
    items: list[tuple[str | None, int | None]] = [("big", big_limit)] * big
    for k in range(SMALL_KEYS):
        items += [(f"small{k:03d}", small_limit)] * SMALL_EACH
    return items


def fair_case(
    ctx: Context, case: str, big: int, processes: int, sleep_s: float, cap_s: float
) -> dict[str, Any]:
    url = fresh(ctx, "fair")
    if case == "wide":
        items = fair_items(big, WIDE_LIMIT, WIDE_LIMIT)
    else:
        items = fair_items(big, 1 if case == "big1" else FAIR_LIMIT)
    n = len(items)
    fill(url, items, keyed=case != "before")
    reset_statements(url)
    load = os.getloadavg()[0]
    with Group(url, processes, n, sleep_s=sleep_s) as group:
        t0, wall0 = group.go()
        small = range(big, n)
        deadline = time.perf_counter() + cap_s
        small_done_at = None
        finished = group.shared.finished
        while time.perf_counter() < deadline:
            if small_done_at is None and all(finished[i] for i in small):
                small_done_at = time.perf_counter()
            if group.done >= n:
                break
            if not any(p.is_alive() for p in group.procs):
                break
            time.sleep(0.01)
        t1 = time.perf_counter()
        done = group.done
        ends = [finished[i] - wall0 for i in small if finished[i]]
        big_done = sum(1 for i in range(big) if finished[i])
    result: dict[str, Any] = {
        "case": case,
        "processes": processes,
        "n": n,
        "seconds": t1 - t0,
        "drained": done >= n,
        "done": done,
        "rate": done / (t1 - t0),
        "big_done": big_done,
        "big_rate": big_done / (t1 - t0),
        "small_all_s": max(ends) if len(ends) == n - big else None,
        "small_median_s": statistics.median(ends) if ends else None,
        "small_done": len(ends),
        "load1": load,
        "statements": statements(url),
    }
    print(
        f"  concurrency fairness {case} {processes}x{THREADS}: small keys all done at "
        f"{result['small_all_s'] if result['small_all_s'] is None else round(result['small_all_s'], 2)} s "
        f"(median {result['small_median_s'] or 0:.2f} s), {done:,}/{n:,} in {t1 - t0:.1f} s "
        f"({fmt_rate(result['rate'])} msgs/s, big key {fmt_rate(result['big_rate'])}/s), load {load:.2f}"
        f"\n    {fmt_statements(result['statements'])}",
        flush=True,
    )
    return result


def part2(ctx: Context) -> dict[str, Any]:
    big = getenv_int("BENCH_FAIR_BIG", 300 if ctx.smoke else 200_000)
    sleep_s = _env_float("BENCH_CONCURRENCY_SLEEP_MS", 2.0) / 1000
    limit1_cap = _env_float("BENCH_FAIR_LIMIT1_CAP", 5 if ctx.smoke else 120)
    configs = [int(c.split("x")[0]) for c in os.environ.get("BENCH_FAIR_CONFIGS", "1x8").split(",") if c]
    cases = {
        "before": "before: no keys (FIFO)",
        "after8": f"after: keys, every limit {FAIR_LIMIT}",
        "big1": f"after: big key limit 1, small keys {FAIR_LIMIT}",
        "wide": f"after: keys, every limit {WIDE_LIMIT:,} (rotation only)",
    }
    wanted = os.environ.get("BENCH_FAIR_CASES", ",".join(cases)).split(",")
    cases = {case: label for case, label in cases.items() if case in wanted}
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run_no in range(ctx.runs):
        for processes in configs:
            for case in cases:
                cap = limit1_cap if case == "big1" else DRAIN_CAP_S
                try:
                    r = fair_case(ctx, case, big, processes, sleep_s, cap)
                except Exception as e:
                    ctx.failed(f"concurrency fairness run {run_no + 1} {case} {processes}x{THREADS}", e)
                    continue
                results.setdefault((case, processes), []).append(r)
                if case != "big1" and not r["drained"]:
                    ctx.failed(f"concurrency fairness {case}", f"not drained within {cap:.0f} s")
                if r["small_all_s"] is None:
                    ctx.failed(f"concurrency fairness {case}", "small keys not finished within the cap")
    rows = []
    for (case, processes), runs in results.items():
        base = results.get(("before", processes))
        base_rate = statistics.median(r["rate"] for r in base) if base else None
        smalls = [r["small_all_s"] for r in runs if r["small_all_s"] is not None]
        middles = [r["small_median_s"] for r in runs if r["small_median_s"] is not None]
        rate = statistics.median(r["rate"] for r in runs)
        drained = all(r["drained"] for r in runs)
        rows.append(
            [
                cases[case],
                f"{processes}x{THREADS}",
                str(len(runs)),
                (
                    f"{statistics.median(smalls):,.2f} ({min(smalls):,.2f}-{max(smalls):,.2f})"
                    if smalls
                    else "-"
                ),
                f"{statistics.median(middles):,.2f}" if middles else "-",
                (
                    f"{statistics.median(r['seconds'] for r in runs):,.1f}"
                    if drained
                    else f"cap {statistics.median(r['seconds'] for r in runs):,.0f} s: "
                    f"{statistics.median(r['big_done'] for r in runs):,.0f} of the big key's {big:,} done"
                ),
                fmt_rate(rate),
                f"{rate / base_rate:.2f}x" if base_rate else "-",
                fmt_rate(statistics.median(r["big_rate"] for r in runs)),
                ", ".join(f"{r['load1']:.1f}" for r in runs),
            ]
        )
    header = [
        "case",
        "procs x threads",
        "runs",
        "every small key done, s (median, min-max)",
        "median small message done, s",
        "total drain s",
        "msgs/s (median)",
        "vs before",
        "big key msgs/s",
        "load (1 min) per run",
    ]
    return {
        "big": big,
        "small_keys": SMALL_KEYS,
        "small_each": SMALL_EACH,
        "sleep_ms": sleep_s * 1000,
        "fair_table": markdown_table(header, rows),
        "raw": {f"{c} {p}x{THREADS}": v for (c, p), v in results.items()},
    }


# -- part 3: EXPLAIN of the claims --------------------------------------------------------------


def _claim_params(limit: int) -> dict[str, Any]:
    import uuid

    return {
        "queue_name": QUEUE,
        "limit": limit,
        "lease": uuid.uuid4(),
        "owner": uuid.uuid4(),
        "consumers": 1,
        "rank": 0,
        "look_ahead": 64,
        "from_at": None,
        "from_id": None,
    }


def _explain(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> tuple[float, int, str]:
    """(execution ms, shared buffers, plan text) of one EXPLAIN ANALYZE (the caller rolls back)."""
    rows = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}", params).fetchone()
    assert rows is not None
    plan = (rows[0] if not isinstance(rows[0], str) else json.loads(rows[0]))[0]
    top = plan["Plan"]
    buffers = int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))
    text = conn.execute(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {query}", params).fetchall()
    return float(plan["Execution Time"]), buffers, "\n".join(r[0] for r in text)


def explain_state(url: str, limit: int, repeats: int) -> dict[str, Any]:
    """The claim of ``limit`` on the queue as filled: claim_keys, then claim_keyed on the keys it
    locked (each pair in one transaction, rolled back), or the plain claim on an unkeyed queue."""
    from dramatiq_pg_outbox.store.messages import MessageStore

    store = MessageStore("dramatiq")
    queries = store.queries
    keys_wanted = max(limit, 8)
    kparams = {"queue_name": QUEUE, "after_key": None, "keys": keys_wanted, "walk": 4 * keys_wanted,
               "lock_space": store.lock_space}  # fmt: skip
    found: dict[str, list[tuple[float, int]]] = {}
    plans: dict[str, str] = {}
    with psycopg.connect(url) as conn:
        keyed = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM dramatiq.messages WHERE concurrency_key IS NOT NULL)"
        ).fetchone()
        for _ in range(repeats):
            params = _claim_params(limit)
            if keyed and keyed[0]:
                with conn.transaction(force_rollback=True):
                    ms, buffers, plans["claim_keys"] = _explain(conn, queries["claim_keys"], kparams)
                    found.setdefault("claim_keys", []).append((ms, buffers))
                with conn.transaction(force_rollback=True):
                    locked = conn.execute(queries["claim_keys"], kparams).fetchall()
                    keys = [str(k) for k, _ in locked]
                    extra = {"keys": keys, "limits": [lim for _, lim in locked],
                             "per_key": max(1, limit // max(1, len(keys))), "prioritized": False,
                             "unkeyed": True}  # fmt: skip
                    ms, buffers, plans["claim_keyed"] = _explain(
                        conn, queries["claim_keyed"], {**params, **extra}
                    )
                    found.setdefault("claim_keyed", []).append((ms, buffers))
                with conn.transaction(force_rollback=True):
                    # As a consumer claims once a claim found no message without a key (3b488a4).
                    locked = conn.execute(queries["claim_keys"], kparams).fetchall()
                    keys = [str(k) for k, _ in locked]
                    extra = {**extra, "keys": keys, "limits": [lim for _, lim in locked], "unkeyed": False}
                    ms, buffers, plans["claim_keyed, unkeyed skipped"] = _explain(
                        conn, queries["claim_keyed"], {**params, **extra}
                    )
                    found.setdefault("claim_keyed, unkeyed skipped", []).append((ms, buffers))
            else:
                with conn.transaction(force_rollback=True):
                    ms, buffers, plans["claim"] = _explain(conn, queries["claim"], params)
                    found.setdefault("claim", []).append((ms, buffers))
    return {
        "medians": {
            k: (statistics.median(m for m, _ in v), statistics.median(b for _, b in v))
            for k, v in found.items()
        },
        "plans": plans,
    }


def part3(ctx: Context) -> dict[str, Any]:
    """EXPLAIN ANALYZE of the claims of 100 on part 1's queues and on the fairness queue."""
    n = getenv_int("BENCH_CONCURRENCY_MESSAGES", 400 if ctx.smoke else 100_000)
    keys = getenv_int("BENCH_CONCURRENCY_KEYS", max(1, n // 100))
    big = getenv_int("BENCH_FAIR_BIG", 300 if ctx.smoke else 200_000)
    repeats = 2 if ctx.smoke else 15
    limit = 100
    states = (
        (f"{n:,} messages, no key (plain claim)", keyed_items(n, keys), False),
        (f"{n:,} messages over {keys:,} keys, limit 1", keyed_items(n, keys), True),
        (
            f"one key with {big:,} + {SMALL_KEYS} keys x {SMALL_EACH}, limit {FAIR_LIMIT}",
            fair_items(big, FAIR_LIMIT),
            True,
        ),
    )
    drain_s = 2.0 if ctx.smoke else _env_float("BENCH_CONCURRENCY_EXPLAIN_DRAIN", 30)
    sleep_s = _env_float("BENCH_CONCURRENCY_SLEEP_MS", 2.0) / 1000
    states += (
        (
            f"the same after a 1 x 8 drain of {drain_s:.0f} s (not vacuumed)",
            fair_items(big, FAIR_LIMIT),
            True,
        ),
    )
    rows = []
    plans = {}
    for name, items, keyed in states:
        url = fresh(ctx, "explain")
        fill(url, items, keyed=keyed)
        if "drain of" in name:
            with Group(url, 1, 0, sleep_s=sleep_s) as group:
                group.go()
                time.sleep(drain_s)
                name += f", {group.done:,} done"
        got = explain_state(url, limit, repeats)
        for statement, (ms, buffers) in got["medians"].items():
            rows.append([name, statement, f"{ms:.2f}", f"{buffers:,.0f}"])
            print(
                f"  concurrency explain {name}: {statement} {ms:.2f} ms, {buffers:,.0f} buffers", flush=True
            )
        plans[name] = got["plans"]
    return {
        "explain_table": markdown_table(
            [
                "queue (ANALYZEd after the fill)",
                "statement (claim of 100)",
                "execution ms (median)",
                "shared buffers",
            ],
            rows,
        ),
        "explain_plans": plans,
        "explain": "\n\n".join(
            f"{name}, {statement}:\n{text}"
            for name, found in plans.items()
            for statement, text in found.items()
            if statement != "claim"
        ),
    }


def run(ctx: Context) -> dict[str, Any]:
    if OURS not in ctx.systems:
        return {"skipped": "our broker not selected"}
    parts = os.environ.get("BENCH_CONCURRENCY_PARTS", "keyed,fairness,explain").split(",")
    out: dict[str, Any] = {}
    if "keyed" in parts:
        out.update(part1(ctx))
    if "fairness" in parts:
        fair = part2(ctx)
        out.update({k: v for k, v in fair.items() if k != "raw"})
        out["fair_raw"] = fair["raw"]
    if "explain" in parts:
        out.update(part3(ctx))
    return out
