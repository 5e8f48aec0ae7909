"""The Dramatiq broker contract, with in-process Workers on a real PostgreSQL."""

from __future__ import annotations

import time
import uuid
from typing import Any

import dramatiq
import psycopg
import psycopg.sql
import pytest
from dramatiq.errors import QueueJoinTimeout, QueueNotFound

from dramatiq_pg_outbox import PostgresBroker

from .helpers import wait_for

#: Background maintenance ticks once at start, then the test drives it by hand.
MANUAL = {"heartbeat_interval": 600_000, "heartbeat_timeout": 1_200_000, "rescue_interval": 600_000}


def first_tick_done(broker: PostgresBroker) -> None:
    """Wait until the background maintenance loop has run its start-up tick."""
    maintenance = broker.runtime.maintenance
    assert maintenance is not None and maintenance.ticked.wait(10)


def history(db: Any) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT actor_name, state, attempts, error_type, error FROM dramatiq.history ORDER BY finished_at, id"
    ).fetchall()


def test_declared_queues_are_canonical(broker: PostgresBroker) -> None:
    broker.declare_queue("emails")
    broker.declare_queue("emails.DQ")
    assert broker.get_declared_queues() == {"emails"}
    assert broker.get_declared_delay_queues() == {"emails.DQ"}


def test_messages_are_processed_and_archived_as_completed(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    seen: list[int] = []

    @dramatiq.actor(broker=broker)
    def add(x: int) -> None:
        seen.append(x)

    for i in range(200):
        add.send(i)
    start_worker(broker)
    broker.join(add.queue_name, timeout=20_000)
    assert sorted(seen) == list(range(200))
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 0
    assert db.execute(
        "SELECT count(*), min(attempts), max(attempts) FROM dramatiq.history WHERE state = 'completed'"
    ).fetchone() == (200, 1, 1)


def test_attempts_are_charged_before_the_actor_runs(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    observed: list[tuple[Any, ...]] = []

    @dramatiq.actor(broker=broker)
    def look() -> None:
        observed.extend(db.execute("SELECT state, attempts FROM dramatiq.messages").fetchall())

    look.send()
    start_worker(broker)
    broker.join(look.queue_name, timeout=10_000)
    assert observed == [("processing", 1)]


def test_delayed_messages_are_not_delivered_early(broker: PostgresBroker, start_worker: Any, db: Any) -> None:
    started: list[float] = []

    @dramatiq.actor(broker=broker)
    def later() -> None:
        started.append(time.monotonic())

    start_worker(broker)
    sent = time.monotonic()
    later.send_with_options(delay=3_000)
    # While it waits, the row is pending in the table, not in a worker's memory.
    time.sleep(0.5)
    assert db.execute("SELECT state, queue_name FROM dramatiq.messages").fetchall() == [
        ("pending", "default")
    ]
    broker.join(later.queue_name, timeout=10_000)
    assert len(started) == 1
    assert started[0] - sent >= 3.0


def test_join_counts_delayed_messages_and_times_out(broker: PostgresBroker) -> None:
    @dramatiq.actor(broker=broker)
    def later() -> None:
        pass

    later.send_with_options(delay=60_000)
    assert broker.queue_size("default") == 1
    with pytest.raises(QueueJoinTimeout):
        broker.join("default", timeout=300)


def test_retries_with_backoff_then_success(broker: PostgresBroker, start_worker: Any, db: Any) -> None:
    calls: list[float] = []

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=300, max_backoff=300)
    def flaky() -> None:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ValueError(f"failure {len(calls)}")

    flaky.send()
    start_worker(broker)
    broker.join(flaky.queue_name, timeout=20_000)
    assert len(calls) == 3
    # Retries re-enqueues with a jittered delay of at least min_backoff / 2 (Dramatiq's
    # compute_backoff); the broker never delivers a retry before its delay.
    assert calls[1] - calls[0] >= 0.15 and calls[2] - calls[1] >= 0.15
    rows = history(db)
    assert [(r[1], r[3]) for r in rows] == [("completed", "ValueError")] * 2 + [("completed", None)]


def test_dead_letters_land_in_history_with_their_error(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    @dramatiq.actor(broker=broker, max_retries=0)
    def broken() -> None:
        raise KeyError("no such customer")

    broken.send()
    start_worker(broker)
    broker.join(broken.queue_name, timeout=10_000)
    ((actor, state, attempts, error_type, error),) = history(db)
    assert (actor, state, attempts, error_type) == ("broken", "failed", 1, "KeyError")
    assert "no such customer" in error and "Traceback" in error


def test_unknown_actor_is_dead_lettered(broker: PostgresBroker, start_worker: Any, db: Any) -> None:
    @dramatiq.actor(broker=broker)
    def known() -> None:
        pass

    message = known.message()
    broker.enqueue(message.copy(actor_name="ghost"))
    start_worker(broker)
    broker.join("default", timeout=10_000)
    ((actor, state, _, error_type, _),) = history(db)
    assert (actor, state, error_type) == ("ghost", "failed", "ActorNotFound")


def test_undecodable_row_is_dead_lettered_and_the_consumer_keeps_going(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    seen: list[int] = []

    @dramatiq.actor(broker=broker)
    def fine(x: int) -> None:
        seen.append(x)

    fine.send(1)
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload) "
        "VALUES ('default', 'fine', 'garbage', '\\xdeadbeef'::bytea)"
    )
    fine.send(2)
    start_worker(broker)
    broker.join("default", timeout=10_000)
    assert sorted(seen) == [1, 2]
    failed = db.execute("SELECT message_id, error_type, error FROM dramatiq.history WHERE state = 'failed'")
    ((message_id, error_type, error),) = failed.fetchall()
    assert (message_id, error_type) == ("garbage", "DecodeError")
    assert error


def test_graceful_stop_requeues_unstarted_messages_without_an_attempt(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    @dramatiq.actor(broker=broker)
    def slow() -> None:
        time.sleep(0.5)

    for _ in range(40):
        slow.send()
    # 2 threads -> Dramatiq prefetches 4: 2 running, 2 waiting in memory.
    worker = start_worker(broker, worker_threads=2)
    processing = "SELECT count(*) FROM dramatiq.messages WHERE state='processing'"
    wait_for(lambda: db.execute(processing).fetchone()[0] >= 4, 10, "4 claimed messages")
    worker.stop()
    rows = db.execute("SELECT state, attempts FROM dramatiq.messages").fetchall()
    done = db.execute("SELECT count(*) FROM dramatiq.history").fetchone()[0]
    assert len(rows) + done == 40
    # Nothing left claimed, and no unstarted message was charged an attempt.
    assert all(row == ("pending", 0) for row in rows)


def test_a_stale_ack_after_release_is_ignored(broker: PostgresBroker, db: Any) -> None:
    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    task.send()
    first = broker.consume("default", prefetch=1, timeout=1_000)
    message = next(first)
    assert message is not None
    # The row is released (as if its worker had been declared dead) and claimed again elsewhere.
    db.execute("UPDATE dramatiq.messages SET state='pending', lease=NULL, owner=NULL")
    other = PostgresBroker(url=broker.conninfo, max_fetch_interval=100)
    other.declare_queue("default")
    second = other.consume("default", prefetch=1, timeout=1_000)
    again = next(second)
    assert again is not None and again.message_id == message.message_id
    # The slow first worker acks late: fenced out.
    first.ack(message)
    assert broker.runtime.flusher.flush_once()["stale"] == 1
    assert db.execute("SELECT state, attempts FROM dramatiq.messages").fetchall() == [("processing", 2)]
    second.ack(again)
    assert other.runtime.flusher.flush_once() == {
        "acked": 1,
        "nacked": 0,
        "canceled": 0,
        "requeued": 0,
        "stale": 0,
    }
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 0
    first.close()
    second.close()
    other.close()


def test_messages_of_a_dead_worker_are_released_and_quarantined_after_max_deliveries(
    make_broker: Any, db: Any
) -> None:
    broker = make_broker(max_deliveries=2, **MANUAL)

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    task.send()
    for delivery in (1, 2):
        consumer = broker.consume("default", prefetch=1, timeout=2_000)
        message = next(consumer)
        assert message is not None and message.attempts == delivery
        first_tick_done(broker)
        # The worker "dies": its claim belongs to a process with no heartbeat and nothing is
        # acked (closing the consumer hands back only the messages it has not handed out; a
        # process never judges itself dead, so the claim is handed to a gone owner).
        consumer.close()
        db.execute("UPDATE dramatiq.messages SET owner = %s", (uuid.uuid4(),))
        maintenance = broker.runtime.maintenance
        assert maintenance is not None
        result = maintenance.rescue()
        assert (result.released, result.quarantined) == ((1, 0) if delivery == 1 else (0, 1))
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 0
    ((_, state, attempts, error_type, error),) = history(db)
    assert (state, attempts, error_type) == ("failed", 2, "MaxDeliveriesExceeded")
    assert "max_deliveries=2" in error
    # And the quarantine is counted as a dead letter of its queue (dead_lettered_total)
    assert db.execute("SELECT queue_name, sum(n) FROM dramatiq.dead_letter_counts GROUP BY 1").fetchall() == [
        ("default", 1)
    ]
    # And as a failure of its actor (messages_finished_total, migration 0018)
    assert db.execute(
        "SELECT queue_name, actor_name, state, sum(n) FROM dramatiq.finished_counts GROUP BY 1, 2, 3"
    ).fetchall() == [("default", "task", "failed", 1)]


def claim_one_by_hand(make_broker: Any) -> tuple[PostgresBroker, Any, Any]:
    """Hand-driven maintenance, one message sent and claimed: (broker, consumer, maintenance)."""
    broker = make_broker(**MANUAL)

    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    task.send()
    consumer = broker.consume("default", prefetch=1, timeout=2_000)
    assert next(consumer) is not None
    first_tick_done(broker)
    return broker, consumer, broker.runtime.maintenance


def test_a_process_never_judges_itself_dead_whatever_its_heartbeat_says(make_broker: Any, db: Any) -> None:
    # Given a process that holds a claim, and whose heartbeat reads a day old (its rescue can read
    # now() after a wait that also held its heartbeat back: the statement's comment in queries.sql)
    _, consumer, maintenance = claim_one_by_hand(make_broker)
    db.execute("UPDATE dramatiq.workers SET heartbeat_at = now() - interval '1 day'")
    # When its own rescue runs
    result = maintenance.rescue()
    # Then its claim is not released and its worker row is kept
    assert (result.released, result.dead_workers) == (0, 0)
    assert db.execute("SELECT state FROM dramatiq.messages").fetchone() == ("processing",)
    assert db.execute("SELECT count(*) FROM dramatiq.workers").fetchone() == (1,)
    # But a claim of another process with no heartbeat is released by the same rescue
    db.execute("UPDATE dramatiq.messages SET owner = %s", (uuid.uuid4(),))
    assert maintenance.rescue().released == 1
    consumer.close()


def test_a_live_workers_long_task_is_never_released(make_broker: Any, db: Any) -> None:
    _, consumer, maintenance = claim_one_by_hand(make_broker)
    # Claimed long ago by task-length standards, but the owner heartbeats.
    db.execute("UPDATE dramatiq.messages SET acquired_at = now() - interval '1 day'")
    maintenance.heartbeat()
    assert maintenance.rescue().released == 0
    assert db.execute("SELECT state FROM dramatiq.messages").fetchone() == ("processing",)
    consumer.close()


def test_orphaned_claims_of_a_live_process_are_released(make_broker: Any, db: Any) -> None:
    broker, consumer, maintenance = claim_one_by_hand(make_broker)
    # The claim's reply was "lost": this process no longer knows the row.
    broker.runtime.inflight.clear()
    db.execute("UPDATE dramatiq.messages SET acquired_at = now() - interval '1 minute'")
    assert maintenance.release_orphans() == 1
    assert db.execute("SELECT state, attempts FROM dramatiq.messages").fetchall() == [("pending", 0)]
    consumer.close()


def test_consume_of_an_undeclared_queue_raises(broker: PostgresBroker) -> None:
    with pytest.raises(QueueNotFound):
        broker.consume("nowhere")


def test_flush_drops_messages_of_a_queue(broker: PostgresBroker, db: Any) -> None:
    @dramatiq.actor(broker=broker, queue_name="q1")
    def a() -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name="q2")
    def b() -> None:
        pass

    a.send()
    a.send_with_options(delay=10_000)
    b.send()
    broker.flush("q1")
    assert db.execute("SELECT queue_name FROM dramatiq.messages").fetchall() == [("q2",)]
    broker.flush_all()
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 0


def test_notify_off_still_delivers_everything_by_polling(make_broker: Any, start_worker: Any) -> None:
    broker = make_broker(notify="off", listen=False, max_fetch_interval=100)
    seen: list[str] = []

    @dramatiq.actor(broker=broker)
    def task(x: str) -> None:
        seen.append(x)

    start_worker(broker)
    keys = [str(uuid.uuid4()) for _ in range(100)]
    for key in keys:
        task.send(key)
    broker.join("default", timeout=20_000)
    assert sorted(seen) == sorted(keys)
    assert broker.runtime.listener is None


def test_acks_through_a_restarted_consumer_free_the_slots_of_the_one_that_claimed(
    broker: PostgresBroker, db: Any
) -> None:
    @dramatiq.actor(broker=broker)
    def task() -> None:
        pass

    for _ in range(4):
        task.send()
    # Dramatiq restarts a consumer after a connection error and acks through the new one.
    old = broker.consume("default", prefetch=4, timeout=1_000)
    messages = [next(old) for _ in range(4)]
    new = broker.consume("default", prefetch=4, timeout=1_000)
    for message in messages:
        assert message is not None
        new.ack(message)
    assert (old.outstanding, new.outstanding) == (0, 0)
    old.close()
    new.close()


def test_enqueue_many_stores_a_fan_out_in_batches(
    broker: PostgresBroker, start_worker: Any, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []

    @dramatiq.actor(broker=broker)
    def fan(x: int) -> None:
        seen.append(x)

    # Every statement the broker's connections run, with the number of messages it carried
    # (the enqueue statement takes one array element per message)
    statements: list[tuple[str, int]] = []
    execute = psycopg.Cursor.execute

    def counted(cursor: psycopg.Cursor[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        text = query.as_string(cursor) if isinstance(query, psycopg.sql.Composable) else str(query)
        carried = len(params["payloads"]) if isinstance(params, dict) and "payloads" in params else 0
        statements.append((" ".join(text.split()), carried))
        return execute(cursor, query, params, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", counted)
    stored = broker.enqueue_many([fan.message(i) for i in range(2_500)], batch_size=1_000)
    monkeypatch.undo()
    assert len(stored) == 2_500
    # One multi-row INSERT per batch, nothing else writes messages
    inserts = [carried for text, carried in statements if "INSERT INTO" in text and ".messages" in text]
    assert inserts == [1_000, 1_000, 500], statements
    assert db.execute("SELECT count(*) FROM dramatiq.messages").fetchone()[0] == 2_500
    with pytest.raises(ValueError):
        broker.enqueue_many([fan.message(1).copy(queue_name="bad name")])
    start_worker(broker)
    broker.join("default", timeout=30_000)
    assert sorted(seen) == list(range(2_500))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # A claim that did not fill, or the first of a backlog, says nothing of the pace.
        ({"backlog": True, "asked": 64, "claimed": 10, "held": 32, "left": 0}, 64),
        ({"backlog": False, "asked": 64, "claimed": 64, "held": 0, "left": 0}, 64),
        # Worker threads ran dry during the round trip: double, up to the cap.
        ({"backlog": True, "asked": 32, "claimed": 32, "held": 32, "left": 3}, 128),
        ({"backlog": True, "asked": 32, "claimed": 32, "held": 0, "left": 0}, 128),
        # Most of what was held is still undecided: tasks are long, halve down to the floor.
        ({"backlog": True, "asked": 32, "claimed": 32, "held": 32, "left": 30}, 32),
        # In between: keep.
        ({"backlog": True, "asked": 32, "claimed": 32, "held": 32, "left": 12}, 64),
    ],
)
def test_the_claim_size_doubles_when_threads_ran_dry_and_halves_when_tasks_are_long(
    case: dict[str, Any], expected: int
) -> None:
    from dramatiq_pg_outbox.broker.consumer import claim_limit

    assert claim_limit(64, 16, 128, **case) == expected


def test_the_claim_size_stays_between_the_prefetch_and_the_cap() -> None:
    from dramatiq_pg_outbox.broker.consumer import claim_limit

    # Threads ran dry at the cap: it stays at the cap; long tasks at the floor: it stays there
    assert claim_limit(128, 16, 128, backlog=True, asked=64, claimed=64, held=64, left=0) == 128
    assert claim_limit(16, 16, 128, backlog=True, asked=8, claimed=8, held=8, left=8) == 16


def queue_empty(db: Any) -> bool:
    return db.execute("SELECT count(*) FROM dramatiq.messages").fetchone() == (0,)


def claims_seen(broker: PostgresBroker, delay_s: float = 0.0) -> list[int]:
    """The ``limit`` of every claim the broker makes from now on (after ``delay_s`` more of round trip)."""
    sizes: list[int] = []
    store = broker.runtime.store
    claim = store.claim

    def recorded(conn: Any, **params: Any) -> Any:
        if params["queue_name"] == "default":
            sizes.append(params["limit"])
            time.sleep(delay_s)
        return claim(conn, **params)

    store.claim = recorded  # type: ignore[method-assign]
    return sizes


def test_a_consumer_of_long_tasks_holds_no_more_than_dramatiqs_prefetch(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    # Given a backlog of tasks that each take 200 ms, and a worker of 2 threads (Dramatiq's
    # prefetch: 4; the cap, prefetch x overfetch_factor, is far above it)
    @dramatiq.actor(broker=broker)
    def slow() -> None:
        time.sleep(0.2)

    for _ in range(60):
        slow.send()
    worker = start_worker(broker, worker_threads=2)
    # When it has worked for a while (its first claim takes 4 x prefetch, as before)
    time.sleep(2.0)
    held = []
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        # (what it claimed and has not decided: a decided message's ack may wait for the flusher,
        # longer on a loaded machine, and its slot is free once decided)
        held.append(worker.consumers["default"].consumer.outstanding)
        time.sleep(0.05)
    # Then it held at most twice the prefetch (a claim of 4 lands while 4 are held), never the
    # cap: another process can start the rest (on the parent commit it held prefetch x 4 = 16)
    assert max(held) <= 8, held
    assert max(held) >= 2, held


def test_a_consumer_of_short_tasks_grows_its_claims_while_its_threads_run_dry(
    broker: PostgresBroker, start_worker: Any, db: Any
) -> None:
    # Given a backlog of no-op tasks, and claims whose round trip is 20 ms longer than the
    # database needs (so that the worker threads surely run dry while one is in flight)
    @dramatiq.actor(broker=broker)
    def quick() -> None:
        pass

    broker.enqueue_many([quick.message() for _ in range(1_500)])
    sizes = claims_seen(broker, delay_s=0.02)
    # When a worker of 2 threads (prefetch 4) drains it
    start_worker(broker, worker_threads=2)
    wait_for(lambda: queue_empty(db), 60, "the backlog to drain")
    # Then its claims grew to the cap, prefetch x overfetch_factor (on the parent commit
    # every claim asked for at most prefetch x 4 = 16)
    assert max(sizes) >= 32, sizes
    assert max(sizes) <= 4 * broker.options.overfetch_factor, sizes


def test_a_worker_process_records_the_actors_it_declares(worker_process: Any, db: Any) -> None:
    # Given a `dramatiq` CLI worker of tests/worker_app.py
    worker = worker_process(processes=1, threads=1)
    try:
        # Then its heartbeat records the queues it consumes and the actors its broker declares
        # (migration 0020; the Spark data source's check_actor reads them)
        wait_for(
            lambda: db.execute("SELECT count(*) FROM dramatiq.workers").fetchone()[0] == 1, 30, "a worker row"
        )
        queues, actors = db.execute("SELECT queues, actors FROM dramatiq.workers").fetchone()
        assert "default" in queues
        assert {"record", "slow_record", "fail", "crash"} <= set(actors)
        assert actors == sorted(actors)
    finally:
        worker.stop()
    # And a stopped worker's row is gone with its actors
    assert db.execute("SELECT count(*) FROM dramatiq.workers").fetchone()[0] == 0
