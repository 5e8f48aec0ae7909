"""A claim in flight while the consumer hands off the last one (issue 37, part 2).

During a backlog, the next claim goes out on the consumer's claim thread as soon as half the
buffer is free, while the consumer thread still hands off what the last claim returned.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import dramatiq

from dramatiq_pg_outbox import PostgresBroker

from .helpers import wait_for


def queue_empty(db: Any) -> bool:
    return db.execute("SELECT count(*) FROM dramatiq.messages").fetchone() == (0,)


def completed(db: Any) -> int:
    return int(db.execute("SELECT count(*) FROM dramatiq.history WHERE state = 'completed'").fetchone()[0])


def watch_claims(broker: PostgresBroker, on_claim: Any) -> None:
    """Call ``on_claim(consumer, params)`` at the start of every claim of queue ``default``."""
    store = broker.runtime.store
    claim = store.claim

    def watched(conn: Any, **params: Any) -> Any:
        if params["queue_name"] == "default":
            (consumer,) = broker.runtime.consumers["default"]
            on_claim(consumer, params)
        return claim(conn, **params)

    store.claim = watched  # type: ignore[method-assign]


def test_a_claim_is_in_flight_while_the_buffer_still_holds_messages(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    # Given a backlog of no-op tasks, and claims whose round trip is 20 ms longer than the
    # database needs (the worker threads run dry while one is in flight)
    @dramatiq.actor(broker=broker)
    def quick() -> None:
        pass

    broker.enqueue_many([quick.message() for _ in range(3_000)])
    threads: list[str] = []

    def slow_claim(consumer: Any, params: dict[str, Any]) -> None:
        threads.append(threading.current_thread().name)
        time.sleep(0.02)

    watch_claims(broker, slow_claim)
    # When a worker of 2 threads drains it
    worker = start_worker(broker, worker_threads=2)
    wait_for(lambda: queue_empty(db), 60, "the backlog to drain")
    # Then some claims went out while the buffer still held messages to hand off (on the
    # parent commit every claim waited for an empty buffer), made on the claim thread
    consumer = worker.consumers["default"].consumer
    assert consumer.claims_ahead > 0
    assert threads.count("claims-default") == consumer.claims_ahead, threads
    wait_for(lambda: completed(db) == 3_000, 30, "every message archived")


def test_what_a_consumer_holds_with_a_claim_in_flight_stays_within_its_bound(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given a consumer whose cap is prefetch x overfetch_factor = 4 x 16 = 64 (2 threads), and a
    # backlog of no-op tasks, claimed with 20 ms more of round trip (claims grow to the cap)
    broker = make_broker()
    cap = 4 * int(broker.options.overfetch_factor)

    @dramatiq.actor(broker=broker)
    def quick() -> None:
        pass

    broker.enqueue_many([quick.message() for _ in range(3_000)])
    at_claims: list[tuple[int, int]] = []

    def record(consumer: Any, params: dict[str, Any]) -> None:
        # What it holds when a claim starts, and what the claim asks for
        at_claims.append((consumer.outstanding, params["limit"]))
        time.sleep(0.02)

    watch_claims(broker, record)
    # When a worker drains it, sampled every millisecond
    worker = start_worker(broker, worker_threads=2)
    wait_for(lambda: worker.consumers["default"].consumer is not None, 10, "the consumer")
    consumer = worker.consumers["default"].consumer
    held: list[int] = []
    deadline = time.monotonic() + 60
    while not queue_empty(db) and time.monotonic() < deadline:
        held.append(consumer.outstanding + consumer.in_flight)
        time.sleep(0.001)
    # Then claims went out ahead, and what it held (claimed and undecided, buffered or handed
    # off, and asked for by the claim in flight) never passed prefetch x overfetch_factor
    assert consumer.claims_ahead > 0
    assert max(limit for _, limit in at_claims) >= cap // 2, at_claims
    assert max(held) <= cap, max(held)
    assert all(outstanding + limit <= cap for outstanding, limit in at_claims), at_claims
    wait_for(lambda: completed(db) == 3_000, 30, "every message archived")


def test_a_consumer_closed_while_a_claim_is_in_flight_hands_its_rows_back(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    # Given a backlog, drained by a worker whose claims run ahead of the hand-off
    ran: collections.Counter[str] = collections.Counter()

    @dramatiq.actor(broker=broker)
    def count(key: str) -> None:
        ran[key] += 1

    broker.enqueue_many([count.message(str(i)) for i in range(2_000)])
    in_flight = threading.Event()

    def claim(consumer: Any, params: dict[str, Any]) -> None:
        time.sleep(0.02)
        if threading.current_thread().name.startswith("claims-") and len(ran) >= 50:
            # A claim on the claim thread, slow enough for the worker to stop meanwhile
            in_flight.set()
            time.sleep(0.5)

    watch_claims(broker, claim)
    worker = start_worker(broker, worker_threads=2)
    assert in_flight.wait(30), "a claim ahead"
    # When the worker stops while that claim is in flight
    worker.stop(timeout=10_000)
    # Then nothing is left claimed (what the claim returned after the close is handed back)
    processing = "SELECT count(*) FROM dramatiq.messages WHERE state = 'processing'"
    wait_for(lambda: db.execute(processing).fetchone() == (0,), 10, "the rows handed back")
    # And a new worker runs the rest: every message ran exactly once
    start_worker(broker, worker_threads=2)
    wait_for(lambda: queue_empty(db), 60, "the backlog to drain")
    wait_for(lambda: completed(db) == 2_000, 30, "every message archived")
    assert set(ran) == {str(i) for i in range(2_000)}
    assert max(ran.values()) == 1, [key for key, n in ran.items() if n > 1]
