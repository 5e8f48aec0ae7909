"""Run the benchmark suite: ``python -m benchmarks.run [--quick] [--scenarios drain,enqueue,...]``.

Scenarios (issue 5): drain (+ connections), enqueue, latency, backlog, sustained;
(issue 8): delay (due time -> actor start of delayed messages and retries);
(issue 9): prune (retention of a large history, DELETE vs DROP PARTITION);
(issue 33): history_search (the dashboard's history search on 10 million rows);
(issue 10): relay (outbox + relay to RabbitMQ vs publishing after commit);
(issue 19): rate_limits (acquisitions per second of the rate-limiter backends), priorities
(the claim with priorities against the claim before them, EXPLAIN and drains), migrate
(seconds per million history rows of the 0007 rewrite);
(issue 35): concurrency (the keyed drain against the unkeyed one and Dramatiq's
ConcurrentRateLimiter; fair claims: small keys behind one big key's backlog);
(issue 37): outbox_send (one send() in an application transaction against the bare
transaction, for each notify mode: wall ratio, CPU and round trips per transaction), queues (one
worker process of 1, 4 and 16 queues: drain, and the statements and CPU of its idle polls);
(issue 21): spark (the data source's batch write against a JDBC append, on local[2] and on a
standalone cluster; a rate stream's rows per second and latency).
Every system of a scenario is measured in the same run, on the same machine,
against a durable PostgreSQL (fsync and synchronous_commit on).  By default a
private server is started (``ThrowawayPostgres`` with pg_stat_statements);
``--pg-url`` uses an existing one instead (each system gets its own database).
Results are printed as Markdown tables and saved as JSON under ``out/``.

``--smoke`` checks that every scenario still runs, not how fast: each one once, on its
smallest input, with our broker alone unless ``--systems`` names others (a scenario
whose prerequisite is missing, RabbitMQ for ``relay`` or Java for ``spark``, says
so and is skipped).  It exits 1 naming each scenario that raised or recorded a
failed measurement (``.ci/run`` runs it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

from .bench_common import ALL_SYSTEMS, OURS, Context, machine_notes, postgres_for_benchmarks, save_json

SCENARIOS = (
    "drain",
    "enqueue",
    "latency",
    "backlog",
    "sustained",
    "delay",
    "prune",
    "history_search",
    "relay",
    "rate_limits",
    "priorities",
    "migrate",
    "spark",
    "concurrency",
    "outbox_send",
    "queues",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller counts, 2 runs")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check that each scenario runs: 1 run on its smallest input, our broker only by default; "
        "exit 1 naming the scenarios that failed",
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    parser.add_argument(
        "--systems", default=None, help=f"comma-separated subset (default: all; with --smoke: {OURS})"
    )
    parser.add_argument("--runs", type=int, default=None, help="repetitions (default 3, quick 2)")
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL"), help="admin URL of a server")
    parser.add_argument("--backlog-sizes", default=None, help="e.g. 10000,100000,1000000")
    parser.add_argument("--sustained-seconds", type=int, default=None)
    parser.add_argument("--sustained-rate", type=int, default=None, help="messages per second")
    parser.add_argument("--prune-rows", type=int, default=None, help="history rows of prune (10000000)")
    parser.add_argument(
        "--history-rows", type=int, default=None, help="history rows of history_search (10000000)"
    )
    parser.add_argument("--drain-messages", type=int, default=None, help="messages per drain (20000)")
    parser.add_argument(
        "--queues-messages", type=int, default=None, help="messages per drain of queues (20000; smoke 480)"
    )
    parser.add_argument("--migrate-rows", type=int, default=None, help="history rows of migrate (1000000)")
    parser.add_argument("--spark-rows", type=int, default=None, help="rows of spark's batch (1000000)")
    parser.add_argument(
        "--concurrency-messages", type=int, default=None, help="messages of the keyed drain (100000)"
    )
    parser.add_argument(
        "--fair-big", type=int, default=None, help="the big key's messages in concurrency's fairness (200000)"
    )
    parser.add_argument("--out", default="out/benchmarks", help="directory of the JSON results")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    default_systems = (OURS,) if args.smoke else ALL_SYSTEMS
    systems = tuple(s for s in args.systems.split(",") if s) if args.systems else default_systems
    for s in systems:
        if s not in ALL_SYSTEMS:
            parser.error(f"unknown system {s!r}; choose from {', '.join(ALL_SYSTEMS)}")
    runs = args.runs or (1 if args.smoke else 2 if args.quick else 3)
    if args.backlog_sizes:
        os.environ["BENCH_BACKLOG_SIZES"] = args.backlog_sizes
    if args.sustained_seconds:
        os.environ["BENCH_SUSTAINED_SECONDS"] = str(args.sustained_seconds)
    if args.sustained_rate:
        os.environ["BENCH_SUSTAINED_RATE"] = str(args.sustained_rate)
    if args.drain_messages:
        os.environ["BENCH_DRAIN_MESSAGES"] = str(args.drain_messages)
    if args.queues_messages:
        os.environ["BENCH_QUEUES_MESSAGES"] = str(args.queues_messages)
    if args.migrate_rows:
        os.environ["BENCH_MIGRATE_ROWS"] = str(args.migrate_rows)
    if args.spark_rows:
        os.environ["BENCH_SPARK_ROWS"] = str(args.spark_rows)
    if args.concurrency_messages:
        os.environ["BENCH_CONCURRENCY_MESSAGES"] = str(args.concurrency_messages)
    if args.fair_big:
        os.environ["BENCH_FAIR_BIG"] = str(args.fair_big)
    if args.prune_rows:
        os.environ["BENCH_PRUNE_ROWS"] = str(args.prune_rows)
    if args.history_rows:
        os.environ["BENCH_HISTORY_ROWS"] = str(args.history_rows)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    failed: dict[str, str] = {}  # scenario -> what failed
    outcomes: dict[str, str] = {}  # scenario -> "ok (12.3 s)", "skipped: ...", "FAILED"
    with postgres_for_benchmarks(args.pg_url) as admin_url:
        ctx = Context(
            admin_url=admin_url,
            runs=runs,
            quick=args.quick or args.smoke,
            smoke=args.smoke,
            systems=systems,
            out_dir=args.out,
        )
        report: dict[str, object] = {
            "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine_notes(admin_url),
        }
        print(f"# machine: {report['machine']}", flush=True)
        for name in scenarios:
            print(f"\n## {name}", flush=True)
            started = time.monotonic()
            before = len(ctx.failures)
            try:
                module = importlib.import_module(f"benchmarks.bench_{name}")
                result = module.run(ctx)
            except Exception as e:
                if not args.smoke:
                    raise
                traceback.print_exc()
                result = {"error": ctx.failed(name, e)}
            result["seconds"] = round(time.monotonic() - started, 1)
            report[name] = result
            if len(ctx.failures) > before:
                failed[name] = "; ".join(ctx.failures[before:])
                outcomes[name] = f"FAILED ({result['seconds']} s)"
            elif result.get("skipped"):
                print(f"  skipped: {result['skipped']}", flush=True)
                outcomes[name] = f"skipped: {result['skipped']}"
            else:
                outcomes[name] = f"ok ({result['seconds']} s)"
            for key, value in result.items():
                if isinstance(value, str) and ("table" in key or key in ("explain", "floor")):
                    print(f"\n{key}:\n{value}", flush=True)
            save_json(os.path.join(args.out, f"results-{stamp}.json"), report)
    print(f"\nsaved {os.path.join(args.out, f'results-{stamp}.json')}")
    if args.smoke:
        for name, outcome in outcomes.items():
            print(f"smoke {name}: {outcome}", flush=True)
        if failed:
            print("smoke run failed: " + "; ".join(f"{k} ({v})" for k, v in failed.items()), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
