"""Priorities (``broker_priority``) against a real PostgreSQL and real workers: claim order,
FIFO within a priority, delays, retries, dead letters, the outbox, bad values."""

from __future__ import annotations

import time
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import Retries
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from dramatiq_pg_outbox import outbox
from dramatiq_pg_outbox._runtime.messages import MAX_PRIORITY
from dramatiq_pg_outbox.migrations import normalize_sqlalchemy_url
from tests.helpers import count, wait_for
from tests.test_cli import cli

#: Generous bound for things that take milliseconds, in seconds (a loaded 2-core machine).
SOON = 15


def stored(db: Any) -> list[tuple[str, int]]:
    """(message id, priority) of the rows of queue "work", in id order."""
    rows = db.execute(
        "SELECT message_id, priority FROM dramatiq.messages WHERE queue_name = 'work' ORDER BY id"
    )
    return [(str(m), int(p)) for m, p in rows]


def test_higher_priorities_run_first_and_fifo_within_a_priority(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given messages of mixed priorities waiting on one queue, sent in this order
    broker = make_broker()
    ran: list[tuple[int, int]] = []

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(priority: int, i: int) -> None:
        ran.append((priority, i))

    sent = [0, 5, 0, 10, 5, 0, MAX_PRIORITY, 10, 0, 5]
    for i, priority in enumerate(sent):
        options = {} if priority == 0 and i % 2 else {"broker_priority": priority}
        job.send_with_options(args=(priority, i), **options)
    assert sorted(p for _, p in stored(db)) == sorted(sent)
    # When one worker thread runs them (one claim takes them all)
    start_worker(broker, worker_threads=1)
    wait_for(lambda: len(ran) == len(sent), SOON, "every message")
    # Then the highest priority ran first, and each priority in the order it was sent
    expected = sorted(((p, i) for i, p in enumerate(sent)), key=lambda pi: (-pi[0], pi[1]))
    assert ran == expected


def test_a_claim_takes_the_prioritized_rows_first_then_the_oldest_others(make_broker: Any, db: Any) -> None:
    # Given 3 old messages without priority and 2 newer ones with priority 1
    broker = make_broker(overfetch_factor=1)

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(i: int) -> None:
        pass

    for i in range(3):
        job.send(i)
    for i in range(3, 5):
        job.send_with_options(args=(i,), broker_priority=1)
    # When a consumer claims 3
    consumer = broker.consume("work", prefetch=3, timeout=1_000)
    try:
        claimed = []
        while len(claimed) < 3:
            message = next(consumer)
            if message is not None:
                claimed.append(message.args[0])
        # Then it took both prioritized ones, then the oldest unprioritized one, in that order
        assert claimed == [3, 4, 0]
        assert count(db, "SELECT count(*) FROM dramatiq.messages WHERE state = 'processing'") == 3
    finally:
        consumer.close()


def test_a_delayed_prioritized_message_waits_for_its_due_time(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given a prioritized message delayed by 1.5 s, then an unprioritized one due now
    broker = make_broker()
    ran: list[tuple[str, float]] = []

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(name: str) -> None:
        ran.append((name, time.monotonic()))

    sent_at = time.monotonic()
    job.send_with_options(args=("urgent-later",), broker_priority=9, delay=1_500)
    job.send("plain-now")
    start_worker(broker, worker_threads=1)
    wait_for(lambda: len(ran) == 2, SOON, "both messages")
    # Then the due one ran first, and the prioritized one not before its due time
    assert [name for name, _ in ran] == ["plain-now", "urgent-later"]
    assert ran[1][1] - sent_at >= 1.4


def test_a_retry_and_a_retried_dead_letter_keep_their_priority(
    database_url: str, make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given an actor that always fails, with one retry, sent with priority 7
    broker = make_broker()
    attempts: list[int] = []

    @dramatiq.actor(broker=broker, queue_name="work", max_retries=1, min_backoff=10, max_backoff=10)
    def fail(i: int) -> None:
        attempts.append(i)
        raise RuntimeError("boom")

    assert any(isinstance(m, Retries) for m in broker.middleware)
    fail.send_with_options(args=(1,), broker_priority=7)
    start_worker(broker, worker_threads=1)
    # When it has failed twice (the retry was a message of its own) and is a dead letter
    wait_for(
        lambda: count(db, "SELECT count(*) FROM dramatiq.history WHERE state = 'failed'") == 1,
        SOON,
        "the dead letter",
    )
    assert attempts == [1, 1]
    # Then every archived row, the retry's included, kept priority 7
    rows = db.execute("SELECT state, priority FROM dramatiq.history ORDER BY id").fetchall()
    assert rows == [("completed", 7), ("failed", 7)]
    # And retry-failed puts it back with its priority
    make_broker.workers[0].stop()
    make_broker.workers.clear()
    assert cli("retry-failed", "--url", database_url).returncode == 0
    assert stored(db)[0][1] == 7


def test_the_outbox_stores_the_priority(database_url: str, make_broker: Any, db: Any) -> None:
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(i: int) -> None:
        pass

    engine = create_engine(normalize_sqlalchemy_url(database_url))
    try:
        with Session(engine) as session, session.begin():
            with outbox(session):
                job.send_with_options(args=(1,), broker_priority=3)
                job.send(2)
        assert [p for _, p in stored(db)] == [3, 0]
    finally:
        engine.dispose()


@pytest.mark.parametrize("bad", [-1, MAX_PRIORITY + 1, "high", 2.5, True])
def test_a_bad_priority_is_refused_at_send_and_nothing_is_stored(make_broker: Any, db: Any, bad: Any) -> None:
    broker = make_broker()

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(i: int) -> None:
        pass

    with pytest.raises(ValueError) as raised:
        job.send_with_options(args=(1,), broker_priority=bad)
    assert str(raised.value) == f"broker_priority must be an integer from 0 to {MAX_PRIORITY}, not {bad!r}"
    assert stored(db) == []


def settled(consumer: Any, quiet: float = 1.0) -> None:
    """Wait until ``consumer`` has made no claim for ``quiet`` seconds (at most SOON)."""
    deadline = time.monotonic() + SOON
    while True:
        claims = consumer.claims
        time.sleep(quiet)
        if consumer.claims == claims:
            return
        assert time.monotonic() < deadline, "the consumer kept claiming"


def test_a_prioritized_message_notified_to_an_idle_worker_is_claimed_first(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given a worker with one thread that has run a message without priority (its
    # consumer claims with the plain claim now) and polls only every 30 s
    broker = make_broker(max_fetch_interval=30_000)
    ran: list[int] = []

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(i: int) -> None:
        ran.append(i)

    job.send(0)
    start_worker(broker, worker_threads=1)
    wait_for(lambda: ran == [0], SOON, "the first message")
    # (and whose LISTEN is in force, and which has made the claims it planned: the one a full
    # claim is followed by, and the one each LISTEN's start makes; either of those, if plain
    # and made between the statement below and its notification, runs messages 1, 2, ...
    # before 99, as once in CI: that claim is not the one the notification asks for)
    listener = broker.runtime.listener
    wait_for(lambda: listener is not None and listener.connected.is_set(), SOON, "the LISTEN")
    (consumer,) = [c for c in broker.runtime.registered() if c.queue_name == "work"]
    settled(consumer)
    # When 20 messages and then one with a priority are stored in one statement
    broker.enqueue_many(
        [job.message(i) for i in range(1, 21)] + [job.message_with_options(args=(99,), broker_priority=5)]
    )
    # Then the notification says so, and the prioritized one runs first
    wait_for(lambda: len(ran) == 22, SOON, "every message")
    assert ran[1] == 99, ran
