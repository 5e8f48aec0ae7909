"""Run the periodic-jobs example with one command and check its result.

::

    python -m examples.periodic_jobs [--seconds 20] [--schedulers 3]

Creates a scratch database (on ``$DATABASE_URL``, the local server, or a
throwaway PostgreSQL), starts a ``dramatiq`` worker and several
``dramatiq-pg-outbox scheduler`` processes for a job declared with
``@periodic(every=1_000)``, kills one scheduler with SIGKILL halfway through,
stops the rest, lets the worker finish and prints a report.  Exit status 0
means: every one-second tick from the first to the last was enqueued once and
its job ran once, whatever happened to the schedulers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import psycopg

REPO_ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: python examples/periodic_jobs/run.py
    sys.path.insert(0, str(REPO_ROOT))

from dramatiq_pg_outbox import upgrade  # noqa: E402
from dramatiq_pg_outbox.testing import mask_password, postgres_server, scratch_database  # noqa: E402
from examples._workers import dramatiq_workers, supervised  # noqa: E402

#: Module of the broker and the job (loaded by the worker and by every scheduler).
TASKS_MODULE = "examples.periodic_jobs.tasks"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.periodic_jobs",
        description="A one-second periodic job under several schedulers, one of them killed -9.",
    )
    parser.add_argument("--seconds", type=int, default=20, help="how long the schedulers run (default 20)")
    parser.add_argument("--schedulers", type=int, default=3, help="scheduler processes (default 3)")
    args = parser.parse_args(argv)
    if args.seconds < 4 or args.schedulers < 2:
        parser.error("run at least 4 seconds with at least 2 schedulers (one of them is killed)")
    return args


def ticks_of(url: str, query: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [str(row[0]) for row in conn.execute(query)]


def main(argv: list[str] | None = None) -> int:
    """Run the example; return the exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")
    logging.getLogger("dramatiq_pg_outbox.testing").setLevel(logging.INFO)
    print(f"periodic jobs: a job every second, {args.schedulers} schedulers for {args.seconds} s")
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="periodic_jobs_")))
        url = stack.enter_context(scratch_database(stack.enter_context(postgres_server()), "periodic_jobs"))
        print(f"  database   {mask_password(url)} (dropped at exit)")
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE job_runs (tick text NOT NULL, pid int NOT NULL)")
        env = {**os.environ, "EXAMPLE_DATABASE_URL": url}
        with dramatiq_workers(TASKS_MODULE, 1, 4, tmp / "workers.log", env) as worker:
            command = [sys.executable, "-m", "dramatiq_pg_outbox.cli", "scheduler", "--app", TASKS_MODULE]
            schedulers = [
                stack.enter_context(supervised(command, tmp / f"scheduler{i}.log", env))
                for i in range(args.schedulers)
            ]
            print(f"  schedulers pids {', '.join(str(p.pid) for p in schedulers)}; worker pid {worker.pid}")
            time.sleep(args.seconds / 2)
            victim = schedulers[0]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            print(f"  killed scheduler {victim.pid} with SIGKILL after {args.seconds / 2:g} s")
            time.sleep(args.seconds / 2)
            for scheduler in schedulers[1:]:
                scheduler.send_signal(signal.SIGTERM)
            stopped = [scheduler.wait(30) for scheduler in schedulers[1:]]
            print(f"  stopped the other schedulers (exit status {', '.join(map(str, stopped))})")
            deadline = time.monotonic() + 60
            while ticks_of(url, "SELECT id FROM dramatiq.messages") and time.monotonic() < deadline:
                time.sleep(0.2)
        schedules = subprocess.run(
            [sys.executable, "-m", "dramatiq_pg_outbox.cli", "schedules", "--url", url],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        enqueued = ticks_of(
            url,
            "SELECT idempotency_key FROM dramatiq.history WHERE idempotency_key LIKE 'periodic:%' "
            "UNION ALL SELECT idempotency_key FROM dramatiq.messages WHERE idempotency_key LIKE 'periodic:%'",
        )
        runs = Counter(ticks_of(url, "SELECT tick FROM job_runs"))
    return report(enqueued, runs, schedules)


def report(enqueued: list[str], runs: Counter[str], schedules: str) -> int:
    """Print the report; return 0 if every tick from the first to the last ran exactly once."""
    ticks = sorted(dt.datetime.fromisoformat(key.split(":", 2)[2].replace("Z", "+00:00")) for key in enqueued)
    expected = [ticks[0] + dt.timedelta(seconds=n) for n in range(len(ticks))] if ticks else []
    enqueued_twice = sum(n - 1 for n in Counter(ticks).values())
    gaps = len({*expected} - {*ticks})
    run_ticks = Counter(dt.datetime.fromisoformat(t.replace("Z", "+00:00")) for t in runs.elements())
    ran_twice = sum(n - 1 for n in run_ticks.values())
    not_run = len(set(ticks) - set(run_ticks))
    print()
    print(schedules.rstrip())
    print()
    rows = [
        ("ticks enqueued", len(ticks), f"({ticks[0]:%H:%M:%S} to {ticks[-1]:%H:%M:%S} UTC)" if ticks else ""),
        ("ticks enqueued twice", enqueued_twice, ""),
        ("ticks missing", gaps, "(a gap between the first and the last)"),
        ("jobs run", sum(run_ticks.values()), f"(by {len(set(runs))} distinct ticks)"),
        ("jobs run twice", ran_twice, ""),
        ("ticks not run", not_run, ""),
    ]
    for label, value, note in rows:
        print(f"  {label:<24}{value:>8}  {note}".rstrip())
    problems = []
    if len(ticks) < 2:
        problems.append("fewer than 2 ticks were enqueued: did the schedulers start?")
    if enqueued_twice or gaps:
        problems.append(f"{enqueued_twice} tick(s) enqueued twice, {gaps} missing")
    if ran_twice or not_run:
        problems.append(f"{ran_twice} job(s) ran twice, {not_run} tick(s) did not run")
    if problems:
        print("\nFAILED: " + "\n        ".join(problems))
        return 1
    print("\nOK: each tick was enqueued once and its job ran once, although a scheduler was killed -9.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
