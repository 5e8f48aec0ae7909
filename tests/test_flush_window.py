"""The flush window follows the pace, within its two bounds (issue 37, part 1).

A real Dramatiq worker on a real database: while a backlog drains the window grows from
``flush_interval`` up to ``max_flush_delay`` and never beyond; once the process idles, a
lone message's follow-up (a pipeline's next step) is written after ``flush_interval``
again; and while the flusher cannot write (the history table locked), a worker thread
that decides while ``2 x flush_batch_size`` decisions are unwritten waits, so that no
more finished messages than that (plus one per worker thread) would run again after a
crash.  The assertions read what the flusher chose and counted (``Flusher.passes``,
``Flusher.most_unwritten``), not the wall clock.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from typing import Any

import dramatiq
import psycopg

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox._runtime.flusher import GROW_AT, SHRINK_BELOW, next_window
from dramatiq_pg_outbox.options import UNWRITTEN_BATCHES

from .helpers import wait_for

#: A window long enough that a loaded test machine's worker fills it (GROW_AT decisions per pass).
SHORTEST_MS = 50
LONGEST_MS = 200


def test_the_window_doubles_keeps_and_halves_within_its_bounds() -> None:
    shortest, longest = 0.005, 0.02
    assert next_window(0.005, shortest, longest, decisions=GROW_AT, full=False) == 0.01
    assert next_window(0.01, shortest, longest, decisions=10 * GROW_AT, full=False) == 0.02
    assert next_window(0.02, shortest, longest, decisions=10 * GROW_AT, full=False) == 0.02
    assert next_window(0.01, shortest, longest, decisions=GROW_AT - 1, full=False) == 0.01
    assert next_window(0.02, shortest, longest, decisions=SHRINK_BELOW - 1, full=False) == 0.01
    assert next_window(0.005, shortest, longest, decisions=1, full=False) == 0.005
    # A pass started by the count bound says nothing of the window: kept.
    assert next_window(0.01, shortest, longest, decisions=10 * GROW_AT, full=True) == 0.01


def test_the_window_grows_up_to_max_flush_delay_under_load_and_is_shortest_again_when_idle(
    make_broker: Any, start_worker: Any, db: psycopg.Connection[Any]
) -> None:
    # Given a worker whose flush window may grow from 50 to 200 ms
    broker: PostgresBroker = make_broker(flush_interval=SHORTEST_MS, max_flush_delay=LONGEST_MS)
    steps: list[str] = []

    @dramatiq.actor(broker=broker, queue_name="flush_window_load")
    def quick(i: int) -> None:
        # 2 ms each: 4 threads drain for about a second, whatever the pace of the machine,
        # so that the window has the flushes it needs to double twice (a no-op drained in
        # less than the 350 ms of windows 50 + 100 + 200 once the worker got faster).
        time.sleep(0.002)

    @dramatiq.actor(broker=broker, queue_name="flush_window_steps")
    def step(name: str) -> str:
        steps.append(name)
        return name

    n = 2_000
    broker.enqueue_many([quick.message(i) for i in range(n)])
    # When it drains a backlog
    start_worker(broker, worker_threads=4)
    flusher = broker.runtime.flusher
    wait_for(lambda: flusher.stats["acked"] >= n, 120, f"{n} acks written")
    drained = list(flusher.passes)
    # Then the window grew to the bound and never beyond it
    windows = [p.window_ms for p in drained]
    assert max(windows) == LONGEST_MS, windows
    assert min(windows) >= SHORTEST_MS, windows
    # And a decided message waited about the window before its flush began (the median: a
    # loaded machine wakes the flush thread late now and then)
    assert statistics.median(p.waited_ms for p in drained) <= LONGEST_MS + 100, drained

    # When the process then idles, and a lone message's follow-up is the next step of a pipeline
    time.sleep(2 * LONGEST_MS / 1000)
    mark = len(flusher.passes)
    dramatiq.pipeline(
        [step.message("first"), step.message_with_options(args=("second",), pipe_ignore=True)]
    ).run()
    wait_for(lambda: steps == ["first", "second"], 30, "both steps of the pipeline")
    wait_for(lambda: flusher.stats["acked"] >= n + 2, 30, "both steps acked")
    # Then the acks of both steps (the first with the second step, written in one transaction)
    # were written after the shortest window
    lone = list(flusher.passes)[mark:]
    assert lone and all(p.window_ms == SHORTEST_MS for p in lone), lone
    assert sum(p.decisions for p in lone) == 2
    completed = "SELECT count(*) FROM dramatiq.history WHERE state = 'completed' AND queue_name = %s"
    assert db.execute(completed, ["flush_window_steps"]).fetchone() == (2,)


def test_no_more_decisions_wait_unwritten_than_the_bound_while_the_flusher_cannot_write(
    make_broker: Any, start_worker: Any, db: psycopg.Connection[Any], database_url: str
) -> None:
    # Given a worker of 2 threads whose flusher flushes at 5 decisions and lets 10 wait unwritten
    batch, threads, n = 5, 2, 60
    broker: PostgresBroker = make_broker(flush_batch_size=batch)
    bound = UNWRITTEN_BATCHES * batch
    ran: list[int] = []
    lock = threading.Lock()

    @dramatiq.actor(broker=broker, queue_name="flush_window_bound")
    def task(i: int) -> None:
        with lock:
            ran.append(i)

    broker.enqueue_many([task.message(i) for i in range(n)])
    # And the history table locked, so that no ack can be written
    blocker = psycopg.connect(database_url)
    try:
        blocker.execute("LOCK TABLE dramatiq.history IN EXCLUSIVE MODE")
        # When the worker runs the messages
        start_worker(broker, worker_threads=threads)
        flusher = broker.runtime.flusher
        wait_for(lambda: flusher.most_unwritten > bound, 60, "the worker threads to reach the bound")
        # (a chance for more to run, were they not held back)
        time.sleep(1.0)
        # Then the threads wait: no more than the bound, plus one decision per thread, finished
        # unwritten (what a crash now would run again)
        assert bound < flusher.most_unwritten <= bound + threads
        with lock:
            finished = len(ran)
        assert finished <= bound + threads, finished
        assert flusher.stats["acked"] == 0
    finally:
        blocker.rollback()
        blocker.close()
    # And once the flusher can write again, everything runs, each message once
    wait_for(lambda: flusher.stats["acked"] >= n, 60, f"{n} acks written")
    assert sorted(ran) == list(range(n))
    assert flusher.most_unwritten <= bound + threads
    assert db.execute(
        "SELECT count(*) FROM dramatiq.history WHERE queue_name = 'flush_window_bound'"
    ).fetchone() == (n,)


def test_a_decision_never_waits_for_a_flusher_that_stopped(make_broker: Any) -> None:
    # Given a flusher stopped (as broker.close() does), its bound 2 decisions
    broker: PostgresBroker = make_broker(flush_batch_size=1)
    flusher = broker.runtime.flusher
    flusher.start()
    flusher.stop(timeout=5)

    # When more decisions than the bound arrive (acks of unknown rows)
    def decide() -> None:
        for row_id in range(10):
            flusher.ack(10_000_000 + row_id, uuid.uuid4())

    thread = threading.Thread(target=decide, daemon=True)
    thread.start()
    thread.join(30)
    # Then none of them waited for a flusher that will never write
    assert not thread.is_alive()
    assert flusher.unwritten == 10
