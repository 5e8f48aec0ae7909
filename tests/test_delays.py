"""Delayed messages and retries run at their due time, not at the next poll.

Every broker here polls once a minute (``max_fetch_interval=60_000``), so a
delayed message that runs within a few seconds can only have been claimed
because its consumer woke at the due time: from a ``"<queue>@<due>"``
notification, or from the next due time that every claim returns.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import dramatiq
import pytest

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox._runtime import parse_notification

from .helpers import wait_for

#: Poll interval of every broker in this file, in milliseconds: far longer than any test.
SLOW_POLL = 60_000


def idle(broker: PostgresBroker, queue_name: str = "default") -> None:
    """Wait until every consumer of ``queue_name`` has made its first claim (and found nothing)."""

    def claimed() -> bool:
        consumers = list(broker.runtime.consumers.get(queue_name, ()))
        return bool(consumers) and all(c.claims >= 1 for c in consumers)

    wait_for(claimed, 10, "the worker's first claim")


def due_ms(db: Any) -> int:
    """Due time of the only stored message, in epoch milliseconds (database clock), floored."""
    return int(db.execute("SELECT floor(extract(epoch FROM next_attempt_at) * 1000) FROM dramatiq.messages")
               .fetchone()[0])  # fmt: skip


def test_a_delayed_message_runs_at_its_due_time_on_an_idle_worker(
    make_broker: Any, start_worker: Any
) -> None:
    # Given an idle worker that polls once a minute, and listens
    broker = make_broker(max_fetch_interval=SLOW_POLL)
    started = threading.Event()

    @dramatiq.actor(broker=broker)
    def later() -> None:
        started.set()

    start_worker(broker)
    idle(broker)
    # When a message is sent with a delay of 300 ms (its enqueue announces "default@<due>")
    sent = time.monotonic()
    later.send_with_options(delay=300)
    # Then it runs within seconds, and not before its delay
    assert started.wait(10), "the delayed message did not run before the next poll"
    assert time.monotonic() - sent >= 0.3


def test_a_delayed_message_stored_before_the_worker_started_runs_when_due(
    make_broker: Any, start_worker: Any
) -> None:
    # Given a delayed message stored without any notification, and a worker that does not listen
    broker = make_broker(max_fetch_interval=SLOW_POLL, notify="off", listen=False)
    started = threading.Event()

    @dramatiq.actor(broker=broker)
    def later() -> None:
        started.set()

    later.send_with_options(delay=1_000)
    # When the worker starts: its first claim finds nothing due but learns the due time
    start_worker(broker)
    # Then the message runs within seconds, although nothing told the worker again
    assert started.wait(10), "the consumer did not wake at the due time its claim returned"


def test_a_retry_with_a_delay_runs_at_its_due_time(make_broker: Any, start_worker: Any, db: Any) -> None:
    # Given an idle worker that polls once a minute, and an actor that asks for a retry in 100 ms
    broker = make_broker(max_fetch_interval=SLOW_POLL)
    runs: list[float] = []
    done = threading.Event()

    @dramatiq.actor(broker=broker, max_retries=3)
    def flaky() -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise dramatiq.Retry(delay=100)
        done.set()

    start_worker(broker)
    idle(broker)
    # When it runs (the retry is enqueued through the worker's own pool)
    flaky.send()
    # Then the retry runs within seconds of the first run, not at the next poll
    assert done.wait(10), "the retry did not run before the next poll"
    assert runs[1] - runs[0] >= 0.1
    broker.join("default", timeout=10_000)
    assert [r[0] for r in db.execute("SELECT attempts FROM dramatiq.history ORDER BY id")] == [1, 1]


def test_a_delayed_notification_claims_at_its_due_time_and_not_before(make_broker: Any, db: Any) -> None:
    # Given an idle consumer (one empty claim) and a message due in 5 s that nobody announced
    broker = make_broker(max_fetch_interval=SLOW_POLL, notify="off", listen=False)

    @dramatiq.actor(broker=broker)
    def later() -> None:
        pass

    consumer = broker.consume("default", prefetch=1, timeout=100)
    assert next(consumer) is None
    assert consumer.claims == 1
    later.send_with_options(delay=5_000)
    # When the consumer hears "default@<due>"
    broker.runtime.notified(f"default@{due_ms(db)}")
    # Then it does not claim before the due time...
    assert next(consumer) is None
    assert consumer.claims == 1
    # ...and claims the message once it is due, long before its next poll
    consumer.timeout = 10_000
    message = next(consumer)
    assert message is not None and message.actor_name == "later"
    consumer.ack(message)
    consumer.close()


def test_a_delayed_notification_never_makes_a_consumer_claim_later(make_broker: Any, db: Any) -> None:
    # Given an idle consumer that polls every 300 ms
    broker = make_broker(max_fetch_interval=300, notify="off", listen=False)

    @dramatiq.actor(broker=broker)
    def now() -> None:
        pass

    consumer = broker.consume("default", prefetch=1, timeout=100)
    assert next(consumer) is None
    # When it hears of a message due in an hour, and then a message due now is stored silently
    broker.runtime.notified(f"default@{int(time.time() * 1000) + 3_600_000}")
    now.send()
    # Then its next poll still finds the due message
    consumer.timeout = 10_000
    message = next(consumer)
    assert message is not None and message.actor_name == "now"
    consumer.ack(message)
    consumer.close()


def test_a_claim_returns_when_the_next_delayed_message_is_due(make_broker: Any) -> None:
    # Given a message due in 30 s and one due in an hour
    broker = make_broker(max_fetch_interval=SLOW_POLL, notify="off", listen=False)

    @dramatiq.actor(broker=broker)
    def later() -> None:
        pass

    later.send_with_options(delay=3_600_000)
    later.send_with_options(delay=30_000)
    consumer = broker.consume("default", prefetch=1, timeout=100)
    # When the consumer claims (nothing is due)
    before = time.monotonic()
    assert next(consumer) is None
    # Then its next claim is planned at the earlier due time, not at its poll deadline
    assert 25 <= consumer.next_claim_at - before <= 31
    consumer.close()


@pytest.mark.parametrize(
    ("payload", "parsed"),
    [
        ("default", ("default", None)),
        ("emails.DQ", ("emails.DQ", None)),
        ("default@1795391862040", ("default", 1795391862040)),
        ("default@soon", ("default", None)),
        ("default@", ("default", None)),
    ],
)
def test_notifications_name_a_queue_and_maybe_a_due_time(
    payload: str, parsed: tuple[str, int | None]
) -> None:
    assert parse_notification(payload) == parsed


def two_consumers(make_broker: Any) -> list[Any]:
    """Two worker processes' worth of brokers (one runtime each), one idle consumer each, ranks known."""
    # (a heartbeat_timeout of 10 s: a loaded machine must not make a live peer look dead and
    # change the ranks while the test runs)
    brokers = [make_broker(max_fetch_interval=SLOW_POLL, heartbeat_timeout=10_000) for _ in range(2)]
    for broker in brokers:
        broker.declare_queue("default")
    consumers = [broker.consume("default", prefetch=1, timeout=100) for broker in brokers]
    for consumer in consumers:
        assert next(consumer) is None
        consumer.refresh_rank()
    assert sorted(c.rank for c in consumers) == [(2, 0), (2, 1)]
    return consumers


def next_in_thread(consumer: Any, timeout: int) -> threading.Thread:
    consumer.timeout = timeout
    thread = threading.Thread(target=lambda: consumer.got.append(next(consumer)))
    consumer.got = []
    thread.start()
    return thread


def test_one_consumer_not_every_process_wakes_at_a_due_time(make_broker: Any) -> None:
    # Given two idle worker processes that know each other
    consumers = two_consumers(make_broker)
    claims = [c.claims for c in consumers]

    @dramatiq.actor(broker=consumers[0].broker)
    def later() -> None:
        pass

    # When a message due in 500 ms is sent (both hear "default@<due>")
    later.send_with_options(delay=500)
    threads = [next_in_thread(c, 3_000) for c in consumers]
    for thread in threads:
        thread.join(10)
    # Then the consumer it was dealt to claims it at its due time, and the other one never claims
    got = [c.got[0] for c in consumers]
    assert sum(message is not None for message in got) == 1
    idle_one = consumers[got.index(None)]
    assert idle_one.claims == claims[consumers.index(idle_one)]
    for consumer, message in zip(consumers, got, strict=True):
        if message is not None:
            consumer.ack(message)
        consumer.close()


def test_more_messages_due_at_once_than_one_consumer_takes_wake_the_others(make_broker: Any) -> None:
    # Given two idle worker processes that know each other, each holding at most 4 messages
    consumers = two_consumers(make_broker)
    broker = consumers[0].broker

    @dramatiq.actor(broker=broker)
    def later() -> None:
        pass

    # When 20 messages fall due at the same instant
    broker.enqueue_many([later.message() for _ in range(20)], delay=500)
    threads = [next_in_thread(c, 5_000) for c in consumers]
    for thread in threads:
        thread.join(10)
    # Then both consumers claim (the one dealt the due time wakes the other), long before a poll
    assert all(c.got[0] is not None for c in consumers)
    for consumer in consumers:
        consumer.ack(consumer.got[0])
        consumer.close()
