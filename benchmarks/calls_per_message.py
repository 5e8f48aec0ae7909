"""Python calls per drained message: ``python -m benchmarks.calls_per_message [--n 4000] [--runs 3]``.

A proxy of the workers' CPU per message that a busy machine does not blur: a real
``dramatiq.Worker`` (8 threads) drains ``--n`` prefilled messages of a no-op actor in
this process, with a profile hook on every thread (``sys.setprofile`` and
``threading.setprofile``) counting Python calls and calls of C functions, from the
worker's start until history holds every message.  The broker's loops (claim,
hand-off, flush, maintenance) are included; the counts vary a little between runs
(idle polls), so several runs are printed with their median.  CPU time per message
(``python -m benchmarks.profile_drain``) moved by up to a factor of two between
interleaved runs of the same revision on this project's 2-vCPU machines; these counts
move by a few percent.

Compare two revisions by running it in a worktree of each (``git worktree add
--detach /tmp/before REV``, then ``cd /tmp/before && PYTHONPATH=. python -m
benchmarks.calls_per_message``).  Each run uses its own database on a private
server (``ThrowawayPostgres``), or on ``--pg-url``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from types import FrameType
from typing import Any

import psycopg

from .bench_common import OURS, db_name, postgres_for_benchmarks
from .bench_systems import install


def count_calls(
    url: str, n: int, by_function: collections.Counter[str] | None = None
) -> tuple[float, float, float]:
    """(Python calls, C calls, seconds) per drained message, for ``n`` messages on the database at ``url``.

    With ``by_function``, also counts every call by its function (``module:qualname`` for
    Python functions, ``c:name`` for C functions) into it: slower, for ``--top``.
    """
    import dramatiq

    from dramatiq_pg_outbox import PostgresBroker

    broker = PostgresBroker(url=url)
    dramatiq.set_broker(broker)
    done = [0]
    lock = threading.Lock()

    @dramatiq.actor(broker=broker, queue_name="calls")
    def noop(i: int) -> None:
        with lock:
            done[0] += 1

    broker.enqueue_many([noop.message(i) for i in range(n)])
    counts: collections.Counter[str] = collections.Counter()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counts[event] += 1

    def hook_by_function(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            counts[event] += 1
            code = frame.f_code
            by_function[f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_qualname}"] += 1
        elif event == "c_call":
            counts[event] += 1
            by_function[f"c:{getattr(arg, '__qualname__', arg)}"] += 1

    worker = dramatiq.Worker(broker, worker_threads=8, worker_timeout=100)
    threading.setprofile(hook if by_function is None else hook_by_function)
    sys.setprofile(hook if by_function is None else hook_by_function)
    started = time.monotonic()
    try:
        worker.start()
        with psycopg.connect(url, autocommit=True) as conn:
            while conn.execute("SELECT count(*) FROM dramatiq.history").fetchone() != (n,):
                time.sleep(0.01)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        seconds = time.monotonic() - started
        worker.stop()
        broker.close()
    return counts["call"] / n, counts["c_call"] / n, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=4_000, help="messages drained per run (default 4,000)")
    parser.add_argument("--runs", type=int, default=3, help="runs, each on a fresh database (default 3)")
    parser.add_argument(
        "--pg-url", default=None, help="admin URL of a server to use (default: a private one)"
    )
    parser.add_argument(
        "--top",
        type=int,
        default=0,
        help="also print the K functions called most per message, over all runs (slower; default 0: none)",
    )
    args = parser.parse_args(argv)
    totals = []
    by_function: collections.Counter[str] | None = collections.Counter() if args.top else None
    with postgres_for_benchmarks(args.pg_url) as admin_url:
        dbname = db_name(OURS, "calls")
        url = admin_url.rsplit("/", 1)[0] + "/" + dbname
        print(f"## Python calls per drained message ({args.n:,} messages, 1 x 8 threads, in-process)")
        print()
        print("| run | Python calls | C calls | all | seconds |")
        print("|---|---|---|---|---|")
        for run in range(1, args.runs + 1):
            install(OURS, admin_url, dbname, url)
            python_calls, c_calls, seconds = count_calls(url, args.n, by_function)
            totals.append(python_calls + c_calls)
            row = (
                run,
                f"{python_calls:.1f}",
                f"{c_calls:.1f}",
                f"{python_calls + c_calls:.1f}",
                f"{seconds:.1f}",
            )
            print("| " + " | ".join(map(str, row)) + " |")
    print()
    print(f"median of all calls per message: {statistics.median(totals):.1f}")
    if by_function:
        print()
        print(f"| function (the {args.top} called most) | calls per message |")
        print("|---|---|")
        for name, calls in by_function.most_common(args.top):
            print(f"| `{name}` | {calls / (args.n * args.runs):.2f} |")


if __name__ == "__main__":
    main()
