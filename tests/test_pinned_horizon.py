"""Claims while a long transaction pins the MVCC horizon (issue 20).

While any transaction that began before them is open, the index entries that
claims leave behind in ``messages_ready_idx`` can be neither vacuumed nor
skipped: a claim that starts at the queue's first entry reads every one of
them.  The consumer's claims start at its watermark instead, and a sweep from
the start now and then finds what the watermark passes over.  These tests pin
the horizon with a ``REPEATABLE READ`` transaction of their own and count the
index blocks that the claims read (``pg_statio_user_indexes``), not seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import Message

from dramatiq_pg_outbox._runtime import fence_params
from dramatiq_pg_outbox._runtime import watermark as watermark_module

from .helpers import count, wait_for

#: Messages drained while the horizon is pinned.
MESSAGES = 20_000


@pytest.fixture
def pinned(database_url: str, db: Any) -> Iterator[psycopg.Connection[Any]]:
    """A REPEATABLE READ transaction that has taken its snapshot, held for the test."""
    with psycopg.connect(database_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM received")
        yield holder
        holder.rollback()


def ready_index_blocks(db: Any, partition: str | None = None) -> int:
    """Blocks read from messages_ready_idx: of one partition's index, or of all of them."""
    row = db.execute(
        "SELECT coalesce(sum(s.idx_blks_hit + s.idx_blks_read), 0) FROM pg_statio_user_indexes AS s "
        "JOIN pg_index AS i ON i.indexrelid = s.indexrelid "
        "WHERE s.indexrelid IN (SELECT relid FROM pg_partition_tree('dramatiq.messages_ready_idx')) "
        "AND (%(partition)s::regclass IS NULL OR i.indrelid = %(partition)s::regclass)",
        {"partition": partition},
    ).fetchone()
    return int(row[0])


def settled_blocks(db: Any, partition: str | None = None) -> int:
    """The ready index's block count once the closed connections' statistics are in."""
    last, same_since = -1, time.monotonic()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = ready_index_blocks(db, partition)
        if now != last:
            last, same_since = now, time.monotonic()
        elif time.monotonic() - same_since > 1.0:
            break
        time.sleep(0.1)
    return last


def drain(consumer: Any, count: int) -> None:
    got = 0
    deadline = time.monotonic() + 120
    while got < count:
        assert time.monotonic() < deadline, f"drained {got} of {count}"
        message = next(consumer)
        if message is not None:
            consumer.ack(message)
            got += 1


def test_claims_start_at_the_watermark_while_the_horizon_is_pinned(
    make_broker: Any, db: Any, pinned: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given 20,000 messages stored in batches of 100 and a horizon pinned before any was claimed
    monkeypatch.setattr(watermark_module, "LAG_MS", 50)
    producer = make_broker()

    @dramatiq.actor(broker=producer)
    def noop() -> None:
        pass

    producer.enqueue_many((noop.message() for _ in range(MESSAGES)), batch_size=100)
    # (Its connections close, so their statistics, the inserts' index blocks, are in before the count.)
    producer.close()
    # (All in the ring's current partition, whose index the count below reads: each claim also
    # reads one or two blocks of each other partition's index, empty or not, pinned or not.)
    (partition,) = db.execute("SELECT DISTINCT tableoid::regclass::text FROM dramatiq.messages").fetchone()
    before = settled_blocks(db, partition)
    # When one consumer claims and acks them all
    broker = make_broker(max_fetch_interval=1_000)
    broker.declare_queue("default")
    consumer = broker.consume("default", prefetch=16, timeout=100)
    drain(consumer, MESSAGES)
    claims, sweeps = consumer.claims, consumer.watermark.sweeps
    broker.close()
    blocks = settled_blocks(db, partition) - before
    # Then its claims read a few index blocks each: the entries it claimed more than
    # LAG_MS ago are behind its watermark, and only its sweeps read them all.
    # (Measured: 12 blocks per claim, 313 claims of which 12 sweeps; on the parent
    # commit, whose every claim starts at the queue's first entry, 56 per claim.)
    # (a claim takes at most prefetch x overfetch_factor messages)
    assert claims >= MESSAGES / math.ceil(16 * broker.options.overfetch_factor)
    assert blocks / claims < 25, (blocks, claims, sweeps)
    assert 1 <= sweeps < claims / 4
    # And the horizon was pinned: a sweep now reads every entry claimed since
    with db.transaction(force_rollback=True):
        plan = db.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT id FROM dramatiq.messages "
            "WHERE queue_name = 'default' AND state = 'pending' AND next_attempt_at <= now() "
            "ORDER BY next_attempt_at, id LIMIT 64"
        ).fetchone()[0][0]
    assert plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0) > 500, plan


def test_a_message_committed_behind_the_watermark_is_claimed_by_a_sweep(
    make_broker: Any, database_url: str, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a transaction that stored a message and has not committed yet
    monkeypatch.setattr(watermark_module, "LAG_MS", 0)
    broker = make_broker(max_fetch_interval=200)

    @dramatiq.actor(broker=broker)
    def noop(n: int) -> None:
        pass

    late = noop.message(-1)
    with psycopg.connect(database_url) as producer:
        producer.execute(
            "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload) "
            "VALUES (%s, %s, %s, %s)",
            ("default", "noop", late.message_id, late.encode()),
        )
        time.sleep(0.05)
        # And a consumer whose watermark has passed it: it claimed messages stored after it
        consumer = broker.consume("default", prefetch=8, timeout=100)
        for n in range(20):
            noop.send(n)
            message = next(consumer)
            assert message is not None and message.args == (n,)
            consumer.ack(message)
            time.sleep(0.02)
        assert consumer.watermark.key is not None
        sweeps = consumer.watermark.sweeps
        # When it commits (no notification: only the poll and the sweep can find it)
        producer.commit()
    # Then the next sweep claims it
    deadline = time.monotonic() + 10
    message = None
    while message is None and time.monotonic() < deadline:
        message = next(consumer)
    assert isinstance(message, dramatiq.broker.MessageProxy) and message.message_id == late.message_id
    assert consumer.watermark.sweeps > sweeps
    consumer.ack(message)


def test_messages_handed_back_behind_the_watermark_are_claimed_again(
    make_broker: Any, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a consumer holding claimed messages that it has not started
    monkeypatch.setattr(watermark_module, "LAG_MS", 0)
    broker = make_broker(max_fetch_interval=30_000)

    @dramatiq.actor(broker=broker)
    def noop(n: int) -> None:
        pass

    held = broker.consume("default", prefetch=10, timeout=100)
    for n in range(10):
        noop.send(n)
    taken = [m for m in (next(held) for _ in range(20)) if m is not None]
    assert len(taken) == 10
    # And another consumer whose watermark is past them (it claimed later messages)
    second = make_broker(max_fetch_interval=30_000)
    second.declare_queue("default")
    other = second.consume("default", prefetch=10, timeout=100)
    for n in range(10, 13):
        noop.send(n)
        time.sleep(0.01)
    got = [m for m in (next(other) for _ in range(10)) if m is not None]
    assert sorted(m.args[0] for m in got) == [10, 11, 12]
    for message in got:
        other.ack(message)
    # When the first one hands them back (as a worker does when it stops), which notifies
    held.requeue(taken)
    # Then the other claims all of them, by a sweep, long before its 30 s poll
    other.timeout = 200
    again: list[Message[Any]] = []
    deadline = time.monotonic() + 10
    while len(again) < 10 and time.monotonic() < deadline:
        message = next(other)
        if message is not None:
            again.append(message)
            other.ack(message)
    assert sorted(m.args[0] for m in again) == list(range(10))


def test_relay_claims_start_at_its_watermark_while_the_horizon_is_pinned(
    make_broker: Any, db: Any, pinned: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = pytest.importorskip("redis", reason="the relay tests need redis (pip install 'dramatiq[redis]')")
    from dramatiq.brokers.redis import RedisBroker

    from dramatiq_pg_outbox.relay import Relay

    # Given 20,000 messages to relay to Redis, stored with the horizon pinned
    monkeypatch.setattr(watermark_module, "LAG_MS", 50)
    producer = make_broker()

    @dramatiq.actor(broker=producer, queue_name="relayed")
    def noop() -> None:
        pass

    producer.enqueue_many((noop.message() for _ in range(MESSAGES)), batch_size=100)
    producer.close()
    before = settled_blocks(db)
    namespace = f"dpo-pinned-{time.monotonic_ns()}"
    target = RedisBroker(url="redis://127.0.0.1:6379/0", namespace=namespace)
    try:
        # When a relay moves them all, 64 per claim
        broker = make_broker()
        relay = Relay(broker, target, ["relayed"], batch_size=64)
        claims, relayed = 0, 0
        deadline = time.monotonic() + 120
        while relayed < MESSAGES:
            assert time.monotonic() < deadline, f"relayed {relayed} of {MESSAGES}"
            relayed += relay.run_once()
            claims += 1
        sweeps = relay.watermark.sweeps
        broker.close()
        blocks = settled_blocks(db) - before
    finally:
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        for key in client.scan_iter(f"{namespace}*"):
            client.delete(key)
        target.close()
    # Then its claims read a few index blocks each, as a consumer's do
    # (Measured: 4.6 blocks per claim, 313 claims of which 7 sweeps; on the parent commit,
    # 101 per claim: relay_next_due read from each queue's first entry, and the claim
    # sorted every due row.)
    assert blocks / claims < 25, (blocks, claims, sweeps)
    assert 1 <= sweeps < claims / 4


def test_an_ack_reads_the_primary_key_not_the_owner_index_while_the_horizon_is_pinned(
    make_broker: Any, db: Any, pinned: Any
) -> None:
    from dramatiq_pg_outbox._queries import queries_for_schema

    # Given 5,000 messages claimed and acked with the horizon pinned, a backlog, and fresh statistics
    # (they see almost no processing row, so the partial owner index looks empty to the planner)
    broker = make_broker()

    @dramatiq.actor(broker=broker)
    def noop() -> None:
        pass

    broker.enqueue_many((noop.message() for _ in range(5_000)), batch_size=100)
    consumer = broker.consume("default", prefetch=16, timeout=100)
    drain(consumer, 5_000)
    broker.enqueue_many((noop.message() for _ in range(2_000)), batch_size=100)
    db.execute("ANALYZE dramatiq.messages")
    # When a batch of claimed messages is acked
    held = [m for m in (next(consumer) for _ in range(8)) if m is not None]
    assert held
    params = fence_params([(m.row_id, m.lease) for m in held])
    with db.transaction(force_rollback=True):
        plan = "\n".join(
            r[0] for r in db.execute("EXPLAIN " + queries_for_schema("dramatiq")["ack"], params).fetchall()
        )
    # Then the rows are found by their primary key, never by reading the owner index, which holds
    # an entry for each of the 5,000 (on the parent commit the plan read messages_owner_idx)
    assert "_pkey" in plan and "owner_idx" not in plan, plan


def test_an_ack_probes_each_partition_by_id_whatever_its_statistics_say(
    make_broker: Any, db: Any, pinned: Any
) -> None:
    from dramatiq_pg_outbox._queries import queries_for_schema
    from dramatiq_pg_outbox._runtime.reclaimer import Reclaimer

    # Given 5,000 messages claimed and acked in one ring partition with the horizon pinned, the
    # ring turned, and that partition vacuumed: vacuum can remove none of its dead rows, and its
    # statistics now say it holds 0 rows in all its pages
    broker = make_broker(rotate_interval=0)

    @dramatiq.actor(broker=broker)
    def noop() -> None:
        pass

    broker.enqueue_many((noop.message() for _ in range(5_000)), batch_size=100)
    (drained,) = db.execute("SELECT DISTINCT tableoid::regclass::text FROM dramatiq.messages").fetchone()
    consumer = broker.consume("default", prefetch=64, timeout=100)
    drain(consumer, 5_000)
    left = f"SELECT count(*) FROM {drained}"
    wait_for(lambda: db.execute(left).fetchone() == (0,), 30, "the last acks' flush")
    db.execute("UPDATE dramatiq.message_ring SET rotated_at = now() - interval '1 hour'")
    assert Reclaimer(broker.runtime).run_once().rotated  # type: ignore[union-attr]
    db.execute(f"VACUUM {drained}")
    stats = db.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", (drained,)).fetchone()
    assert stats == (0,), stats
    # When 64 messages claimed from the new current partition are acked
    broker.enqueue_many((noop.message() for _ in range(300)), batch_size=100)
    held = [m for m in (next(consumer) for _ in range(64)) if m is not None]
    assert len(held) >= 32
    params = fence_params([(m.row_id, m.lease) for m in held])
    with db.transaction(force_rollback=True):
        plan = db.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queries_for_schema("dramatiq")["ack"], params
        ).fetchone()[0][0]
    # Then each partition's primary key is probed for the ids, not read through once per message
    # (measured: 283 buffers; on the parent commit, which joined the ids with the table, the
    # nested loop scanned the drained partition's index for each message: 10,192 buffers)
    buffers = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0)
    assert buffers < 2_000, (buffers, plan)


def table_bytes(db: Any) -> int:
    """The messages table's size with its indexes, summed over its partitions."""
    row = db.execute(
        "SELECT coalesce((SELECT sum(pg_total_relation_size(relid)) "
        "FROM pg_partition_tree('dramatiq.messages')), pg_total_relation_size('dramatiq.messages'))"
    ).fetchone()
    return int(row[0])


def ring_filenodes(db: Any) -> set[tuple[str, int]]:
    """(partition, file node) of each partition of messages: TRUNCATE gives a partition a new file."""
    return {
        (str(name), int(node))
        for name, node in db.execute(
            "SELECT relid::regclass::text, pg_relation_filenode(relid) "
            "FROM pg_partition_tree('dramatiq.messages') WHERE isleaf"
        ).fetchall()
    }


#: Messages per second offered, and for how long, while the horizon is pinned.
RATE, SECONDS = 2_000, 25
#: The size the messages table must stay under (bytes).  Pinned, each message leaves its row
#: versions and their index entries behind until the pin ends: on the parent commit (one plain
#: table) these 50,000 messages grew it to 36.4 MB with either kind of transaction; with the
#: ring, 6.7 MB (another table read) and 8.8 MB (the messages table read), 17-19 truncations;
#: 40.9 MB once, on a machine loaded by a 2,000 msg/s benchmark and three other test runs, where
#: the worker fell behind: rows that wait keep their partitions from being emptied.
SIZE_BOUND = 20 * 1024 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("reads", ["received", "dramatiq.messages"])
def test_the_table_stays_small_while_the_horizon_is_pinned(
    make_broker: Any, start_worker: Any, database_url: str, db: Any, reads: str
) -> None:
    # Given a worker whose ring turns every second, and a transaction that pins the horizon after
    # reading another table, or the messages table itself (then it holds every partition there
    # was: they cannot be emptied until it ends, and the ring grows by new ones instead)
    broker = make_broker(rotate_interval=1_000)

    @dramatiq.actor(broker=broker, max_retries=0)
    def noop(n: int) -> None:
        pass

    start_worker(broker, worker_threads=8)
    with psycopg.connect(database_url) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute(f"SELECT count(*) FROM {reads}")
        # When 2,000 messages a second are sent for 25 s (a batch every 100 ms) and processed
        files, largest = ring_filenodes(db), 0
        started = time.monotonic()
        for tick in range(SECONDS * 10):
            broker.enqueue_many(
                (noop.message(tick * 1_000 + i) for i in range(RATE // 10)), batch_size=RATE // 10
            )
            files |= ring_filenodes(db)
            largest = max(largest, table_bytes(db))
            time.sleep(max(0.0, started + (tick + 1) / 10 - time.monotonic()))
        sizes = [largest]

        def drained() -> bool:
            sizes.append(table_bytes(db))
            return count(db, "SELECT count(*) FROM dramatiq.history") >= RATE * SECONDS

        wait_for(drained, 60, "the worker to keep up", 0.2)
        largest = max(sizes)
        holder.rollback()
    # Then every message ran once, and the table stayed under the bound: partitions that drained
    # were emptied by TRUNCATE (each got a new file), pinned horizon or not
    assert db.execute("SELECT count(*), count(DISTINCT message_id) FROM dramatiq.history").fetchone() == (
        RATE * SECONDS,
        RATE * SECONDS,
    )
    truncated = len(files) - len({name for name, _ in files})
    assert largest < SIZE_BOUND, (largest, files)
    assert truncated >= 5, files
