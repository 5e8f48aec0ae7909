"""Scenario 3 (wake-up latency): commit -> actor start, idle worker (1 process x 8 threads).

The worker process starts and idles for a second; the parent then sends K
messages one at a time, ``SPACING_MS`` apart, and records ``time.time()`` the
moment each send (for ours: each ``Session.commit()``) returns.  The actor
records ``time.time()`` when it starts; both run on this machine's clock.
A latency can be slightly negative when the actor starts before the
producer's commit call has returned.  Each run also notes the server's mean WAL
sync meanwhile (``pg_stat_wal``, with ``track_wal_io_timing``): a claim commits
before its actor runs, so a slow disk minute shows in the tail of every system.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from .bench_common import (
    DRAMATIQ_PG,
    DRAMATIQ_POSTGRES,
    OURS,
    PGQUEUER,
    RABBITMQ,
    REDIS,
    Context,
    markdown_table,
    percentile,
)
from .bench_systems import ACTOR, QUEUE, WorkerGroup, install, make_broker

#: Pause between two sends, in milliseconds.
SPACING_MS = 20

#: (label, system, broker options, how the producer sends)
CASES: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("ours, NOTIFY in transaction (outbox + Session.commit)", OURS, {"notify": "transaction"}, "outbox"),
    ("ours, NOTIFY in transaction (send() outside outbox)", OURS, {"notify": "transaction"}, "send"),
    ("ours, NOTIFY after commit (outbox + Session.commit)", OURS, {"notify": "after_commit"}, "outbox"),
    ("ours, NOTIFY off (polling, max_fetch_interval 1000 ms)", OURS, {"notify": "off"}, "outbox"),
    ("RedisBroker", REDIS, {}, "send"),
    ("RabbitmqBroker", RABBITMQ, {}, "send"),
    ("dramatiq-pg", DRAMATIQ_PG, {}, "send"),
    ("dramatiq-postgres", DRAMATIQ_POSTGRES, {}, "send"),
    ("pgqueuer (batch 10)", PGQUEUER, {}, "pgqueuer"),
)


def _send_all(system: str, url: str, opts: dict[str, Any], how: str, k: int) -> list[float]:
    committed = [0.0] * k
    if how == "pgqueuer":

        async def main() -> None:
            import asyncpg
            from pgqueuer import AsyncpgDriver, Queries

            conn = await asyncpg.connect(url)
            queries = Queries(AsyncpgDriver(conn))
            for i in range(k):
                await queries.enqueue(ACTOR, str(i).encode())
                committed[i] = time.time()
                await asyncio.sleep(SPACING_MS / 1000)
            await conn.close()

        asyncio.run(main())
        return committed
    import dramatiq

    broker = make_broker(system, url, opts)
    actor = dramatiq.actor(lambda i: None, broker=broker, actor_name=ACTOR, queue_name=QUEUE)
    if how == "outbox":
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from dramatiq_pg_outbox import outbox

        engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        with Session(engine) as s:  # connect outside the measurement
            s.connection()
        for i in range(k):
            with Session(engine) as s:
                with outbox(s, broker):
                    actor.send(i)
                s.commit()
            committed[i] = time.time()
            time.sleep(SPACING_MS / 1000)
        time.sleep(0.05)  # let an after-commit NOTIFY leave before the broker closes
        engine.dispose()
    else:
        for i in range(k):
            actor.send(i)
            committed[i] = time.time()
            time.sleep(SPACING_MS / 1000)
    broker.close()
    return committed


def wal_syncs(url: str) -> tuple[int, float] | None:
    """(WAL syncs, their total ms) of the whole server so far, or None (before PostgreSQL 14).

    ``url``: the admin URL (``pg_stat_wal`` is the server's; a system that is not on PostgreSQL,
    RedisBroker, has no database of its own there).

    The ms are 0 unless the server runs with ``track_wal_io_timing`` (the private server does).
    """
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.info.server_version < 140000:
            return None
        row = conn.execute("SELECT wal_sync, wal_sync_time FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row[0]), float(row[1])


def latency_once(
    ctx: Context,
    system: str,
    opts: dict[str, Any],
    how: str,
    k: int,
    wal: list[tuple[int, float]] | None = None,
) -> list[float]:
    """``k`` wake-ups of an idle 1 x 8 worker, in ms; ``wal`` gets the server's (WAL syncs, ms) meanwhile."""
    dbname = "bench_latency_" + system.replace("-", "_").lower()
    url = ctx.db_url(dbname)
    install(system, ctx.admin_url, dbname, url)
    group = WorkerGroup(system, url, processes=1, threads=8, slots=k, opts=opts)
    try:
        group.start()
        group.go()
        time.sleep(1.5)  # the worker is up and idle
        before = wal_syncs(ctx.admin_url)
        committed = _send_all(system, url, opts, how, k)
        if group.wait_for(k, 30.0) is None:
            raise RuntimeError(f"only {group.done} of {k} messages ran within 30 s")
        after = wal_syncs(ctx.admin_url)
        if wal is not None and before is not None and after is not None:
            wal.append((after[0] - before[0], after[1] - before[1]))
        started = list(group.shared.started)
        return [(started[i] - committed[i]) * 1000 for i in range(k)]
    finally:
        group.close()


def _sync_note(wal: list[tuple[int, float]]) -> str:
    """The server's mean WAL sync during these sends (the disk's share of a claim's commit)."""
    count = sum(n for n, _ in wal)
    ms = sum(t for _, t in wal)
    return f"; WAL sync {ms / count:.2f} ms mean" if count and ms else ""


def run(ctx: Context) -> dict[str, Any]:
    k = 10 if ctx.smoke else 100 if ctx.quick else 200
    samples: dict[str, list[float]] = {}
    syncs: dict[str, list[tuple[int, float]]] = {}
    errors: dict[str, list[str]] = {}
    for run_no in range(ctx.runs):
        for label, system, opts, how in CASES:
            if system not in ctx.systems:
                continue
            try:
                wal = syncs.setdefault(label, [])
                lat = latency_once(ctx, system, opts, how, k, wal)
                samples.setdefault(label, []).extend(lat)
                print(
                    f"  latency run {run_no + 1} {label}: p50 {percentile(lat, 50):.2f} ms "
                    f"p99 {percentile(lat, 99):.2f} ms{_sync_note(wal[-1:])}",
                    flush=True,
                )
            except Exception as e:
                errors.setdefault(label, []).append(ctx.failed(f"latency run {run_no + 1} {label}", e))
    rows = []
    for label, _, _, _ in CASES:
        lat = samples.get(label)
        if not lat:
            err = "; ".join(sorted(set(errors.get(label, ["not run"]))))[:100]
            rows.append([label, "-", "-", "-", "-", err])
            continue
        rows.append(
            [
                label,
                str(len(lat)),
                f"{percentile(lat, 50):.2f}",
                f"{percentile(lat, 95):.2f}",
                f"{percentile(lat, 99):.2f}",
                f"max {max(lat):.1f}{_sync_note(syncs.get(label, []))}",
            ]
        )
    table = markdown_table(["system / mode", "samples", "p50 ms", "p95 ms", "p99 ms", "note"], rows)
    return {
        "k_per_run": k,
        "spacing_ms": SPACING_MS,
        "table": table,
        "raw_percentiles": {
            label: {p: percentile(v, p) for p in (50, 95, 99)} for label, v in samples.items()
        },
    }
