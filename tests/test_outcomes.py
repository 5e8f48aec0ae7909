"""Decisions with follow-ups (Outcomes): fenced by (row id, lease), never stuck on one that cannot be written.

An ack or nack with follow-ups (a retry, the next pipeline step, a callback, a
result) is written with them in one transaction (docs/guarantees.md, "Follow-ups
belong to the ack").  These tests drive the flusher against the real database and
run real Dramatiq workers:

* a stale decision (its lease expired, the row was claimed again) that lands in the
  same flush batch as the current decision of the same row writes nothing: only the
  delivery whose lease is on the row has its follow-ups written;
* an outcome whose follow-up the database refuses for good (a retry delay beyond
  PostgreSQL's interval range) is quarantined alone, and every other outcome of the
  process still flows.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import dramatiq

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox._runtime.messages import StoredMessage

from .helpers import wait_for

#: Background maintenance ticks once at start, then the test drives it by hand.
MANUAL = {"heartbeat_interval": 600_000, "heartbeat_timeout": 1_200_000, "rescue_interval": 600_000}


def _queue() -> str:
    return f"outcomes_{uuid.uuid4().hex[:8]}"


def _history(db: Any, queue: str) -> list[tuple[str, str, str | None]]:
    rows = db.execute(
        "SELECT actor_name, state, error_type FROM dramatiq.history WHERE queue_name = %s ORDER BY id",
        (queue,),
    ).fetchall()
    return [(str(actor), str(state), error_type) for actor, state, error_type in rows]


def _pending(db: Any, queue: str) -> list[str]:
    rows = db.execute("SELECT actor_name FROM dramatiq.messages WHERE queue_name = %s ORDER BY id", (queue,))
    return [str(actor) for (actor,) in rows.fetchall()]


def _follow_up_args(db: Any, queue: str) -> list[tuple[Any, ...]]:
    """The arguments of the follow_up messages stored in ``queue``."""
    rows = db.execute(
        "SELECT payload FROM dramatiq.messages WHERE queue_name = %s AND actor_name = 'follow_up'", (queue,)
    ).fetchall()
    return [tuple(dramatiq.Message.decode(bytes(payload)).args) for (payload,) in rows]


# -- a stale outcome beside the current one -------------------------------------------------------


def test_a_stale_outcome_in_the_batch_of_the_current_one_writes_none_of_its_follow_ups(
    make_broker: Any, db: Any
) -> None:
    # Given a message claimed by this process, released (its lease expired) and claimed again
    broker: PostgresBroker = make_broker(**MANUAL)
    queue = _queue()

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task() -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name=queue)
    def follow_up(delivery: str) -> None:
        pass

    task.send()
    consumer = broker.consume(queue, prefetch=2, timeout=1_000)
    first = next(consumer)
    assert first is not None
    db.execute("UPDATE dramatiq.messages SET state = 'pending', lease = NULL, owner = NULL")
    consumer.notify()
    second = next(consumer)
    assert second is not None and second.row_id == first.row_id and second.lease != first.lease
    # When both deliveries finish, each with a follow-up (the stale one first), and are
    # flushed in one batch
    flusher = broker.runtime.flusher
    for delivery, name in ((first, "stale"), (second, "current")):
        message = follow_up.message(name)
        flusher.finish(delivery.row_id, delivery.lease, "ack", messages=[StoredMessage.of(message)])
    done = flusher.flush_once()
    # Then only the current delivery's follow-up is stored, and the stale one is counted stale
    assert done == {"acked": 1, "nacked": 0, "canceled": 0, "requeued": 0, "stale": 1}
    assert _follow_up_args(db, queue) == [("current",)]
    assert _history(db, queue) == [("task", "completed", None)]
    consumer.close()


def test_a_stale_outcome_after_the_current_one_in_a_batch_writes_none_of_its_follow_ups(
    make_broker: Any, db: Any
) -> None:
    # Given the same row delivered twice, the stale delivery's nack (with an on_failure
    # callback) queued after the current delivery's ack (with its next step)
    broker: PostgresBroker = make_broker(**MANUAL)
    queue = _queue()

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task() -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name=queue)
    def follow_up(delivery: str) -> None:
        pass

    task.send()
    consumer = broker.consume(queue, prefetch=2, timeout=1_000)
    first = next(consumer)
    assert first is not None
    db.execute("UPDATE dramatiq.messages SET state = 'pending', lease = NULL, owner = NULL")
    consumer.notify()
    second = next(consumer)
    assert second is not None and second.lease != first.lease
    flusher = broker.runtime.flusher
    current = StoredMessage.of(follow_up.message("current"))
    flusher.finish(second.row_id, second.lease, "ack", messages=[current])
    flusher.finish(
        first.row_id,
        first.lease,
        "nack",
        "RuntimeError",
        "late",
        messages=[StoredMessage.of(follow_up.message("stale"))],
    )
    # When they are flushed together
    done = flusher.flush_once()
    # Then the message is completed once, with the current delivery's follow-up only
    assert (done["acked"], done["nacked"], done["stale"]) == (1, 0, 1)
    assert _follow_up_args(db, queue) == [("current",)]
    assert _history(db, queue) == [("task", "completed", None)]
    consumer.close()


def test_a_pipeline_step_whose_lease_expired_runs_its_next_step_once(
    make_broker: Any, db: Any, start_worker: Any
) -> None:
    # Given a worker with a short max_lease and a pipeline whose first step outlives it:
    # its first delivery waits until the rescuer released the row and a second delivery
    # of it started, then both deliveries return together (one flush batch)
    broker: PostgresBroker = make_broker(max_lease=1_500, rescue_interval=200, flush_interval=500)
    queue = _queue()
    second_started = threading.Event()
    runs: list[str] = []

    @dramatiq.actor(broker=broker, queue_name=queue)
    def step_one(x: int) -> int:
        runs.append("step_one")
        if len(runs) == 1:
            assert second_started.wait(30), "the message was never delivered a second time"
        else:
            second_started.set()
        return x + 1

    @dramatiq.actor(broker=broker, queue_name=queue)
    def step_two(x: int) -> None:
        runs.append(f"step_two({x})")

    start_worker(broker, worker_threads=4)
    (step_one.message(1) | step_two.message()).run()
    # When both deliveries of step_one have finished and everything is written
    wait_for(lambda: "step_two(2)" in runs and not _pending(db, queue), 30, "the pipeline finished")
    # (a second step_two would have been stored in the same transaction as the first: once
    # nothing of the queue is left, it has run too)
    # Then step_one ran twice or more (its lease expired) but step_two exactly once
    assert runs.count("step_one") >= 2
    assert runs.count("step_two(2)") == 1, runs
    assert _pending(db, queue) == []
    assert [actor for actor, _, _ in _history(db, queue)] == ["step_one", "step_two"]


# -- a follow-up that can never be written ---------------------------------------------------------

#: A retry delay beyond PostgreSQL's range: now() + 10**16 ms (317,000 years) overflows the interval.
NEVER = 10**16


def _failed(db: Any, queue: str) -> list[tuple[str, str, str]]:
    rows = db.execute(
        "SELECT actor_name, error_type, error FROM dramatiq.history"
        " WHERE queue_name = %s AND state = 'failed'",
        (queue,),
    ).fetchall()
    return [(str(actor), str(error_type), str(error)) for actor, error_type, error in rows]


def test_an_outcome_whose_follow_up_can_never_be_written_is_quarantined_and_its_batch_flows(
    make_broker: Any, db: Any
) -> None:
    # Given two claimed messages whose outcomes reach one flush batch: the first with a
    # follow-up the database refuses for good (a delay out of its range), the second with
    # a good one
    broker: PostgresBroker = make_broker(**MANUAL)
    queue = _queue()

    @dramatiq.actor(broker=broker, queue_name=queue)
    def task(n: int) -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name=queue)
    def follow_up(delivery: str) -> None:
        pass

    task.send(1)
    task.send(2)
    consumer = broker.consume(queue, prefetch=2, timeout=1_000)
    poisoned, healthy = next(consumer), next(consumer)
    assert poisoned is not None and healthy is not None
    flusher = broker.runtime.flusher
    never = StoredMessage.of(follow_up.message("never"), NEVER)
    flusher.finish(poisoned.row_id, poisoned.lease, "ack", messages=[never])
    flusher.finish(healthy.row_id, healthy.lease, "ack", messages=[StoredMessage.of(follow_up.message("ok"))])
    # When the batch is flushed
    done = flusher.flush_once()
    # Then the healthy outcome and its follow-up are written, the poisoned message is in
    # history as failed with an error naming the follow-up, and none of its follow-ups is stored
    assert (done["acked"], done["nacked"], done["stale"]) == (1, 1, 0)
    assert flusher.pending() == 0
    assert _follow_up_args(db, queue) == [("ok",)]
    [(actor, error_type, error)] = _failed(db, queue)
    assert (actor, error_type) == ("task", "FollowUpNotWritable")
    assert never.message.message_id in error and "follow_up" in error and "out of range" in error
    assert sorted(_history(db, queue)) == [
        ("task", "completed", None),
        ("task", "failed", "FollowUpNotWritable"),
    ]
    assert broker.runtime.inflight == {}
    consumer.close()


def test_a_retry_that_can_never_be_written_holds_back_no_other_message(
    make_broker: Any, db: Any, start_worker: Any
) -> None:
    # Given a worker whose first message raises Retry with a delay beyond PostgreSQL's range,
    # then a pipeline and a plain message
    broker: PostgresBroker = make_broker()
    queue = _queue()
    runs: list[str] = []

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=5)
    def poisoned() -> None:
        runs.append("poisoned")
        raise dramatiq.Retry(delay=NEVER)

    @dramatiq.actor(broker=broker, queue_name=queue)
    def step_one(x: int) -> int:
        runs.append("step_one")
        return x + 1

    @dramatiq.actor(broker=broker, queue_name=queue)
    def step_two(x: int) -> None:
        runs.append(f"step_two({x})")

    poisoned.send()
    (step_one.message(1) | step_two.message()).run()
    start_worker(broker, worker_threads=1)
    # When it runs them: then the pipeline's next step runs and nothing is left pending
    wait_for(lambda: "step_two(2)" in runs and not _pending(db, queue), 30, "the pipeline finished")
    # And the poisoned message ran once and is in history as failed, with the error naming its retry
    assert runs.count("poisoned") == 1
    [(actor, error_type, error)] = _failed(db, queue)
    assert (actor, error_type) == ("poisoned", "FollowUpNotWritable")
    assert "poisoned" in error and "out of range" in error
    assert sorted(_history(db, queue)) == [
        ("poisoned", "failed", "FollowUpNotWritable"),
        ("step_one", "completed", None),
        ("step_two", "completed", None),
    ]


def test_an_error_text_with_a_nul_byte_is_stored(make_broker: Any, db: Any, start_worker: Any) -> None:
    # Given an actor whose exception's text holds a NUL byte, which PostgreSQL's text refuses
    broker: PostgresBroker = make_broker()
    queue = _queue()

    @dramatiq.actor(broker=broker, queue_name=queue, max_retries=0)
    def nul() -> None:
        raise ValueError("before\x00after")

    @dramatiq.actor(broker=broker, queue_name=queue)
    def plain() -> None:
        pass

    nul.send()
    plain.send()
    # When a worker runs it (a dead letter, no follow-up) and another message
    start_worker(broker, worker_threads=1)
    # Then both are archived, the error with the NUL byte escaped
    wait_for(lambda: len(_history(db, queue)) == 2, 30, "both messages archived")
    [(actor, error_type, error)] = _failed(db, queue)
    assert (actor, error_type) == ("nul", "ValueError")
    assert "before\\x00after" in error
