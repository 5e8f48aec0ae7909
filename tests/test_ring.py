"""The ring of message partitions (migration 0013): where rows go, how the ring turns, what it empties.

Each test calls the reclaim loop's pass (``Reclaimer.run_once``) itself, with no
consumer running (a consumer's process would start its own loop), and reads the
partitions back from the catalog.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import dramatiq
import psycopg
import pytest

from dramatiq_pg_outbox import downgrade, upgrade
from dramatiq_pg_outbox._runtime.reclaimer import Reclaimer, ReclaimResult
from dramatiq_pg_outbox.dashboard.store import Store
from tests.helpers import count, wait_for, with_options

#: Generous bound for things that take milliseconds, in seconds (a loaded 2-core machine).
SOON = 15


def partition_of(db: Any, message_id: str) -> str:
    row = db.execute(
        "SELECT tableoid::regclass::text FROM dramatiq.messages WHERE message_id = %s", (message_id,)
    ).fetchone()
    assert row is not None, message_id
    return str(row[0])


def current(db: Any) -> str:
    return f"dramatiq.messages_ring{db.execute('SELECT slot FROM dramatiq.message_ring').fetchone()[0]}"


def filenode(db: Any, partition: str) -> int:
    return int(db.execute("SELECT pg_relation_filenode(%s::regclass)", (partition,)).fetchone()[0])


def partitions(db: Any) -> set[str]:
    return {
        str(r[0])
        for r in db.execute(
            "SELECT relid::regclass::text FROM pg_partition_tree('dramatiq.messages') WHERE isleaf"
        ).fetchall()
    }


def rotate(reclaimer: Reclaimer, db: Any) -> ReclaimResult:
    """One pass after the ring's current partition is old enough to turn."""
    db.execute("UPDATE dramatiq.message_ring SET rotated_at = now() - interval '1 hour'")
    result = reclaimer.run_once()
    assert result is not None
    return result


@pytest.fixture
def reclaimer(make_broker: Any) -> Any:
    broker = make_broker(rotate_interval=1_000)

    @dramatiq.actor(broker=broker, actor_name="noop")
    def noop(n: int) -> None:
        pass

    return broker, noop, Reclaimer(broker.runtime)


def test_keyed_and_far_delayed_messages_go_to_the_vacuumed_partition(reclaimer: Any, db: Any) -> None:
    # Given a plain message, one delayed by 10 s, one by 60 s and one with an idempotency key
    broker, noop, _ = reclaimer
    plain, soon, later = noop.message(1), noop.message(2), noop.message(3)
    broker.enqueue(plain)
    broker.enqueue(soon, delay=10_000)
    broker.enqueue(later, delay=60_000)
    keyed = noop.send_with_options(args=(4,), idempotency_key="ring-key")
    # Then the first two are in the ring's current partition; the keyed one and the one due in
    # a minute are in messages_vacuumed, which vacuum reclaims (a ring partition holds no key)
    ring = current(db)
    assert partition_of(db, plain.message_id) == ring
    assert partition_of(db, soon.message_id) == ring
    assert partition_of(db, later.message_id) == "dramatiq.messages_vacuumed"
    assert partition_of(db, keyed.message_id) == "dramatiq.messages_vacuumed"
    # And the key is still unique across the table
    noop.send_with_options(args=(5,), idempotency_key="ring-key")
    assert db.execute(
        "SELECT count(*) FROM dramatiq.messages WHERE idempotency_key = 'ring-key'"
    ).fetchone() == (1,)
    with pytest.raises(psycopg.errors.CheckViolation):
        db.execute(
            "INSERT INTO dramatiq.messages "
            "(queue_name, actor_name, message_id, payload, idempotency_key, slot) "
            "VALUES ('default', 'noop', 'x', '', 'k', %s)",
            (int(ring.removeprefix("dramatiq.messages_ring")),),
        )


def test_the_ring_turns_only_once_its_partition_is_old_and_has_had_rows(reclaimer: Any, db: Any) -> None:
    broker, noop, pass_ = reclaimer
    # Given an empty current partition an hour old: the ring does not turn for nothing
    db.execute("TRUNCATE dramatiq.messages")
    before = current(db)
    assert not rotate(pass_, db).rotated
    assert current(db) == before
    # When a message is stored in it and the ring turns
    message = noop.message(1)
    broker.enqueue(message)
    result = rotate(pass_, db)
    # Then new messages go to another partition, and the message stays where it is
    assert result.rotated and current(db) != before
    broker.enqueue(noop.message(2))
    assert partition_of(db, message.message_id) == before
    # And a recent partition does not turn again
    assert not pass_.run_once().rotated


def test_a_row_left_in_an_older_partition_is_moved_and_the_partition_emptied(reclaimer: Any, db: Any) -> None:
    # Given a message stored in a partition that has since become older than the previous one
    broker, noop, pass_ = reclaimer
    db.execute("TRUNCATE dramatiq.messages")
    left = noop.message(1)
    broker.enqueue(left)
    old = partition_of(db, left.message_id)
    (row_id,) = db.execute("SELECT id FROM dramatiq.messages").fetchone()
    rotate(pass_, db)
    broker.enqueue(noop.message(2))  # the next current partition has rows, so it can turn
    node = filenode(db, old)
    # When the ring turns again
    result = rotate(pass_, db)
    # Then the pending row moved to the current partition with its id, and its old partition,
    # left with no row, was emptied by TRUNCATE (a new file)
    assert result.moved == 1 and result.truncated >= 1, result
    assert partition_of(db, left.message_id) == current(db)
    assert db.execute(
        "SELECT id FROM dramatiq.messages WHERE message_id = %s", (left.message_id,)
    ).fetchone() == (row_id,)
    assert filenode(db, old) != node


def test_a_partition_that_a_transaction_holds_is_skipped(reclaimer: Any, db: Any, database_url: str) -> None:
    # Given a finished partition that a REPEATABLE READ transaction has read
    broker, noop, pass_ = reclaimer
    db.execute("TRUNCATE dramatiq.messages")
    broker.enqueue(noop.message(1))
    held = current(db)
    rotate(pass_, db)
    broker.enqueue(noop.message(2))
    db.execute("DELETE FROM dramatiq.messages WHERE tableoid = %s::regclass", (held,))  # it finished
    node = filenode(db, held)
    with psycopg.connect(database_url) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM dramatiq.messages")
        existing = partitions(db)
        # When the ring turns and tries to empty it
        result = rotate(pass_, db)
        # Then the pass returns while the transaction still holds it: skipped (busy: its lock was
        # not granted within 20 ms), not emptied
        assert result.busy >= 1 and result.truncated == 0, result
        assert filenode(db, held) == node
        # And the ring did not turn into a partition the transaction holds: a new one came, and
        # the ring turns to it at a later pass, not at the one that attached it (migration 0016:
        # an INSERT that locked the table just before the attach routes with the partitions it
        # knew then, and found none for the new slot)
        new = partitions(db) - existing
        assert len(new) == 1 and current(db) in existing, (current(db), existing)
        rotate(pass_, db)
        assert current(db) in new, (current(db), new)
        reader.rollback()
    # When the transaction has ended, the next pass empties it
    assert pass_.run_once().truncated >= 1
    assert filenode(db, held) != node


def test_the_pools_prepared_statements_run_generic_plans_without_jit(make_broker: Any) -> None:
    # Given a broker, and one configured for PgBouncer's transaction pooling (nothing prepared)
    broker = make_broker()
    pooled = make_broker(prepare_threshold=None)
    # Then its connections plan a prepared statement once (planning the claim over the partitions
    # cost as much as running it) and compile none with JIT, and the other's carry no session
    # setting to a shared server
    with broker.runtime.connection() as conn:
        assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_generic_plan",)
        assert conn.execute("SHOW jit").fetchone() == ("off",)
    with pooled.runtime.connection() as conn:
        assert conn.execute("SHOW plan_cache_mode").fetchone() == ("auto",)
        assert conn.execute(
            "SELECT current_setting('jit') = reset_val FROM pg_settings WHERE name = 'jit'"
        ).fetchone() == (True,)


def test_the_rescuer_compiles_nothing_with_jit_however_costly_its_plan_looks(
    make_broker: Any, database_url: str, db: Any
) -> None:
    from dramatiq_pg_outbox._queries import queries_for_schema

    if not db.execute("SELECT pg_jit_available()").fetchone()[0]:
        pytest.skip("this server has no JIT (PostgreSQL built without LLVM)")
    # Given a broker whose sessions start with JIT at any plan cost (what a large table with no
    # statistics made of the rescuer's plan: an estimate of 170,000 for 1,000,000 rows pending,
    # past the default jit_above_cost of 100,000, and 72 ms of compiling a pass that found nothing)
    broker = make_broker(url=with_options(database_url, "-c jit_above_cost=0"))
    # When the rescuer's statement runs on one of its connections
    params = {
        "worker_id": broker.runtime.worker_id, "heartbeat_timeout_ms": 10_000, "max_lease_ms": None,
        "max_deliveries": 20, "channel": broker.channel,
    }  # fmt: skip
    with broker.runtime.connection() as conn, conn.transaction(force_rollback=True):
        plan = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + queries_for_schema("dramatiq")["rescue"], params
        )
        found = plan.fetchone()[0][0]
    # Then nothing was compiled (on the parent commit: "JIT": {"Functions": 161, ...})
    assert "JIT" not in found, found["JIT"]


# -- operator actions against a move in progress ---------------------------------------------
def _dashboard(database_url: str, broker: Any, action: str, row_id: int) -> Any:
    async def run() -> Any:
        store = Store(database_url, "dramatiq", broker.channel)
        await store.open()
        try:
            if action == "cancel":
                return (await store.cancel_message(row_id, "by the operator")).queue_name
            if action == "run_now":
                return await store.run_now(row_id)
            return await store.purge_queue("default")
        finally:
            await store.close()

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("action", "delay", "expected"),
    [
        ("cancel", None, "default"),  # the dashboard's cancel: the row's queue
        ("run_now", 20_000, "default"),  # the dashboard's "run now" of a delayed row
        ("purge", None, 2),  # the dashboard's purge: the moved row and the one left in place
        ("flush", None, None),  # broker.flush (Dramatiq's API)
    ],
)
def test_an_operator_action_that_waited_on_a_row_the_reclaimer_moved_finds_it_where_it_went(
    reclaimer: Any, db: Any, database_url: str, action: str, delay: int | None, expected: Any
) -> None:
    # Given a row handed back (pending again) in a partition older than the previous one, after
    # the turn that made it so (a turn locks its new partition, which would make the action
    # wait before it takes its snapshot); delayed by 20 s for "run now" (still within the ring);
    # and a message in the previous partition
    broker, noop, pass_ = reclaimer
    db.execute("TRUNCATE dramatiq.messages")
    left = noop.message(1)
    broker.enqueue(left, delay=delay)
    old = partition_of(db, left.message_id)
    (row_id,) = db.execute("SELECT id FROM dramatiq.messages").fetchone()
    rotate(pass_, db)
    broker.enqueue(noop.message(2))
    db.execute(
        "UPDATE dramatiq.messages SET state = 'processing', lease = gen_random_uuid(), acquired_at = now() "
        "WHERE id = %s",
        (row_id,),
    )
    assert rotate(pass_, db).moved == 0  # a processing row finishes where it is
    db.execute(
        "UPDATE dramatiq.messages SET state = 'pending', lease = NULL, acquired_at = NULL WHERE id = %s",
        (row_id,),
    )
    outcome: list[Any] = []
    with (
        psycopg.connect(database_url, autocommit=True) as holder,
        psycopg.connect(database_url, autocommit=True) as mover,
    ):
        # And a reclaimer that moved it (DELETE ... RETURNING into INSERT, same id) in a
        # transaction still open; the old partition is held (as the waiting action itself holds
        # it when the reclaimer gets there), so the move is not followed by a TRUNCATE, whose
        # lock would make the action wait before it takes its snapshot
        holder.execute("BEGIN")
        holder.execute(f"SELECT 1 FROM {old} LIMIT 1")
        mover.execute("BEGIN")
        moved = mover.execute(
            "SELECT moved, truncated FROM dramatiq.reclaim_messages(1000, 30000, 8, %s, 1000)",
            (broker.channel,),
        ).fetchone()
        assert moved == (1, 0)

        # When the operator's action runs and waits on the row the reclaimer deleted
        def act() -> None:
            if action == "flush":
                outcome.append(broker.flush("default"))
            else:
                outcome.append(_dashboard(database_url, broker, action, row_id))

        acting = threading.Thread(target=act)
        acting.start()
        wait_for(
            lambda: (
                count(
                    db,
                    "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    (mover.info.backend_pid,),
                )
                == 1
            ),
            SOON,
            "the action to wait on the reclaimer's transaction",
        )
        # And the reclaimer commits
        mover.execute("COMMIT")
        acting.join(SOON)
        holder.execute("ROLLBACK")
    # Then the action found the row where it was moved: done, not "gone" while it still waits
    assert outcome == [expected]
    left_rows = db.execute(
        "SELECT id, next_attempt_at <= now() FROM dramatiq.messages WHERE id = %s", (row_id,)
    ).fetchall()
    if action == "run_now":
        assert left_rows == [(row_id, True)]
    else:
        assert left_rows == []
    if action == "cancel":
        assert db.execute("SELECT error_type FROM dramatiq.history WHERE id = %s", (row_id,)).fetchall() == [
            ("Canceled",)
        ]


def test_revision_0016_turns_the_ring_later_and_its_downgrade_restores_0015(database_url: str) -> None:
    schema = "ring_0016"

    def reclaim_definition() -> str:
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                "SELECT pg_get_functiondef(p.oid) FROM pg_proc AS p "
                "WHERE p.pronamespace = %s::regnamespace AND p.proname = 'reclaim_messages'",
                (schema,),
            ).fetchone()
        assert row is not None
        return str(row[0])

    try:
        # Given a schema at 0015, then upgraded to 0016
        upgrade(database_url, schema=schema, revision="0015")
        before = reclaim_definition()
        upgrade(database_url, schema=schema, revision="0016")
        after = reclaim_definition()
        # Then the one change is the attach's target left unset (3 lines: 2 of comment)
        assert "migration 0016" not in before and "migration 0016" in after
        assert len(after.splitlines()) == len(before.splitlines()) + 3
        # And the downgrade restores 0015's function
        downgrade(database_url, schema=schema, revision="0015")
        assert reclaim_definition() == before
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
