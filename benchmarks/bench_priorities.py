"""Priorities (issue 19): the claim with ``broker_priority`` against the claim before it.

``python -m benchmarks.run --scenarios priorities`` measures, on our broker only:

1. ``claim``: ``EXPLAIN (ANALYZE, BUFFERS)`` of a claim of 64 on a backlog of
   100,000 rows (10,000 due on the drained queue, 45,000 of it delayed by an
   hour, 45,000 due on three other queues), ANALYZEd, each claim rolled back.
   Three claims on the same table, alternated: the claim of the baseline commit
   (``BENCH_PRIORITY_BASELINE``, default fa534d2: no priorities, read from git),
   the current ``claim`` (what a queue without prioritized rows runs) and
   ``claim_prioritized`` (what a queue with some runs).  Mixes: no message prioritized (what every existing
   user has), and 10% of the due messages with a priority of 1 to 9.  Reported:
   median execution and planning time and shared buffers touched, and the
   current claim's plan.
2. ``drain``: a 1 x 8 worker drains 20,000 due messages, with no priority, 10%
   prioritized and all prioritized (1 to 9), in interleaved rounds; also the
   share of messages that started after a message of lower priority that was
   claimed later (inversions; 0 is perfect order, the 8 threads overlap).

The drain benchmark of ``benchmarks.ab`` compares whole commits (see
benchmarks/README.md, "Priorities").
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg

from dramatiq_pg_outbox._queries import STATEMENT_HEADER, queries_for_schema

from .bench_common import DEFAULT_CAP_S, OURS, Context, Series, fmt_rate, markdown_table
from .bench_systems import ACTOR, QUEUE, WorkerGroup, getenv_int, install, make_message

OTHER_QUEUES = ("dpo_bench_a", "dpo_bench_b", "dpo_bench_c")
BACKLOG = 100_000
DUE = 10_000
CLAIM_LIMIT = 64
CLAIM_REPEATS = 40
MIXES = (("none", 0.0), ("10% prioritized", 0.1))
DRAIN_MIXES = (("none", 0.0), ("10% prioritized", 0.1), ("all prioritized", 1.0))
ROOT = Path(__file__).resolve().parents[1]


def baseline_claim(rev: str) -> str:
    """The claim statement of commit ``rev`` (from git), for the schema ``dramatiq``."""
    text = subprocess.run(
        ["git", "show", f"{rev}:dramatiq_pg_outbox/queries.sql"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    parts = STATEMENT_HEADER.split(text)
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        if kind == "name" and name == "claim":
            lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
            return "\n".join(lines).strip().rstrip(";").replace("{schema}", '"dramatiq"')
    raise ValueError(f"no claim in {rev}:dramatiq_pg_outbox/queries.sql")


def fill(url: str, share: float, rng: random.Random, backlog: int = BACKLOG, due_rows: int = DUE) -> None:
    """The backlog (see the module docstring), ``share`` of the due rows with a priority 1-9."""
    payload = make_message(0).encode()
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE dramatiq.messages")
        with conn.cursor() as cur:
            with cur.copy(
                "COPY dramatiq.messages "
                "(queue_name, actor_name, message_id, next_attempt_at, payload, priority) FROM STDIN"
            ) as cp:
                due = 0
                for i in range(backlog):
                    priority = rng.randint(1, 9) if rng.random() < share else 0
                    if i % (backlog // due_rows) == 0 and due < due_rows:
                        due += 1
                        cp.write_row((QUEUE, ACTOR, f"m{i}", "now", payload, priority))
                    elif i % 2:
                        cp.write_row((QUEUE, ACTOR, f"d{i}", later, payload, 0))
                    else:
                        cp.write_row((OTHER_QUEUES[i % 3], ACTOR, f"o{i}", "now", payload, 0))
        conn.execute("VACUUM ANALYZE dramatiq.messages")


def _claim_params() -> dict[str, Any]:
    return {
        "queue_name": QUEUE,
        "limit": CLAIM_LIMIT,
        "lease": uuid.uuid4(),
        "owner": uuid.uuid4(),
        "consumers": 1,
        "rank": 0,
        "look_ahead": 64,
        "from_at": None,
        "from_id": None,
    }


def explain_once(conn: psycopg.Connection[Any], claim: str) -> tuple[float, float, int]:
    """(execution ms, planning ms, shared buffers hit + read) of one claim, rolled back."""
    with conn.transaction(force_rollback=True):
        row = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {claim}", _claim_params()).fetchone()
    plan = (row[0] if not isinstance(row[0], str) else json.loads(row[0]))[0]
    top = plan["Plan"]
    buffers = int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))
    return float(plan["Execution Time"]), float(plan["Planning Time"]), buffers


def plan_text(conn: psycopg.Connection[Any], claim: str) -> str:
    with conn.transaction(force_rollback=True):
        rows = conn.execute(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) {claim}", _claim_params())
        return "\n".join(r[0] for r in rows.fetchall())


def claim_case(ctx: Context, url: str, rev: str) -> tuple[str, dict[str, str]]:
    queries = queries_for_schema("dramatiq")
    claims = {"after: claim": queries["claim"], "after: claim_prioritized": queries["claim_prioritized"]}
    try:
        claims = {f"before ({rev})": baseline_claim(rev), **claims}
    except (OSError, subprocess.CalledProcessError) as e:  # no git, or a clone without that commit
        print(
            f"  priorities: the claim of {rev} is not in this checkout, compared with nothing ({e})",
            flush=True,
        )
    rng = random.Random(19)
    rows = []
    plans = {}
    # A smoke run: every claim runs, on a small backlog, twice.
    backlog, due, repeats = (5_000, 500, 2) if ctx.smoke else (BACKLOG, DUE, CLAIM_REPEATS)
    for mix, share in MIXES:
        fill(url, share, rng, backlog, due)
        measured: dict[str, list[tuple[float, float, int]]] = {name: [] for name in claims}
        with psycopg.connect(url) as conn:
            for claim in claims.values():  # warm-up
                explain_once(conn, claim)
            for _ in range(repeats):
                for name, claim in claims.items():
                    measured[name].append(explain_once(conn, claim))
            plans[mix] = plan_text(conn, claims["after: claim_prioritized" if share else "after: claim"])
        before = measured.get(f"before ({rev})")
        base = statistics.median(e for e, _, _ in before) if before else None
        for name, values in measured.items():
            execution = statistics.median(e for e, _, _ in values)
            rows.append(
                [
                    mix,
                    name,
                    f"{execution:.3f}",
                    f"{min(e for e, _, _ in values):.3f}-{max(e for e, _, _ in values):.3f}",
                    f"{statistics.median(p for _, p, _ in values):.3f}",
                    f"{statistics.median(b for _, _, b in values):.0f}",
                    f"{execution / base:.2f}x" if base else "-",
                ]
            )
            print(f"  priorities claim {mix} {name}: {execution:.3f} ms", flush=True)
    header = ["mix", "claim", "execution ms (median)", "min-max", "planning ms", "shared buffers"]
    header.append("vs before")
    return markdown_table(header, rows), plans


def drain_once(url: str, n: int, share: float, rng: random.Random) -> tuple[float | None, float]:
    """(messages per second, share of inversions) of one 1 x 8 drain of ``n`` messages."""
    priorities = [rng.randint(1, 9) if rng.random() < share else 0 for _ in range(n)]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE dramatiq.messages, dramatiq.history")
        with conn.cursor() as cur:
            with cur.copy(
                "COPY dramatiq.messages (queue_name, actor_name, message_id, payload, priority) FROM STDIN"
            ) as cp:
                for i, priority in enumerate(priorities):
                    msg = make_message(i)
                    cp.write_row((QUEUE, ACTOR, msg.message_id, msg.encode(), priority))
        conn.execute("VACUUM ANALYZE dramatiq.messages")
    group = WorkerGroup(OURS, url, processes=1, threads=8, slots=n)
    try:
        group.start()
        t0 = group.go()
        t1 = group.wait_for(n, DEFAULT_CAP_S)
        started = list(group.shared.started[:n])
    finally:
        group.close()
    rate = n / (t1 - t0) if t1 else None
    # Inversions: walking in start order, a message whose priority is above the lowest
    # priority already started has waited behind lower-priority work.
    order = sorted(range(n), key=lambda i: started[i])
    inverted = 0
    lowest = 10
    for i in order:
        if priorities[i] > lowest:
            inverted += 1
        lowest = min(lowest, priorities[i])
    return rate, inverted / n


def run(ctx: Context) -> dict[str, Any]:
    if OURS not in ctx.systems:
        return {"table": "not run (our broker not selected)"}
    rev = os.environ.get("BENCH_PRIORITY_BASELINE", "fa534d2")
    dbname = "bench_priorities_ours"
    url = ctx.db_url(dbname)
    install(OURS, ctx.admin_url, dbname, url)
    claim_table, plans = claim_case(ctx, url, rev)
    n = getenv_int("BENCH_DRAIN_MESSAGES", 500 if ctx.smoke else 5_000 if ctx.quick else 20_000)
    rng = random.Random(5)
    series: dict[str, Series] = {}
    inversions: dict[str, list[float]] = {}
    drain_once(url, 200 if ctx.smoke else 2_000, 0.0, rng)  # untimed warm-up
    for run_no in range(ctx.runs):
        for mix, share in DRAIN_MIXES:
            rate, inverted = drain_once(url, n, share, rng)
            s = series.setdefault(mix, Series())
            if rate is None:
                s.errors.append(
                    ctx.failed(f"priorities drain run {run_no + 1} {mix}", "not drained within the cap")
                )
            else:
                s.values.append(rate)
            inversions.setdefault(mix, []).append(inverted)
            print(f"  priorities drain run {run_no + 1} {mix}: {fmt_rate(rate)} msgs/s, "
                  f"{inverted:.2%} inverted", flush=True)  # fmt: skip
        time.sleep(0.5)
    base = series["none"].median
    rows = [
        [
            mix,
            fmt_rate(s.median),
            s.spread(),
            f"{s.median / base:.2f}x" if s.median and base else "-",
            f"{statistics.median(inversions[mix]):.2%}",
        ]
        for mix, s in series.items()
    ]
    drain_table = markdown_table(
        ["mix", "1x8 msgs/s (median)", "min-max", "vs none", "inverted (median)"], rows
    )
    return {
        "baseline": rev,
        "claim_table": claim_table,
        "drain_table": drain_table,
        "plans": plans,
        "messages": n,
        "runs": ctx.runs,
    }
