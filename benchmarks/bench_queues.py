"""One worker process consuming Q queues (issue 37, part 3): drain and idle cost for Q = 1, 4, 16.

``python -m benchmarks.bench_queues [--queues 1,4,16] [--messages 20000] [--idle-seconds 10]
[--trees BEFORE,AFTER --rounds 2]``, or the scenario ``queues`` of ``python -m benchmarks.run``.

Per Q: one worker process (a real Dramatiq ``Worker``, 8 threads, one actor per queue, so
2 x Q consumers: each queue and its ``.DQ``) on a fresh database.

* drain: N no-op messages spread evenly over the Q queues, prefilled; time from "go" to
  the N-th actor start; whole-box CPU per message (``/proc/stat``, as bench_drain).
* idle: after the drain, 3 s to settle, then ``--idle-seconds`` with nothing to do:
  statements per second the database ran for that database (``pg_stat_statements``,
  all of them, and the claims alone), CPU per second of the worker process and of its
  PostgreSQL backends (``/proc/<pid>/stat``).

``--trees A,B`` runs the worker processes on the package of each tree in turn (the
package directory ``dramatiq_pg_outbox`` under each path goes first on the worker's
``sys.path``), A, B, A, B... for ``--rounds`` rounds, each Q in each round: the
before/after of a change, interleaved.  The harness (this file) is the same for both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from .bench_common import (
    Context,
    busy_jiffies,
    cpu_ms_per_message,
    db_name,
    fmt_rate,
    markdown_table,
    postgres_for_benchmarks,
    recreate_database,
)
from .bench_systems import Shared, getenv_int, record_start

#: Queue counts measured.
QUEUE_COUNTS = (1, 4, 16)
#: Worker threads of the one worker process.
THREADS = 8
#: Longest timed drain, in seconds.
DRAIN_CAP_S = 60.0
#: Seconds between the end of the drain and the idle window.
SETTLE_S = 3.0
#: Rows per prefill statement.
PREFILL_BATCH = 5_000


def queue_name(k: int) -> str:
    return f"dpo_q{k}"


def _worker(url: str, queues: int, shared: Shared, tree: str | None, pid_out: Any) -> None:
    """Body of the worker process: Q actors (one per queue), a Dramatiq Worker of THREADS threads."""
    if tree:
        sys.path.insert(0, tree)
    import logging

    import dramatiq
    from dramatiq import Worker

    from dramatiq_pg_outbox import PostgresBroker

    logging.basicConfig(level=logging.WARNING)
    broker = PostgresBroker(url=url)
    dramatiq.set_broker(broker)

    def noop(i: int) -> None:
        record_start(shared, i)

    for k in range(queues):
        dramatiq.actor(noop, queue_name=queue_name(k), actor_name=f"noop_{k}", max_retries=0)
    # Dramatiq's default worker_timeout (1 s): how long an idle consumer thread waits in __next__.
    worker = Worker(broker, worker_threads=THREADS)
    pid_out.value = os.getpid()
    shared.ready.release()
    shared.go.wait()
    worker.start()
    shared.stop.wait()
    worker.stop()
    broker.close()


def _prefill(url: str, queues: int, n: int) -> None:
    """N messages, message i on queue i mod Q (with the harness's own copy of the package)."""
    from dramatiq import Message

    from dramatiq_pg_outbox import PostgresBroker
    from dramatiq_pg_outbox._runtime import StoredMessage

    own = PostgresBroker(url=url)
    try:
        for lo in range(0, n, PREFILL_BATCH):
            batch = [
                StoredMessage.of(
                    Message(
                        queue_name=queue_name(i % queues),
                        actor_name=f"noop_{i % queues}",
                        args=(i,),
                        kwargs={},
                        options={},
                    )
                )
                for i in range(lo, min(n, lo + PREFILL_BATCH))
            ]
            own.runtime.enqueue(batch, notify=False)
    finally:
        own.close()


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _statements(admin: psycopg.Connection[Any], dbname: str) -> tuple[int, int] | None:
    """(all calls, claim calls) pg_stat_statements counted for ``dbname`` (None: not loaded)."""
    try:
        row = admin.execute(
            "SELECT coalesce(sum(calls), 0), "
            "coalesce(sum(calls) FILTER (WHERE query LIKE '%%candidates%%'), 0) "
            "FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s",
            (dbname,),
        ).fetchone()
    except psycopg.Error:
        return None
    assert row is not None
    return int(row[0]), int(row[1])


def measure(
    admin_url: str, url: str, dbname: str, queues: int, n: int, idle_s: float, tree: str | None
) -> dict[str, Any]:
    """One drain of ``n`` messages over ``queues`` queues, then an idle window: the figures."""
    import multiprocessing as mp

    recreate_database(admin_url, dbname)
    from dramatiq_pg_outbox import upgrade

    upgrade(url, schema="dramatiq")
    _prefill(url, queues, n)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE dramatiq.messages")
    ctx = mp.get_context("spawn")
    shared = Shared(ctx, 0)
    pid_out = ctx.Value("q", 0)
    proc = ctx.Process(target=_worker, args=(url, queues, shared, tree, pid_out), daemon=True)
    result: dict[str, Any] = {"queues": queues, "n": n}
    with psycopg.connect(admin_url, autocommit=True) as admin:
        with contextlib.suppress(psycopg.Error):
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        try:
            proc.start()
            if not shared.ready.acquire(timeout=120):
                raise RuntimeError("worker process did not become ready")
            busy0 = busy_jiffies()
            t0 = time.perf_counter()
            shared.go.set()
            deadline = t0 + DRAIN_CAP_S
            while shared.done < n and time.perf_counter() < deadline and proc.is_alive():
                time.sleep(0.002)
            t1 = time.perf_counter()
            done = shared.done
            busy = busy_jiffies() - busy0
            result["drain_msgs_s"] = done / (t1 - t0) if done else None
            result["drain_cpu_ms"] = cpu_ms_per_message(busy, done) if done >= n else None
            result["drained"] = done
            time.sleep(SETTLE_S)
            backends = [
                int(r[0])
                for r in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                    (dbname,),
                ).fetchall()
            ]
            stat0 = _statements(admin, dbname)
            w0 = _proc_cpu_s(pid_out.value)
            b0 = sum(_proc_cpu_s(pid) for pid in backends)
            i0 = time.perf_counter()
            time.sleep(idle_s)
            elapsed = time.perf_counter() - i0
            stat1 = _statements(admin, dbname)
            w1 = _proc_cpu_s(pid_out.value)
            b1 = sum(_proc_cpu_s(pid) for pid in backends)
            if stat0 is not None and stat1 is not None:
                # (Read from the admin database: the reading is not counted.)
                result["idle_statements_s"] = (stat1[0] - stat0[0]) / elapsed
                result["idle_claims_s"] = (stat1[1] - stat0[1]) / elapsed
            result["idle_worker_cpu_ms_s"] = (w1 - w0) * 1000 / elapsed
            result["idle_pg_cpu_ms_s"] = (b1 - b0) * 1000 / elapsed
        finally:
            shared.go.set()
            shared.stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    return result


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _median(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def _table(
    results: dict[tuple[str, int], list[dict[str, Any]]], labels: list[str], counts: tuple[int, ...]
) -> str:
    rows = []
    for queues in counts:
        for label in labels:
            runs = results.get((label, queues), [])
            cells = [label, str(queues), str(len(runs))]
            cells.append(fmt_rate(_median([r.get("drain_msgs_s") for r in runs])))
            cells.append(_fmt(_median([r.get("drain_cpu_ms") for r in runs]), 4))
            cells.append(_fmt(_median([r.get("idle_statements_s") for r in runs])))
            cells.append(_fmt(_median([r.get("idle_claims_s") for r in runs])))
            cells.append(_fmt(_median([r.get("idle_worker_cpu_ms_s") for r in runs])))
            cells.append(_fmt(_median([r.get("idle_pg_cpu_ms_s") for r in runs])))
            rows.append(cells)
    header = ["tree", "queues", "runs", "drain msgs/s", "drain CPU ms/msg (box)", "idle statements/s",
              "idle claims/s", "idle worker CPU ms/s", "idle PG backends CPU ms/s"]  # fmt: skip
    return markdown_table(header, rows)


def run_all(
    admin_url: str, *, counts: tuple[int, ...], n: int, idle_s: float, rounds: int, trees: list[str | None]
) -> dict[str, Any]:
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    labels = [tree or "installed" for tree in trees]
    for round_no in range(rounds):
        # Alternate which tree goes first in each round.
        order = list(zip(labels, trees, strict=True))
        if round_no % 2:
            order.reverse()
        for queues in counts:
            for label, tree in order:
                dbname = db_name("ours", f"queues_{queues}")
                url = make_url(admin_url).set(database=dbname).render_as_string(hide_password=False)
                r = measure(admin_url, url, dbname, queues, n, idle_s, tree)
                results.setdefault((label, queues), []).append(r)
                drain = (
                    f"{fmt_rate(r.get('drain_msgs_s'))} msgs/s, {_fmt(r.get('drain_cpu_ms'), 4)} ms CPU/msg"
                )
                idle = (
                    f"{_fmt(r.get('idle_statements_s'))} statements/s "
                    f"({_fmt(r.get('idle_claims_s'))} claims/s), "
                    f"worker {_fmt(r.get('idle_worker_cpu_ms_s'))} ms/s, "
                    f"PG {_fmt(r.get('idle_pg_cpu_ms_s'))} ms/s"
                )
                print(
                    f"  queues round {round_no + 1} {label} Q={queues}: drain {drain}; idle {idle} "
                    f"(load {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
    return {
        "table": _table(results, labels, counts),
        "raw": {f"{label} Q={q}": runs for (label, q), runs in results.items()},
    }


def run(ctx: Context) -> dict[str, Any]:
    """The scenario ``queues`` of ``benchmarks.run``."""
    n = getenv_int("BENCH_QUEUES_MESSAGES", 480 if ctx.smoke else 5_000 if ctx.quick else 20_000)
    idle_s = float(os.environ.get("BENCH_QUEUES_IDLE_SECONDS", 1 if ctx.smoke else 10))
    counts = (1, 4) if ctx.smoke else QUEUE_COUNTS
    return run_all(ctx.admin_url, counts=counts, n=n, idle_s=idle_s, rounds=ctx.runs, trees=[None])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_queues", description=__doc__)
    parser.add_argument("--queues", default=",".join(map(str, QUEUE_COUNTS)), help="queue counts (1,4,16)")
    parser.add_argument("--messages", type=int, default=20_000, help="messages per drain (20000)")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="length of the idle window (10)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds (each tree, each queue count)")
    parser.add_argument("--trees", default="", help="comma-separated checkouts whose package the worker runs")
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL"), help="admin URL of a server")
    args = parser.parse_args(argv)
    counts = tuple(int(q) for q in args.queues.split(",") if q)
    trees: list[str | None] = [os.path.abspath(t) for t in args.trees.split(",") if t] or [None]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()}", flush=True)
    with postgres_for_benchmarks(args.pg_url) as admin_url:
        result = run_all(admin_url, counts=counts, n=args.messages, idle_s=args.idle_seconds,
                         rounds=args.rounds, trees=trees)  # fmt: skip
    print(result["table"])
    print(f"# load at the end {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
