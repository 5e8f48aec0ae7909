"""Wake-up of a pipeline's next step, idle and under load (issue 37, part 1).

``python -m benchmarks.bench_next_step [--runs 3] [--pipelines 200] [--load 150000]
[--opts max_flush_delay=5] [--pg-url URL]``

One worker process (8 threads) consumes two queues: ``steps``, where the parent
runs pipelines of two steps (``first | second``), one every 20 ms, and ``load``, a
backlog of no-op messages (actor priority 100, so Dramatiq's worker runs a step
before any load message it holds). Measured per pipeline: from the moment the
first step's actor returns to the moment the second step's actor starts
(``time.time()`` in the worker process), which covers the flush window of the
first step's ack (the next step is written with it, in one transaction), the
NOTIFY, the claim and the hand-off. Two cases per run: ``idle`` (no load) and
``load`` (the pipelines run while the backlog drains; the run says how much of
the backlog was left when the last pipeline ran, which must be > 0).

A next step is written by the flusher with the NOTIFY in its transaction in
every ``notify`` mode but ``off`` (``after_commit`` concerns ``outbox()`` sends), so
one mode is measured. The database: a fresh one on ``--pg-url`` (default: the
local server), dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import time
from typing import Any

from .bench_common import drop_database, percentile, recreate_database

THREADS = 8
SPACING_MS = 20
DBNAME = "bench_next_step"
LEFT = "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'load'"


def _worker(url: str, opts: dict[str, Any], k: int, ended: Any, started: Any, ready: Any, stop: Any) -> None:
    logging.basicConfig(level=logging.WARNING)
    import dramatiq
    from dramatiq import Worker

    from dramatiq_pg_outbox import PostgresBroker

    broker = PostgresBroker(url=url, **opts)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="load", priority=100, max_retries=0)
    def load(i: int) -> None:
        pass

    @dramatiq.actor(queue_name="steps", max_retries=0)
    def first(i: int) -> None:
        ended[i] = time.time()

    @dramatiq.actor(queue_name="steps", max_retries=0)
    def second(i: int) -> None:
        started[i] = time.time()

    worker = Worker(broker, worker_threads=THREADS, worker_timeout=100)
    worker.start()
    ready.set()
    stop.wait()
    os._exit(0)  # the load backlog is left to the dropped database


def once(admin_url: str, url: str, opts: dict[str, Any], k: int, load: int) -> tuple[list[float], int]:
    """One case: latencies (ms) of ``k`` pipelines, and how many load messages were left after the last."""
    import dramatiq

    from dramatiq_pg_outbox import PostgresBroker, upgrade

    recreate_database(admin_url, DBNAME)
    upgrade(url, schema="dramatiq")
    broker = PostgresBroker(url=url)
    dramatiq.set_broker(broker)

    @dramatiq.actor(actor_name="load", queue_name="load", priority=100, max_retries=0)
    def load_actor(i: int) -> None:
        pass

    @dramatiq.actor(queue_name="steps", max_retries=0)
    def first(i: int) -> None:
        pass

    @dramatiq.actor(queue_name="steps", max_retries=0)
    def second(i: int) -> None:
        pass

    for start in range(0, load, 10_000):
        broker.enqueue_many([load_actor.message(i) for i in range(start, min(load, start + 10_000))])
    ctx = mp.get_context("spawn")
    ended, started = ctx.Array("d", k), ctx.Array("d", k)
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_worker, args=(url, opts, k, ended, started, ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the worker did not start")
        time.sleep(1.0 if not load else 0.5)  # idle: the worker's loops settle; load: the drain is under way
        for i in range(k):
            dramatiq.pipeline(
                [first.message(i), second.message_with_options(args=(i,), pipe_ignore=True)]
            ).run()
            time.sleep(SPACING_MS / 1000)
        left = 0
        if load:
            with broker.runtime.connection() as conn:
                row = conn.execute(
                    "SELECT count(*) FROM dramatiq.messages WHERE queue_name = 'load'"
                ).fetchone()
                left = int(row[0]) if row else 0
        deadline = time.monotonic() + 120
        while min(started[:]) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if min(started[:]) == 0:
            raise RuntimeError(f"only {sum(1 for s in started[:] if s)} of {k} next steps ran")
        return [(started[i] - ended[i]) * 1000 for i in range(k)], left
    finally:
        stop.set()
        proc.join(10)
        broker.close()
        drop_database(admin_url, DBNAME)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_next_step", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pipelines", type=int, default=200, help="pipelines per case (200)")
    parser.add_argument("--load", type=int, default=150_000, help="backlog of the load case (150000)")
    parser.add_argument("--opts", default="", help="broker options, e.g. max_flush_delay=5,flush_interval=5")
    parser.add_argument(
        "--pg-url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--out", default=None, help="a JSON file of the samples")
    args = parser.parse_args(argv)
    opts = {k: int(v) for k, v in (item.split("=") for item in args.opts.split(",") if item)}
    admin = args.pg_url
    url = admin.rsplit("/", 1)[0] + "/" + DBNAME
    samples: dict[str, list[float]] = {"idle": [], "load": []}
    print(f"# load average at start: {os.getloadavg()}; options {opts}", flush=True)
    for run_no in range(args.runs):
        for case in ("idle", "load"):
            lat, left = once(admin, url, opts, args.pipelines, args.load if case == "load" else 0)
            samples[case].extend(lat)
            note = f", load messages left after the last pipeline: {left}" if case == "load" else ""
            p50, p99 = percentile(lat, 50), percentile(lat, 99)
            print(
                f"  run {run_no + 1} {case}: p50 {p50:.2f} ms p99 {p99:.2f} ms"
                f"{note}; load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    for case, lat in samples.items():
        p50, p95, p99 = (percentile(lat, p) for p in (50, 95, 99))
        print(f"{case}: {len(lat)} samples, p50 {p50:.2f} ms, p95 {p95:.2f} ms, p99 {p99:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"opts": opts, "samples": samples}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
