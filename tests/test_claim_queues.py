"""One worker process, several queues: its consumers claim together (claim_queues, issue 37 part 3).

Real PostgreSQL, real Dramatiq workers: every message runs once, each queue is claimed in
its own order within its own consumer's bound, a paused queue among the ones claimed
together is not claimed, a keyed or prioritized queue keeps its own claims.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import dramatiq

from dramatiq_pg_outbox import PostgresBroker
from dramatiq_pg_outbox.broker.consumer import PostgresConsumer
from dramatiq_pg_outbox.store.messages import QueueClaim
from tests.helpers import count, wait_for

#: Generous bound for things that take milliseconds, in seconds (a loaded 2-core machine).
SOON = 30


def queue_names(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"multi_{tag}_{k}" for k in range(n)]


def consumers(broker: PostgresBroker) -> list[PostgresConsumer]:
    found = [c for group in broker.runtime.consumers.values() for c in group]
    return [c for c in found if isinstance(c, PostgresConsumer)]


def together(broker: PostgresBroker) -> tuple[int, int]:
    """(claims of the process's consumers, the statements that made them)."""
    claims = sum(c.claims for c in consumers(broker))
    return claims, claims - sum(c.claimed_by_others for c in consumers(broker))


def test_several_queues_drained_by_one_process_run_each_message_once_in_each_queues_order(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    # Given 6 queues with 150 messages each, waiting, and one worker process for all of them
    broker = make_broker()
    names = queue_names(6)
    ran: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()
    actors = []
    for name in names:

        def job(i: int, queue: str = name) -> None:
            with lock:
                ran[(queue, i)] += 1

        actors.append(dramatiq.actor(job, broker=broker, queue_name=name, actor_name=f"job_{name}"))
    for i in range(150):
        for actor in actors:
            actor.send(i)
    start_worker(broker, worker_threads=4)
    # When it drains them
    wait_for(lambda: len(ran) == 6 * 150, SOON, "every message")
    wait_for(
        lambda: (
            count(db, "SELECT count(*) FROM dramatiq.history WHERE queue_name = ANY(%s)", (names,)) == 900
        ),
        SOON,
        "every outcome written",
    )
    # Then each ran exactly once
    assert set(ran.values()) == {1}
    # And each queue was claimed in its own order: a later claim took only younger rows
    for name in names:
        rows = db.execute(
            "SELECT id FROM dramatiq.history WHERE queue_name = %s ORDER BY started_at, id", (name,)
        ).fetchall()
        ids = [row[0] for row in rows]
        assert ids == sorted(ids), name
    # And the consumers claimed for one another: fewer statements than claims (while draining, or
    # in the polls that follow it, whichever the machine's pace gives first)
    wait_for(lambda: together(broker)[1] < together(broker)[0], SOON, "a claim made for another queue")


def test_the_idle_polls_of_a_process_fall_into_few_statements(make_broker: Any, start_worker: Any) -> None:
    # Given a worker process of 8 idle queues (16 consumers: each queue and its .DQ), polling every 200 ms
    broker = make_broker()
    for name in queue_names(8):
        dramatiq.actor(lambda: None, broker=broker, queue_name=name, actor_name=f"idle_{name}")
    start_worker(broker, worker_threads=2)
    time.sleep(1.0)
    claims0, statements0 = together(broker)
    # When it idles for 2 s
    time.sleep(2.0)
    claims, statements = together(broker)
    # Then its polls (16 consumers x 5 a second) were made by far fewer statements
    assert claims - claims0 >= 16 * 5
    assert statements - statements0 <= (claims - claims0) / 4


def test_a_paused_queue_among_the_ones_claimed_together_is_not_claimed(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    db.execute("TRUNCATE dramatiq.queue_pauses")
    broker = make_broker()
    names = queue_names(4)
    paused = names[0]
    ran: list[tuple[str, int]] = []
    actors = []
    for name in names:

        def job(i: int, queue: str = name) -> None:
            ran.append((queue, i))

        actors.append(dramatiq.actor(job, broker=broker, queue_name=name, actor_name=f"job_{name}"))
    # Given a paused queue beside three others, each with messages
    db.execute("INSERT INTO dramatiq.queue_pauses (queue_name) VALUES (%s)", (paused,))
    try:
        for i in range(20):
            for actor in actors:
                actor.send(i)
        start_worker(broker, worker_threads=4)
        # When one process runs all four queues
        wait_for(lambda: len(ran) == 60, SOON, "the messages of the queues not paused")
        time.sleep(1.0)
        # Then the paused queue was part of claims made together, and none of its messages ran
        paused_consumer = next(c for c in consumers(broker) if c.queue_name == paused)
        assert paused_consumer.claimed_by_others > 0
        assert not [r for r in ran if r[0] == paused]
        pending = "SELECT count(*) FROM dramatiq.messages WHERE queue_name = %s AND state = 'pending'"
        assert count(db, pending, (paused,)) == 20
        # And once it is resumed they run
        db.execute("DELETE FROM dramatiq.queue_pauses WHERE queue_name = %s", (paused,))
        wait_for(lambda: len(ran) == 80, SOON, "the resumed queue's messages")
    finally:
        db.execute("DELETE FROM dramatiq.queue_pauses WHERE queue_name = %s", (paused,))


def test_a_keyed_queue_beside_plain_ones_keeps_its_limit(
    make_broker: Any, start_worker: Any, db: Any
) -> None:
    db.execute("DELETE FROM dramatiq.concurrency_limits")
    broker = make_broker()
    names = queue_names(4)
    keyed_queue = names[0]
    lock = threading.Lock()
    running = {"now": 0, "peak": 0, "done": 0}
    plain_done: list[int] = []

    # Given a queue whose messages share one concurrency key of limit 1, beside three plain queues
    @dramatiq.actor(broker=broker, queue_name=keyed_queue, concurrency_key="multi:1", concurrency_limit=1)
    def keyed(i: int) -> None:
        with lock:
            running["now"] += 1
            running["peak"] = max(running["peak"], running["now"])
        time.sleep(0.02)
        with lock:
            running["now"] -= 1
            running["done"] += 1

    plain = [
        dramatiq.actor(lambda i: plain_done.append(i), broker=broker, queue_name=name, actor_name=f"p_{name}")
        for name in names[1:]
    ]
    for i in range(30):
        keyed.send(i)
        for actor in plain:
            actor.send(i)
    # When one process with 8 threads runs them all
    start_worker(broker, worker_threads=8)
    wait_for(lambda: running["done"] == 30 and len(plain_done) == 90, SOON * 2, "every message")
    # Then the key never ran twice at once, and the plain queues claimed together
    assert running["peak"] == 1
    assert sum(c.claimed_by_others for c in consumers(broker) if c.queue_name in names[1:]) > 0


def test_a_prioritized_queue_beside_plain_ones_runs_its_priorities_first(
    make_broker: Any, start_worker: Any
) -> None:
    broker = make_broker()
    names = queue_names(4)
    ran: list[tuple[int, int]] = []

    @dramatiq.actor(broker=broker, queue_name=names[0])
    def job(priority: int, i: int) -> None:
        ran.append((priority, i))

    for name in names[1:]:
        dramatiq.actor(lambda: None, broker=broker, queue_name=name, actor_name=f"other_{name}")
    # Given mixed priorities waiting on one queue of a process that consumes three more
    sent = [0, 5, 0, 10, 5, 0, 7, 10, 0, 5]
    for i, priority in enumerate(sent):
        job.send_with_options(args=(priority, i), broker_priority=priority)
    start_worker(broker, worker_threads=1)
    wait_for(lambda: len(ran) == len(sent), SOON, "every message")
    # Then the highest priority ran first, and each priority in the order it was sent
    assert ran == sorted(((p, i) for i, p in enumerate(sent)), key=lambda pi: (-pi[0], pi[1]))


def test_each_queue_claimed_together_gets_at_most_its_own_limit(make_broker: Any, db: Any) -> None:
    # Given three queues with 10 messages each
    broker = make_broker()
    names = queue_names(3)
    for name in names:
        dramatiq.actor(lambda i: None, broker=broker, queue_name=name, actor_name=f"l_{name}")
        for i in range(10):
            broker.actors[f"l_{name}"].send(i)
    # When one statement claims for all three, with limits 2, 5 and 20
    limits = [2, 5, 20]
    with broker.runtime.connection() as conn:
        claims = broker.runtime.store.claim_queues(
            conn,
            [QueueClaim(name, limit, None, None, 1, 0) for name, limit in zip(names, limits, strict=True)],
            lease=uuid.uuid4(),
            owner=uuid.uuid4(),
            look_ahead=64,
        )
    # Then each queue got at most its own limit, oldest first, and no queue took another's slots
    assert [len(claims[name].rows) for name in names] == [2, 5, 10]
    for name in names:
        ids = [row.id for row in claims[name].rows]
        first = db.execute(
            "SELECT id FROM dramatiq.messages WHERE queue_name = %s ORDER BY id LIMIT %s", (name, len(ids))
        ).fetchall()
        assert sorted(ids) == [row[0] for row in first]


def test_each_consumer_claimed_for_by_others_holds_no_more_than_its_own_bound(
    make_broker: Any, start_worker: Any
) -> None:
    # Given an idle process of 4 queues whose consumers are pinned to Dramatiq's prefetch
    # (overfetch_factor 1: 2 threads -> 4 messages each), polling every 200 ms (no LISTEN)
    broker = make_broker(overfetch_factor=1.0, listen=False)
    names = queue_names(4)
    done: list[int] = []
    actors = [
        dramatiq.actor(
            lambda i: (time.sleep(0.005), done.append(i)),
            broker=broker,
            queue_name=name,
            actor_name=f"b_{name}",
        )
        for name in names
    ]
    peak: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for consumer in consumers(broker):
                peak[consumer.queue_name] = max(peak.get(consumer.queue_name, 0), consumer.outstanding)
            time.sleep(0.001)

    start_worker(broker, worker_threads=2)
    time.sleep(1.0)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # When 40 messages per queue are stored at once, and its polls claim them
    broker.enqueue_many([actor.message(i) for i in range(40) for actor in actors])
    try:
        wait_for(lambda: len(done) == 160, SOON * 2, "every message")
    finally:
        stop.set()
        sampler.join(5)
    # Then no consumer ever held more than its bound, though others claimed for it
    assert 1 <= max(peak[name] for name in names) <= 4
    assert sum(c.claimed_by_others for c in consumers(broker) if c.queue_name in names) > 0


def test_a_consumer_closed_while_another_claims_for_it_hands_those_rows_back(
    make_broker: Any, db: Any
) -> None:
    # Given a consumer of a queue with 10 messages waiting
    broker = make_broker()
    (name,) = queue_names(1)
    dramatiq.actor(lambda i: None, broker=broker, queue_name=name, actor_name=f"c_{name}")
    for i in range(10):
        broker.actors[f"c_{name}"].send(i)
    consumer = broker.consume(name)
    assert isinstance(consumer, PostgresConsumer)
    # And another consumer of its process claiming for it (it holds its claim lock)
    consumer._claim_lock.acquire()
    closer = threading.Thread(target=consumer.close)
    try:
        # When Dramatiq closes the consumer meanwhile
        closer.start()
        closer.join(0.3)
        # Then close() waits for that claim
        assert closer.is_alive()
        assert consumer._fetch(10) == 10
    finally:
        consumer._claim_lock.release()
    closer.join(SOON)
    assert not closer.is_alive()
    # And the rows that claim brought are handed back, not left processing in a closed buffer
    pending = (
        "SELECT count(*) FROM dramatiq.messages WHERE queue_name = %s AND state = 'pending' AND attempts = 0"
    )
    wait_for(lambda: count(db, pending, [name]) == 10, SOON, "the 10 rows handed back")
