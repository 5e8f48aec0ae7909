"""Dramatiq's rate limiters, barriers and group callbacks on PostgreSQL (rate_limits.PostgresBackend)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import group
from dramatiq.middleware import CurrentMessage, GroupCallbacks
from dramatiq.rate_limits import (
    Barrier,
    BucketRateLimiter,
    ConcurrentRateLimiter,
    RateLimitExceeded,
    WindowRateLimiter,
)
from psycopg import pq

from dramatiq_pg_outbox._runtime.listener import subscribe
from dramatiq_pg_outbox.rate_limits import PostgresBackend
from tests.helpers import LISTENERS, count, round_trips, wait_for

#: Generous bound for things that take milliseconds, in seconds (a loaded 2-core machine).
SOON = 15


@pytest.fixture
def backend(make_broker: Any, db: Any) -> Iterator[PostgresBackend]:
    db.execute("TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events")
    backend = PostgresBackend(broker=make_broker(), cleanup_interval=None)
    yield backend
    backend.close()


# -- the backend's operations ------------------------------------------------------------
def test_each_operation_keeps_its_bound_and_an_expired_key_counts_as_absent(backend: PostgresBackend) -> None:
    # add: only when absent
    assert backend.add("a", 5, 60_000)
    assert not backend.add("a", 7, 60_000)
    # incr: up to the maximum, never past it
    assert backend.incr("c", 2, 3, 60_000)
    assert backend.incr("c", 1, 3, 60_000)
    assert not backend.incr("c", 1, 3, 60_000)
    assert not backend.incr("fresh", 4, 3, 60_000)
    # decr: down to the minimum, never past it; a missing key is 0
    assert backend.decr("c", 3, 0, 60_000)
    assert not backend.decr("c", 1, 0, 60_000)
    assert not backend.decr("missing", 1, 0, 60_000)
    assert backend.decr("signed", 2, -5, 60_000)
    # an expired key is gone for every operation
    assert backend.add("short", 1, 50)
    assert backend.incr("short-counter", 3, 3, 50)
    time.sleep(0.2)
    assert backend.add("short", 9, 60_000)
    assert backend.incr("short-counter", 3, 3, 60_000)
    # and the cleanup deletes the expired rows: the two refused new keys ("fresh", "missing"),
    # stored already expired; the others were renewed
    assert backend.delete_expired() == 2
    assert backend.delete_expired() == 0


def test_incr_and_sum_bounds_the_sum_of_the_window(backend: PostgresBackend) -> None:
    keys = ["w1", "w2", "w3"]
    assert backend.incr_and_sum("w1", lambda: keys, 2, 5, 60_000)
    assert backend.incr_and_sum("w2", lambda: keys, 2, 5, 60_000)
    assert backend.incr_and_sum("w3", lambda: keys, 1, 5, 60_000)
    assert not backend.incr_and_sum("w3", lambda: keys, 1, 5, 60_000)
    # a key outside the window does not count
    assert backend.incr_and_sum("w4", lambda: ["w4"], 5, 5, 60_000)


def test_expired_keys_are_cleaned_by_a_loop_without_a_cron_job(make_broker: Any, db: Any) -> None:
    # Given a backend whose cleanup runs every 100 ms, and short-lived keys and events
    db.execute("TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events")
    backend = PostgresBackend(broker=make_broker(), cleanup_interval=100)
    try:
        for i in range(20):
            assert backend.add(f"k{i}", 1, 50)
        backend.wait_notify("event", 50)
        # Then they disappear from the tables once expired
        wait_for(
            lambda: (
                count(db, "SELECT count(*) FROM dramatiq.rate_limits")
                + count(db, "SELECT count(*) FROM dramatiq.rate_limit_events")
                == 0
            ),
            SOON,
            "the expired rows to be deleted",
        )
    finally:
        backend.close()


def test_an_event_lives_for_its_ttl_so_a_late_waiter_sees_it(backend: PostgresBackend) -> None:
    backend.wait_notify("late", 500)
    started = time.monotonic()
    assert backend.wait("late", 1_000)
    assert time.monotonic() - started < 0.5
    time.sleep(0.6)
    assert not backend.wait("late", 1_000)


def test_a_waiter_wakes_on_the_notification_not_the_poll(make_broker: Any, db: Any) -> None:
    # Given a backend that polls only every 10 s, and a thread waiting on a key
    db.execute("TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events")
    backend = PostgresBackend(broker=make_broker(), cleanup_interval=None, poll_interval=10_000)
    try:
        woke: list[float] = []

        def wait() -> None:
            if backend.wait("k", 8_000):
                woke.append(time.monotonic())

        waiter = threading.Thread(target=wait)
        waiter.start()
        # (its wait subscribes first: once LISTEN is in force, an event is heard or read)
        wait_for(lambda: count(db, LISTENERS) >= 1, 10, "the waiter's LISTEN")
        # When another party publishes the event
        sent = time.monotonic()
        backend.wait_notify("k", 10_000)
        waiter.join(SOON)
        # Then the waiter wakes at once, long before its next poll
        assert woke and woke[0] - sent < 1.0
    finally:
        backend.close()


# -- Dramatiq's limiters and barrier on it --------------------------------------------------
def test_a_concurrent_rate_limiter_is_released_after_each_call(backend: PostgresBackend) -> None:
    mutex = ConcurrentRateLimiter(backend, "sequential", limit=1)
    calls = 0
    for _ in range(8):
        with mutex.acquire(raise_on_failure=False) as acquired:
            calls += bool(acquired)
    assert calls == 8


def test_a_concurrent_rate_limiter_of_one_is_a_mutex(backend: PostgresBackend) -> None:
    mutex = ConcurrentRateLimiter(backend, "mutex", limit=1)
    calls: list[int] = []

    def work() -> None:
        with mutex.acquire(raise_on_failure=False) as acquired:
            if acquired:
                calls.append(1)
                time.sleep(1.0)

    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(work) for _ in range(8)]:
            future.result()
    assert sum(calls) == 1


def test_a_concurrent_rate_limiter_limits_concurrency(backend: PostgresBackend) -> None:
    limiter = ConcurrentRateLimiter(backend, "four", limit=4)
    calls: list[int] = []

    def work() -> None:
        try:
            with limiter.acquire():
                calls.append(1)
                time.sleep(1.0)
        except RateLimitExceeded:
            pass

    with ThreadPoolExecutor(max_workers=32) as pool:
        for future in [pool.submit(work) for _ in range(32)]:
            future.result()
    assert 3 <= sum(calls) <= 4


def test_a_window_rate_limiter_admits_at_most_its_limit_per_window(backend: PostgresBackend) -> None:
    # (a window of 60 s: the 40 calls must end before the first one's second leaves the window,
    # which a 5 s window did not leave room for on a loaded machine in one CI run: 11 admitted)
    limiter = WindowRateLimiter(backend, "window", limit=10, window=60)
    calls: list[int] = []

    def work() -> None:
        with limiter.acquire(raise_on_failure=False) as acquired:
            calls.append(bool(acquired))

    with ThreadPoolExecutor(max_workers=16) as pool:
        for future in [pool.submit(work) for _ in range(40)]:
            future.result()
    assert sum(calls) == 10


def test_the_window_limiter_sums_the_window_as_of_when_it_holds_the_locks(backend: PostgresBackend) -> None:
    # Given a limit of 10 reached over two one-second buckets: 9 calls in second 1, then one in
    # second 2 by a caller whose window began in second 2
    assert backend.incr_and_sum("w@1", lambda: ["w@1"], 9, maximum=10, ttl=60_000)
    assert backend.incr_and_sum("w@2", lambda: ["w@2", "w@1"], 1, maximum=10, ttl=60_000)
    # When a caller that asked in second 1 (its window: seconds 0 and 1), and waited for the
    # window's locks until second 2 had begun, asks for one more
    windows = iter([["w@1", "w@0"], ["w@2", "w@1"]])
    admitted = backend.incr_and_sum("w@1", lambda: next(windows), 1, maximum=10, ttl=60_000)
    # Then it is refused: the window summed is the one of when the locks are held (on the parent
    # commit the window of before the wait was summed, 9 of 10, and an 11th call was admitted,
    # as in one CI run of the 16-thread test of test_isolation.py)
    assert not admitted


@pytest.fixture
def one_connection(
    backend: PostgresBackend, monkeypatch: pytest.MonkeyPatch
) -> Iterator[psycopg.Connection[Any]]:
    """The pooled connection that every operation of ``backend`` runs on, while the test runs."""
    with backend.broker.runtime.connection() as conn:
        monkeypatch.setattr(backend, "_connection", lambda: contextlib.nullcontext(conn))
        yield conn


def test_a_window_acquisition_is_one_transaction_in_two_round_trips(
    backend: PostgresBackend, one_connection: psycopg.Connection[Any]
) -> None:
    assert backend.incr_and_sum("rt@1", lambda: ["rt@1", "rt@0"], 1, maximum=10, ttl=60_000)
    # When the window limiter acquires once more
    windows = iter([["rt@1", "rt@0"], ["rt@2", "rt@1"]])
    with round_trips(one_connection) as count:
        assert backend.incr_and_sum("rt@1", lambda: next(windows), 1, maximum=10, ttl=60_000)
        trips = count()
    # Then it waited for the server twice: BEGIN with the locks, then the sum of the window
    # asked for once they were held, with the COMMIT (four on the parent commit: BEGIN, the
    # locks, the sum, the COMMIT, each a wait of its own)
    assert trips == 2
    assert next(windows, None) is None
    assert one_connection.info.transaction_status == pq.TransactionStatus.IDLE
    bucket = one_connection.execute("SELECT value FROM dramatiq.rate_limits WHERE key = 'rt@1'").fetchone()
    assert bucket == (2,)


def test_a_failed_window_acquisition_rolls_back_and_releases_its_locks(
    backend: PostgresBackend, one_connection: psycopg.Connection[Any]
) -> None:
    assert backend.incr_and_sum("err@1", lambda: ["err@1"], 1, maximum=10, ttl=60_000)
    # When the sum fails once the locks are held (a ttl past the range of an interval)
    with pytest.raises(psycopg.errors.DataError):
        backend.incr_and_sum("err@1", lambda: ["err@1"], 1, maximum=10, ttl=2**62)
    # Then nothing was added, the transaction is over and no lock of the window is held
    conn = one_connection
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    held = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    assert conn.execute(held).fetchone() == (0,)
    assert conn.execute("SELECT value FROM dramatiq.rate_limits WHERE key = 'err@1'").fetchone() == (1,)
    # and the next acquisition on the same connection goes through
    assert backend.incr_and_sum("err@1", lambda: ["err@1"], 1, maximum=10, ttl=60_000)


def test_the_window_limiter_keeps_keys_of_any_text(backend: PostgresBackend, db: Any) -> None:
    # Given window keys that need quoting in a text[] literal (the backend writes them as one)
    odd = ['q"uote@1', "back\\slash@1", "{brace},comma@1", "NULL", "  spaced  @1", "ünï@1"]
    # When each is the current bucket of a window made of all of them
    for key in odd:
        assert backend.incr_and_sum(key, lambda: odd, 1, maximum=len(odd), ttl=60_000)
    # Then each was stored under its own text, and the window's sum saw every one
    assert not backend.incr_and_sum(odd[0], lambda: odd, 1, maximum=len(odd), ttl=60_000)
    stored = dict(db.execute("SELECT key, value FROM dramatiq.rate_limits").fetchall())
    assert stored == dict.fromkeys(odd, 1)


def test_a_bucket_rate_limiter_admits_at_most_its_limit_per_bucket(backend: PostgresBackend) -> None:
    limiter = BucketRateLimiter(backend, "bucket", limit=2, bucket=5_000)
    # (start early in a bucket, so that the calls do not straddle two)
    while time.time() * 1000 % 5_000 > 2_000:
        time.sleep(0.05)
    admitted = 0
    for _ in range(8):
        with limiter.acquire(raise_on_failure=False) as acquired:
            admitted += bool(acquired)
    assert admitted == 2


def test_a_barrier_opens_on_its_last_party(backend: PostgresBackend) -> None:
    barrier = Barrier(backend, "barrier", ttl=30_000)
    assert barrier.create(parties=2)
    assert not barrier.create(parties=10)
    assert not barrier.wait(block=False)
    assert barrier.wait(block=False)


def test_a_barrier_blocks_its_parties_until_the_last_one_arrives(backend: PostgresBackend) -> None:
    barrier = Barrier(backend, "blocking", ttl=30_000)
    assert barrier.create(parties=2)
    times: list[float] = []

    def party(delay: float) -> None:
        time.sleep(delay)
        assert barrier.wait(timeout=5_000)
        times.append(time.monotonic())

    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(party, 0.1), pool.submit(party, 1.0)]:
            future.result()
    # the first party waited for the second (woken by its notification, not a poll)
    assert len(times) == 2 and abs(times[0] - times[1]) <= 0.25


def test_a_barrier_on_a_fresh_key_wakes_its_parties_together_when_the_listener_serves_another_channel(
    make_broker: Any, db: Any
) -> None:
    # Given a process whose LISTEN connection already serves other channels: the second is
    # subscribed to here so that the listener has just looked at its subscriptions (where it
    # used to LISTEN to a new channel only every 0.5 s; now it does at once)
    db.execute("TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events")
    broker = make_broker()
    other = subscribe(broker.conninfo, "dpo_test_other", lambda payload: None, lambda: None)
    looked = threading.Event()
    another = subscribe(broker.conninfo, "dpo_test_another", lambda payload: None, looked.set)
    backend = PostgresBackend(broker=broker, cleanup_interval=None)
    try:
        assert looked.wait(SOON)
        barrier = Barrier(backend, "fresh", ttl=30_000)
        assert barrier.create(parties=2)
        woke: dict[str, float] = {}

        def party(name: str) -> None:
            assert barrier.wait(timeout=10_000)
            woke[name] = time.monotonic()

        # When the first party waits (the backend's channel is new to the listener) and the
        # second arrives 100 ms later
        first = threading.Thread(target=party, args=("first",))
        first.start()
        time.sleep(0.1)
        party("second")
        first.join(SOON)
        # Then the first wakes on the second's notification, not at the listener's next tick:
        # a structural bound (the tick is 500 ms; the parties woke about 400 ms apart)
        assert set(woke) == {"first", "second"}
        assert abs(woke["first"] - woke["second"]) < 0.1
    finally:
        backend.close()
        another.close()
        other.close()


def test_a_barrier_wait_times_out(backend: PostgresBackend) -> None:
    barrier = Barrier(backend, "alone", ttl=30_000)
    assert barrier.create(parties=2)
    started = time.monotonic()
    assert not barrier.wait(timeout=1_000)
    assert 0.9 <= time.monotonic() - started < 5


def test_group_completion_callbacks_run_once_on_this_backend(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given a broker with GroupCallbacks on this backend, and a group of five
    db.execute("TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events")
    broker = make_broker()
    backend = PostgresBackend(broker=broker, cleanup_interval=None)
    broker.add_middleware(GroupCallbacks(backend))
    done: list[int] = []
    finished: list[str] = []

    @dramatiq.actor(broker=broker)
    def part(i: int) -> None:
        done.append(i)

    @dramatiq.actor(broker=broker)
    def all_done() -> None:
        finished.append("once")

    start_worker(broker)
    try:
        # When the group runs
        parts = group(part.message(i) for i in range(5))
        parts.add_completion_callback(all_done.message())
        parts.run()
        # Then the callback runs once, after every part
        wait_for(lambda: finished == ["once"], SOON, "the completion callback")
        assert sorted(done) == [0, 1, 2, 3, 4]
        time.sleep(0.5)
        assert finished == ["once"]
    finally:
        backend.close()


def test_a_group_member_whose_ack_is_lost_runs_again_and_the_completion_callback_still_runs_once(
    make_broker: Any, start_worker: Any, db: Any, database_url: str
) -> None:
    # Given Dramatiq's GroupCallbacks on this backend, and a group of three whose first member's
    # first delivery loses its ack: its row is released while it runs (as the rescuer releases
    # the row of a worker judged dead, or of a lease past max_lease), so that delivery's outcome
    # is stale, dropped with its follow-ups, and the member runs again
    db.execute("TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events")
    broker = make_broker()
    broker.add_middleware(CurrentMessage())
    backend = PostgresBackend(broker=broker, cleanup_interval=None)
    broker.add_middleware(GroupCallbacks(backend))
    runs: list[int] = []
    finished: list[int] = []
    first: list[str] = []

    def first_member_acked() -> bool:
        return bool(count(db, "SELECT count(*) FROM dramatiq.history WHERE message_id = %s", (first[0],)))

    @dramatiq.actor(broker=broker)
    def part(i: int) -> None:
        if i > 0:
            # The other members end after both runs of the first (so that, counted at once, its
            # two count-downs would open the barrier before the last member)
            wait_for(first_member_acked, SOON, "the first member's second delivery to be acked")
        elif 0 not in runs:
            current = CurrentMessage.get_current_message()
            assert current is not None
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(
                    "UPDATE dramatiq.messages SET state = 'pending', lease = NULL, owner = NULL, "
                    "acquired_at = NULL WHERE message_id = %s AND state = 'processing'",
                    (current.message_id,),
                )
        runs.append(i)

    @dramatiq.actor(broker=broker)
    def all_done() -> None:
        finished.append(len(runs))

    start_worker(broker)
    try:
        # When the group runs
        members = [part.message(i) for i in range(3)]
        first.append(members[0].message_id)
        parts = group(members)
        parts.add_completion_callback(all_done.message())
        parts.run()
        wait_for(lambda: sorted(runs) == [0, 0, 1, 2] and finished, SOON, "the group and its callback")
        broker.join(all_done.queue_name, timeout=SOON * 1000)
        # Then the member ran twice, and the callback once, after every member: the count-down
        # of the lost delivery was not kept (it is written with the ack, or not at all)
        assert len(finished) == 1 and finished[0] >= 3, finished
        time.sleep(0.5)
        assert len(finished) == 1
    finally:
        backend.close()


def test_eight_processes_of_eight_threads_never_exceed_a_limit_of_three(
    producer: Any, worker_process: Any, db: Any
) -> None:
    # Given 8 worker processes x 8 threads whose actor holds ConcurrentRateLimiter(limit=3)
    db.execute(
        "TRUNCATE dramatiq.rate_limits, dramatiq.rate_limit_events;"
        "DROP TABLE IF EXISTS limiter;"
        "CREATE TABLE limiter (running int NOT NULL, peak int NOT NULL, runs int NOT NULL);"
        "INSERT INTO limiter VALUES (0, 0, 0)"
    )
    wp = worker_process(processes=8, threads=8)
    try:
        # When 150 messages compete for it
        for i in range(150):
            producer.limited.send(f"l{i}", 0.02)
        wait_for(lambda: count(db, "SELECT count(*) FROM received") == 150, 180, "every message")
        # Then all ran, never more than 3 at once, and the limit was reached (there was contention)
        running, peak, runs = db.execute("SELECT running, peak, runs FROM limiter").fetchone()
        assert (running, runs) == (0, 150)
        assert peak == 3
    finally:
        wp.stop()
        db.execute("DROP TABLE IF EXISTS limiter")
