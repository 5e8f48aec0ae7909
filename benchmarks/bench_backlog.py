"""Scenario 4 (backlog): drain rate of our broker with 10k / 100k / 1M messages pending.

For a backlog of S rows the table holds, when the drain starts: M due messages
of the drained queue ``dpo_bench`` (M = 5,000 for S = 10k, S / 2 below, else 10,000), and
S - M others, half of them delayed by an hour on ``dpo_bench`` and half due on
three other queues, written interleaved in id order.  A 1 x 8 ``Worker``
drains ``dpo_bench`` until its M due messages have run.  The table is freshly
filled (no ANALYZE, autovacuum off for its partitions during the fill) so the claim
runs with no planner statistics, which is where a peer drains 3x slower;
``EXPLAIN`` of the claim is recorded then, and again after ``ANALYZE``.  Each run prints
the WAL written per message and, where ``pg_stat_statements`` is loaded (the private
server), the server's time in the worker's statements during the drain.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from dramatiq_pg_outbox._queries import queries_for_schema

from .bench_common import DEFAULT_CAP_S, OURS, Context, Series, fmt_rate, markdown_table
from .bench_systems import ACTOR, QUEUE, WorkerGroup, install, make_message

OTHER_QUEUES = ("dpo_bench_a", "dpo_bench_b", "dpo_bench_c")
FILL_BATCH = 10_000


def set_autovacuum(conn: psycopg.Connection[Any], *, enabled: bool) -> None:
    """Turn autovacuum off (or back to the server's setting) on every partition of ``messages``.

    ``messages`` is partitioned (the message ring, migration 0013): PostgreSQL refuses
    storage parameters such as ``autovacuum_enabled`` on a partitioned table, and
    autovacuum works on the leaf partitions, so the setting goes on each of them.
    """
    leaves = conn.execute(
        "SELECT relid::regclass::text FROM pg_partition_tree('dramatiq.messages') WHERE isleaf"
    ).fetchall()
    for (leaf,) in leaves:
        if enabled:
            conn.execute(f"ALTER TABLE {leaf} RESET (autovacuum_enabled)")
        else:
            conn.execute(f"ALTER TABLE {leaf} SET (autovacuum_enabled = false)")


def fill(url: str, size: int, due: int) -> float:
    """Write the backlog with COPY; returns seconds taken."""
    payload = make_message(0).encode()
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        set_autovacuum(conn, enabled=False)
        with conn.cursor() as cur:
            with cur.copy(
                "COPY dramatiq.messages (queue_name, actor_name, message_id, next_attempt_at, payload) "
                "FROM STDIN"
            ) as cp:
                # Interleave: spread the due rows evenly among the others.
                step = max(1, size // max(due, 1))
                written_due = 0
                for i in range(size):
                    if written_due < due and (i % step == 0 or size - i <= due - written_due):
                        msg = make_message(written_due)
                        written_due += 1
                        cp.write_row((QUEUE, ACTOR, msg.message_id, "now", msg.encode()))
                    elif (i - written_due) % 2 == 0:
                        cp.write_row((QUEUE, ACTOR, f"d{i}", later, payload))
                    else:
                        q = OTHER_QUEUES[i % len(OTHER_QUEUES)]
                        cp.write_row((q, ACTOR, f"o{i}", "now", payload))
    return time.perf_counter() - t0


def explain(url: str, analyze: bool) -> str:
    """EXPLAIN of the broker's own claim statement (a claim of 64, as a 1 x 8 worker makes)."""
    claim = queries_for_schema("dramatiq")["claim"]
    params = {
        "queue_name": QUEUE, "limit": 64, "lease": uuid.uuid4(), "owner": uuid.uuid4(),
        "consumers": 1, "rank": 0, "look_ahead": 64, "from_at": None, "from_id": None,
    }  # fmt: skip
    with psycopg.connect(url) as conn:
        opts = "(ANALYZE, BUFFERS, COSTS OFF, TIMING OFF)" if analyze else "(COSTS OFF)"
        rows = conn.execute(f"EXPLAIN {opts} {claim}", params).fetchall()
        conn.rollback()  # EXPLAIN ANALYZE really claimed: undo it
    return "\n".join(r[0] for r in rows)


def table_stats(url: str) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT sum(n_live_tup), sum(n_dead_tup), max(last_analyze), max(last_autoanalyze), "
            "sum(n_mod_since_analyze) FROM pg_stat_user_tables "
            "WHERE relid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages'))"
        ).fetchone()
        reltuples = conn.execute(
            "SELECT sum(greatest(reltuples, 0)) FROM pg_class "
            "WHERE oid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages'))"
        ).fetchone()
    keys = ("n_live_tup", "n_dead_tup", "last_analyze", "last_autoanalyze", "n_mod_since_analyze")
    out = dict(zip(keys, row or (), strict=False))
    out["reltuples"] = reltuples[0] if reltuples else None
    return out


def autovacuums(url: str) -> int:
    """Autovacuum and autoanalyze passes over the partitions of ``messages`` so far."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_user_tables "
            "WHERE relid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages'))"
        ).fetchone()
    return int(row[0]) if row else 0


def wal_position(url: str) -> int:
    """The server's current WAL write position, in bytes (``pg_current_wal_lsn()``).

    A backlog's due rows each on a page of their own make every claim dirty one page per
    row, and the first change of a page after a checkpoint writes the whole page to the WAL
    (``full_page_writes``): the WAL written per message tells what the drain cost the disk.
    Read from the position, not ``pg_stat_wal``, whose counters a backend reports at most
    once a second.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


#: Statements named in a drain's server-time summary, by a fragment of their text.
STATEMENTS = (
    ("claim", "WITH candidates AS"),
    ("ack", "WITH done AS"),
    ("rescue", "WITH stuck AS"),
    ("orphan check", "WITH orphans AS"),
)


#: The worker's statements in ``pg_stat_statements``, with their JIT counters (PostgreSQL 15 and later).
STATEMENT_TIMES = (
    "SELECT s.query, s.calls, s.total_exec_time, s.shared_blks_read, s.shared_blks_dirtied, "
    "s.shared_blks_written, s.jit_functions, "
    "s.jit_generation_time + s.jit_inlining_time + s.jit_optimization_time + s.jit_emission_time "
    "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
    "WHERE d.datname = current_database() ORDER BY s.total_exec_time DESC"
)
#: The same before PostgreSQL 15, which does not count JIT there.
STATEMENT_TIMES_14 = STATEMENT_TIMES.replace(
    "s.jit_functions, "
    "s.jit_generation_time + s.jit_inlining_time + s.jit_optimization_time + s.jit_emission_time",
    "NULL::bigint, NULL::float8",
)


def reset_statements(url: str) -> bool:
    """Empty ``pg_stat_statements`` (created in the database if needed); False without it."""
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
    except psycopg.Error:  # not in shared_preload_libraries (a server given by --pg-url)
        return False
    return True


def drain_statements(url: str) -> str:
    """The server's time in the worker's statements since :func:`reset_statements`, costliest first.

    Read once the worker process has stopped, so that a statement that ran during the drain
    and ended after it is counted (a pass of the rescuer that started during the drain).

    Per statement: calls, total and mean execution ms, the shared blocks read from outside
    shared buffers, dirtied and written out, and what JIT compiled, if anything
    (``pg_stat_statements``): where a drain among many pending rows spends the server's time
    that a drain among few does not.
    """
    with psycopg.connect(url, autocommit=True) as conn:
        query = STATEMENT_TIMES if conn.info.server_version >= 150000 else STATEMENT_TIMES_14
        rows = conn.execute(query).fetchall()
    parts = []
    for query, calls, total, read, dirtied, written, jit_functions, jit_ms in rows:
        name = next((n for n, fragment in STATEMENTS if fragment in query), None)
        if name is not None:
            compiled = f", JIT {jit_functions:,} functions {jit_ms:,.0f} ms" if jit_functions else ""
            parts.append(
                f"{name} {calls:,} calls {total:,.0f} ms ({total / max(calls, 1):.2f} ms each; "
                f"blocks read {read:,}, dirtied {dirtied:,}, written {written:,}{compiled})"
            )
    return "; ".join(parts)


def backlog_once(ctx: Context, size: int, *, record_explain: bool) -> dict[str, Any]:
    due = min(5_000, size // 2) if size <= 10_000 else 10_000
    dbname = "bench_backlog_ours"
    url = ctx.db_url(dbname)
    install(OURS, ctx.admin_url, dbname, url)
    fill_s = fill(url, size, due)
    result: dict[str, Any] = {"size": size, "due": due, "fill_s": round(fill_s, 1)}
    if record_explain:
        result["stats_before_analyze"] = table_stats(url)
        result["explain_fresh"] = explain(url, analyze=True)
    with psycopg.connect(url, autocommit=True) as conn:  # the drain runs with normal autovacuum
        set_autovacuum(conn, enabled=True)
    group = WorkerGroup(OURS, url, processes=1, threads=8)
    try:
        group.start()
        vacuums = autovacuums(url)
        wal_before = wal_position(ctx.admin_url)
        profiled = reset_statements(url)
        t0 = group.go()
        t1 = group.wait_for(due, DEFAULT_CAP_S)
        result["rate"] = due / (t1 - t0) if t1 else None
        if t1:
            result["wal_bytes_per_message"] = round((wal_position(ctx.admin_url) - wal_before) / due)
        # Autovacuum passes over the partitions that ended during the drain (they share its CPUs).
        result["autovacuums"] = autovacuums(url) - vacuums
    finally:
        group.close()
    if profiled:  # once the worker has stopped: a statement still running at the drain's end counts
        result["statements"] = drain_statements(url)
    if record_explain:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ANALYZE dramatiq.messages")
        result["explain_analyzed"] = explain(url, analyze=True)
    return result


def run(ctx: Context) -> dict[str, Any]:
    default_sizes = "2000" if ctx.smoke else "10000,100000"
    sizes = [int(x) for x in os.environ.get("BENCH_BACKLOG_SIZES", default_sizes).split(",")]
    if OURS not in ctx.systems:
        return {"table": "not run (our broker not selected)"}
    series: dict[int, Series] = {}
    explains: dict[int, dict[str, Any]] = {}
    if not ctx.smoke:
        backlog_once(ctx, 10_000, record_explain=False)  # untimed warm-up (cold caches, new worker)
    for run_no in range(ctx.runs):
        for size in sizes:
            if size >= 1_000_000 and run_no > 0:
                continue  # one run of the 1M backlog (the fill alone takes ~30 s)
            s = series.setdefault(size, Series())
            try:
                res = backlog_once(ctx, size, record_explain=run_no == 0)
                if res["rate"] is None:
                    s.errors.append(
                        ctx.failed(f"backlog run {run_no + 1} size {size:,}", "not drained within the cap")
                    )
                else:
                    s.values.append(res["rate"])
                if run_no == 0:
                    explains[size] = res
                print(
                    f"  backlog run {run_no + 1} size {size:,}: {fmt_rate(res['rate'])} msgs/s "
                    f"(autovacuum passes ended during the drain: {res.get('autovacuums')}; "
                    f"WAL written per message: {res.get('wal_bytes_per_message')} bytes)",
                    flush=True,
                )
                if res.get("statements"):
                    print(f"    server time during the drain and the stop: {res['statements']}", flush=True)
            except Exception as e:
                s.errors.append(ctx.failed(f"backlog run {run_no + 1} size {size:,}", e))
    base = series.get(sizes[0])
    rows = []
    for size in sizes:
        s = series[size]
        ratio = f"{s.median / base.median:.2f}x" if s.median and base and base.median else "-"
        rows.append([f"{size:,}", str(len(s.values)), fmt_rate(s.median), s.spread(), ratio])
    table = markdown_table(
        ["pending rows", "runs", "drain msgs/s (median, 1x8)", "min-max", f"vs {sizes[0]:,}"], rows
    )
    explain_text = []
    for size, res in explains.items():
        explain_text.append(
            f"### backlog {size:,}: fresh, before ANALYZE (stats: {res.get('stats_before_analyze')})\n"
            f"{res.get('explain_fresh')}\n\n### backlog {size:,}: after the drain and ANALYZE\n"
            f"{res.get('explain_analyzed')}"
        )
    return {"table": table, "explain": "\n\n".join(explain_text), "runs": explains}
