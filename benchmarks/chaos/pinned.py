"""Scenario 10 of the chaos suite: a long transaction pins the MVCC horizon (issue 20).

While a ``REPEATABLE READ`` transaction stays open, vacuum can remove no row
version that died after it began: the claims and acks of the hot table leave
dead tuples in its heap and in its indexes, and every claim wades through
more of them.  The scenario offers ``RATE`` messages per second (outbox
transactions of 100 messages with their business rows) to one ``dramatiq``
worker process of 8 threads running a no-op actor, on a private server with
PostgreSQL's default autovacuum, and holds the horizon for ``PINNED`` seconds,
twice: with a transaction that read another table, and with one that read the
messages table itself.  Every ``SAMPLE`` seconds it records offered and drained
messages per second, the backlog, the hot table's size (heap and indexes), its
live and dead tuples, and after 0, 2, 5 and 10 minutes pinned
``EXPLAIN (ANALYZE, BUFFERS)`` of a claim of 64 from a consumer's watermark, of
a sweep of 64 (a claim from the queue's first entry) and of an ack of 64 (each
in a transaction rolled back).  Lost: a sent message that is not in
history as completed once the load stops and the queue drains.

``python -m benchmarks.chaos --scenarios 10`` (``--quick``: 2 minutes pinned).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from dramatiq_pg_outbox._queries import queries_for_schema
from dramatiq_pg_outbox._runtime import fence_params

from .harness import QUEUE, cluster, wait_until
from .scenarios import Context, Result

#: Messages offered per second, and per outbox transaction.
RATE = 2_000
BATCH = 100
#: Seconds between samples.
SAMPLE = 60.0
#: EXPLAIN at the samples taken after this many minutes pinned (0: the last one before).
EXPLAIN_AT = (0, 2, 5, 10)
#: What the long transaction reads first: another table, or the hot table itself.
READS = {"other": "SELECT count(*) FROM chaos_pin", "messages": "SELECT count(*) FROM dramatiq.messages"}


@dataclass
class Sample:
    """One interval of the run."""

    at_s: float
    pinned: bool
    offered: float
    drained: float
    backlog: int
    table_mb: float
    live: int
    dead: int
    explain: dict[str, Any] = field(default_factory=dict)


def _explain(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> dict[str, Any]:
    """Execution ms, shared buffers hit+read and top-node rows of one statement, rolled back."""
    with conn.transaction(force_rollback=True):
        row = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", params).fetchone()
    assert row is not None
    plan = (json.loads(row[0]) if isinstance(row[0], str) else row[0])[0]
    top = plan["Plan"]
    return {
        "ms": round(float(plan["Execution Time"]), 3),
        "buffers": int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0)),
    }


def explain_claim_and_ack(url: str) -> dict[str, Any]:
    """EXPLAIN of a claim of 64 from a watermark, of a sweep of 64 and of the ack of 64 claimed rows.

    The watermark is what a consumer's would be (see WATERMARK_LAG_MS in broker/consumer.py):
    the claim-order key of the latest message that finished a second ago or more.  All rolled back.
    """
    queries = queries_for_schema("dramatiq")
    lease, owner = uuid.uuid4(), uuid.uuid4()
    claim = {
        "queue_name": QUEUE, "limit": 64, "lease": lease, "owner": owner,
        "consumers": 1, "rank": 0, "look_ahead": 64, "from_at": None, "from_id": None,
    }  # fmt: skip
    with psycopg.connect(url) as conn:
        mark = conn.execute(
            "SELECT enqueued_at, id FROM dramatiq.history "
            "WHERE finished_at <= now() - interval '1 second' ORDER BY finished_at DESC, id DESC LIMIT 1"
        ).fetchone()
        out = {"sweep": _explain(conn, queries["claim"], claim)}
        if mark is not None:
            out["claim"] = _explain(conn, queries["claim"], {**claim, "from_at": mark[0], "from_id": mark[1]})
        with conn.transaction(force_rollback=True):
            rows = conn.execute(queries["claim"], claim).fetchall()
            ids = [r[0] for r in rows if r[0] is not None]
            if ids:
                out["ack"] = _explain(conn, queries["ack"], fence_params([(i, lease) for i in ids]))
    return out


def _stats(conn: psycopg.Connection[Any]) -> tuple[int, float, int, int, int]:
    """(backlog, table MB with indexes, live tuples, dead tuples, completed in history).

    The table's figures are summed over its partitions (its own are zero once it is partitioned).
    """
    row = conn.execute(
        "SELECT (SELECT count(*) FROM dramatiq.messages), "
        "(SELECT sum(pg_total_relation_size(t.relid)) FROM pg_partition_tree('dramatiq.messages') AS t) "
        "/ 1048576.0, "
        "coalesce(sum(s.n_live_tup), 0), coalesce(sum(s.n_dead_tup), 0), "
        "(SELECT count(*) FROM dramatiq.history WHERE state = 'completed') "
        "FROM pg_stat_user_tables AS s "
        "WHERE s.relid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages'))"
    ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1]), int(row[2]), int(row[3]), int(row[4])


def run_pinned(ctx: Context, kind: str, pinned_s: float, before_s: float, after_s: float) -> Result:
    """One run: load, then the horizon pinned by a transaction that read ``kind`` ("other" or "messages")."""
    sent = [0]
    stop = threading.Event()

    def produce() -> None:
        started = time.monotonic()
        tick = 0
        while not stop.is_set():
            keys = [f"p{kind[0]}{sent[0] + j:08d}" for j in range(BATCH)]
            ctx.producer.send(keys, batch=BATCH)
            sent[0] += BATCH
            tick += 1
            time.sleep(max(0.0, started + tick * BATCH / RATE - time.monotonic()))

    samples: list[Sample] = []
    ctx.db.rows("CREATE TABLE IF NOT EXISTS chaos_pin (x int)")
    steps = round((before_s + pinned_s + after_s) / SAMPLE)
    pin_step, unpin_step = round(before_s / SAMPLE), round((before_s + pinned_s) / SAMPLE)
    with psycopg.connect(ctx.url, autocommit=True) as probe:
        with cluster(ctx.url, ctx.logdir, hosts=1, processes=1, threads=8, env={"CHAOS_RECORD": "0"}):
            thread = threading.Thread(target=produce, daemon=True)
            thread.start()
            holder: psycopg.Connection[Any] | None = None
            t0 = last_t = time.monotonic()
            last_sent, last_done = sent[0], _stats(probe)[4]
            for step in range(steps + 1):
                if step == pin_step:
                    holder = psycopg.connect(ctx.url)
                    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                    holder.execute(READS[kind])
                elif step == unpin_step and holder is not None:
                    holder.rollback()
                    holder.close()
                    holder = None
                if step == steps:
                    break
                time.sleep(max(0.0, t0 + (step + 1) * SAMPLE - time.monotonic()))
                at = time.monotonic()
                backlog, mb, live, dead, done = _stats(probe)
                sample = Sample(
                    at_s=round(at - t0),
                    pinned=holder is not None,
                    offered=round((sent[0] - last_sent) / (at - last_t)),
                    drained=round((done - last_done) / (at - last_t)),
                    backlog=backlog,
                    table_mb=round(mb, 1),
                    live=live,
                    dead=dead,
                )
                if step + 1 - pin_step in EXPLAIN_AT:
                    sample.explain = explain_claim_and_ack(ctx.url)
                samples.append(sample)
                print(f"    {kind}: {sample}", flush=True)
                last_sent, last_done, last_t = sent[0], done, at
            stop.set()
            thread.join()
            wait_until(ctx.drained, 600, "the queue to drain", poll=1)
    print(f"\n10. pinned horizon, long transaction reading {kind}:\n{minute_table(samples)}\n", flush=True)
    completed = int(
        ctx.db.value("SELECT count(DISTINCT message_id) FROM dramatiq.history WHERE state = 'completed'")
    )
    lost = sent[0] - completed
    pinned = [s for s in samples if s.pinned]
    worst = min((s.drained for s in pinned), default=0.0)
    return Result(
        f"10. pinned horizon ({kind}, {pinned_s / 60:.0f} min)",
        sent[0],
        lost,
        max(0, completed - sent[0]),
        f"drain while pinned: worst minute {worst:.0f} msg/s of {RATE} offered",
        f"backlog at the end of the pin {pinned[-1].backlog if pinned else 0}, "
        f"hot table {max((s.table_mb for s in samples), default=0):.0f} MB at most",
        lost == 0,
        extra={"samples": [s.__dict__ for s in samples]},
    )


def _cell(measure: dict[str, Any] | None) -> str:
    return "" if not measure else f"{measure['ms']} ({measure['buffers']:,})"


def minute_table(samples: list[Sample]) -> str:
    """The samples as a markdown table (docs/chaos.md)."""
    lines = [
        "| minute | pinned | offered msg/s | drained msg/s | backlog | hot table MB | live | dead "
        "| claim ms (buffers) | sweep ms (buffers) | ack ms (buffers) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(
            f"| {s.at_s / 60:.0f} | {'yes' if s.pinned else ''} | {s.offered:,.0f} | {s.drained:,.0f} "
            f"| {s.backlog:,} | {s.table_mb:,.0f} | {s.live:,} | {s.dead:,} "
            + " | ".join(["", *(_cell(s.explain.get(k)) for k in ("claim", "sweep", "ack")), ""]).strip()
        )
    return "\n".join(lines)


def pinned_horizon(ctx: Context) -> Result:
    """Both kinds of long transaction, one after the other (the database reset in between)."""
    pinned_s = 120.0 if ctx.quick else 600.0
    results = []
    for kind in ("other", "messages"):
        ctx.db.reset()
        results.append(run_pinned(ctx, kind, pinned_s, before_s=60.0, after_s=120.0))
    first, second = results
    return Result(
        f"10. pinned horizon ({pinned_s / 60:.0f} min, both kinds)",
        first.messages + second.messages,
        first.lost + second.lost,
        first.duplicates + second.duplicates,
        f"{first.recovery}; {second.recovery}",
        f"other: {first.notes}; messages: {second.notes}",
        first.ok and second.ok,
        extra={"other": first.extra, "messages": second.extra},
    )
