"""The producer's side of a wake-up: ``commit()`` returning -> a listener holding the NOTIFY.

``python -m benchmarks.wake_up_trace [--commits 500] [--modes after_commit,transaction]``

For each ``notify`` mode, one process commits ``--commits`` SQLAlchemy ``Session``
transactions, each with one ``send()`` inside ``outbox()``, 20 ms apart (as the latency
scenario's producer), while a thread of the same process LISTENs on the broker's channel
on a connection of its own.  Printed per mode: the median, p90, p99 and maximum of the
time from ``commit()`` returning to the listener's ``notifies()`` yielding that commit's
notification, in ms (negative: the NOTIFY arrived before ``commit()`` returned, as the
default mode's does, delivered by the COMMIT itself).  No worker runs: this is the part
of the latency scenario's wake-up that the producer's process adds.  The modes run
interleaved, ``--rounds`` times, on a private durable server (as ``benchmarks.run``) or
``--pg-url``'s.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import dramatiq
import psycopg
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import PostgresBroker, outbox
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url

from .bench_common import OURS, Context, db_name, percentile, postgres_for_benchmarks
from .bench_systems import install

#: Pause between two commits, in milliseconds (the latency scenario's spacing).
SPACING_MS = 20


def trace(url: str, mode: str, commits: int) -> list[float]:
    """``commits`` times, in ms, from ``Session.commit()`` returning to the listener holding its NOTIFY."""
    broker = PostgresBroker(url=url, notify=mode)
    actor = dramatiq.actor(lambda: None, broker=broker, actor_name="trace", queue_name="trace")
    received: list[float] = []
    listening = threading.Event()
    done = threading.Event()

    def listen() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'LISTEN "{broker.channel}"')
            listening.set()
            while not done.is_set():
                for _ in conn.notifies(timeout=0.1):
                    received.append(time.perf_counter())

    listener = threading.Thread(target=listen)
    listener.start()
    listening.wait(10)
    engine = create_engine(normalize_sqlalchemy_url(url))
    returned: list[float] = []
    try:
        for _ in range(commits + 1):  # the first, which opens the broker's runtime, is not counted
            with Session(engine) as session:
                with outbox(session, broker):
                    actor.send()
                session.commit()
            returned.append(time.perf_counter())
            time.sleep(SPACING_MS / 1000)
        deadline = time.monotonic() + 5
        while len(received) < len(returned) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        done.set()
        listener.join(5)
        engine.dispose()
        broker.close()
    if len(received) != len(returned):
        raise RuntimeError(f"{len(received)} notifications for {len(returned)} commits")
    return [(r - c) * 1000 for r, c in zip(received[1:], returned[1:], strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=500, help="commits per mode and round (default 500)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the modes interleaved (default 3)")
    parser.add_argument("--modes", default="after_commit,transaction", help="notify modes, comma-separated")
    parser.add_argument("--pg-url", default=None, help="an admin URL (default: a private server)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    samples: dict[str, list[float]] = {m: [] for m in modes}
    with postgres_for_benchmarks(args.pg_url) as admin_url:
        ctx = Context(admin_url, 1, False, (OURS,), "")
        dbname = db_name(OURS, "wake_up_trace")
        url = ctx.db_url(dbname)
        install(OURS, admin_url, dbname, url)
        for round_no in range(args.rounds):
            for mode in modes:
                times = trace(url, mode, args.commits)
                samples[mode].extend(times)
                print(
                    f"round {round_no + 1} {mode}: median {statistics.median(times):.3f} ms, "
                    f"p99 {percentile(times, 99):.3f} ms",
                    flush=True,
                )
    print("\n| notify mode | commits | median ms | p90 ms | p99 ms | max ms |\n|---|---|---|---|---|---|")
    for mode, times in samples.items():
        row: list[Any] = [
            mode,
            len(times),
            f"{statistics.median(times):.3f}",
            f"{percentile(times, 90):.3f}",
            f"{percentile(times, 99):.3f}",
            f"{max(times):.3f}",
        ]
        print("| " + " | ".join(str(v) for v in row) + " |")


if __name__ == "__main__":
    main()
