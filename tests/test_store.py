"""The typed stores (``dramatiq_pg_outbox/store``): each row type is its statement's columns, by name."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, NamedTuple

import psycopg
import pytest

from dramatiq_pg_outbox.store.messages import (
    ClaimRow,
    Fence,
    MessageStore,
    Requeued,
    named_rows,
)
from dramatiq_pg_outbox.store.periodic import PeriodicStore, Rules


class Pair(NamedTuple):
    a: int
    b: int


def claim_queue(
    store: MessageStore,
    db: psycopg.Connection[Any],
    queue_name: str,
    limit: int,
    lease: uuid.UUID,
    owner: uuid.UUID,
    *,
    prioritized: bool = False,
) -> Any:
    """One plain claim (or claim_prioritized) of ``queue_name`` by the only consumer, as a sweep."""
    return store.claim(
        db,
        prioritized=prioritized,
        queue_name=queue_name,
        limit=limit,
        lease=lease,
        owner=owner,
        consumers=1,
        rank=0,
        look_ahead=64,
        from_at=None,
        from_id=None,
    )


def test_a_row_type_takes_its_statements_columns_by_name(db: psycopg.Connection[Any]) -> None:
    # Given a row type of two fields
    rows = named_rows(Pair)
    # When a statement returns those columns, they fill the fields (a NamedTuple per row, by position)
    got = db.cursor(row_factory=rows).execute("SELECT 1 AS a, 2 AS b").fetchall()
    assert got == [Pair(1, 2)] and got[0].b == 2
    # Then a statement whose columns moved, or that has one more, is refused, not shifted
    with pytest.raises(TypeError, match=r"\['b', 'a'\], not those of Pair"):
        db.cursor(row_factory=rows).execute("SELECT 2 AS b, 1 AS a").fetchall()
    with pytest.raises(TypeError):
        db.cursor(row_factory=rows).execute("SELECT 1 AS a, 2 AS b, 3 AS c").fetchall()


def test_the_statements_of_the_hot_path_return_the_columns_of_their_row_types(
    db: psycopg.Connection[Any],
) -> None:
    # Given the messages store of the test schema and an empty queue
    store = MessageStore("dramatiq")
    lease, owner = uuid.uuid4(), uuid.uuid4()
    # When each statement runs once (named_rows checks the column names of each)
    for prioritized in (False, True):
        claim = claim_queue(store, db, "default", 8, lease, owner, prioritized=prioritized)
        # Then a claim of nothing is no row, with the clock
        assert claim.rows == [] and claim.next_due_in_ms is None and claim.prioritized is False
        assert claim.db_now_ms > 0
    fence: dict[str, Any] = {"ids": [1], "fences": [f"1/{lease}"]}
    assert store.ack_fenced(db, **fence) == []
    errors: dict[str, Any] = {"error_types": ["E"], "errors": ["e"]}
    assert store.archive_fenced(db, **fence, state="failed", **errors) == []
    assert store.requeue(db, **fence, notify=False, channel="c") == []
    assert store.notify_committed(db, channel="c", xids=[], payloads=[]) == []
    ranks = store.consumer_rank(db, queue_names=["default"], worker_id=owner, heartbeat_timeout_ms=1_000)
    assert {name: (r.consumers, r.rank, r.listed) for name, r in ranks.items()} == {"default": (0, 0, False)}
    reclaimed = store.reclaim_messages(
        db, rotate_ms=60_000, park_after_ms=60_000, max_slots=8, channel="c", max_moved=10
    )
    assert reclaimed is None or reclaimed.slot >= 0
    # And the row types are the statements' columns, in order
    assert ClaimRow._fields[:3] == ("id", "attempts", "payload")
    assert Fence._fields == ("id", "lease") and Requeued._fields[:2] == ("queue_name", "n")


def test_the_periodic_statements_return_the_columns_of_their_row_types(db: psycopg.Connection[Any]) -> None:
    # Given no schedule left by an earlier test in this database (the db fixture keeps them)
    db.execute("DELETE FROM dramatiq.schedules")
    store = PeriodicStore("dramatiq")
    rules = Rules(names=["s"], crons=[None], every_ms=[60_000], tzs=["UTC"])
    now = dt.datetime.now(dt.timezone.utc)
    with db.transaction():
        assert store.begin(db, idle_timeout=1_000) <= dt.datetime.now(dt.timezone.utc)
        declared = store.declare(
            db,
            rules=rules,
            actor_names=["a"],
            queue_names=["default"],
            missed=["skip"],
            grace_ms=[1_000],
            first_runs=[now],
            define=True,
            stale=now,
        )
        assert [(d.name, d.added) for d in declared] == [("s", True)]
        assert [d.name for d in store.claim(db, rules=rules, limit=4)] == ["s"]
        assert [row.name for row in store.list_schedules(db)] == ["s"]
        assert store.remove(db, removed_after=3_600_000, retention=3_600_000) == (0, 0)
        assert store.next_due_in(db, rules=rules) is not None
        raise psycopg.Rollback()


def test_the_fenced_statements_send_ids_and_fences_that_postgresql_reads_back_as_the_lists(
    db: psycopg.Connection[Any],
) -> None:
    # Given ids across the int sizes (smallint to bigint) and fences of real leases
    ids = [1, 32_768, 2**31 + 5, 2**62]
    fences = [f"{i}/{uuid.uuid4()}" for i in ids]
    # When the store builds a fenced statement's parameters (array literals, not lists)
    params = MessageStore._fence(ids, fences)
    assert all(isinstance(value, str) for value in params.values())
    # Then PostgreSQL reads them as the same arrays, in order
    row = db.execute("SELECT %(ids)s::bigint[], %(fences)s::text[]", params).fetchone()
    assert row == (ids, fences)
    empty = db.execute("SELECT %(ids)s::bigint[], %(fences)s::text[]", MessageStore._fence([], [])).fetchone()
    assert empty == ([], [])


def test_a_fenced_ack_archives_the_rows_whose_lease_holds_and_no_other(db: psycopg.Connection[Any]) -> None:
    # Given three claimed messages of one claim
    store = MessageStore("dramatiq")
    lease, owner = uuid.uuid4(), uuid.uuid4()
    db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload) "
        "SELECT 'fence_q', 'a', gen_random_uuid(), '\\x7b7d' FROM generate_series(1, 3)"
    )
    claim = claim_queue(store, db, "fence_q", 3, lease, owner)
    ids = sorted(row.id for row in claim.rows)
    assert len(ids) == 3
    # When an ack names all three, one of them with a stale lease
    stale = uuid.uuid4()
    leases = [lease, stale, lease]
    fences = [f"{i}/{held}" for i, held in zip(ids, leases, strict=True)]
    archived = store.ack_fenced(db, ids=ids, fences=fences)
    # Then the two whose lease holds are archived, the third stays claimed
    assert sorted(archived) == [Fence(ids[0], lease), Fence(ids[2], lease)]
    left = db.execute("SELECT id, state FROM dramatiq.messages WHERE queue_name = 'fence_q'").fetchall()
    assert left == [(ids[1], "processing")]
    states = db.execute(
        "SELECT id, state FROM dramatiq.history WHERE queue_name = 'fence_q' ORDER BY id"
    ).fetchall()
    assert states == [(ids[0], "completed"), (ids[2], "completed")]


def test_fence_params_pair_each_id_with_its_own_lease_whatever_the_order_of_the_leases() -> None:
    from dramatiq_pg_outbox._runtime import fence_params

    # Given decisions of three claims, interleaved, one lease also present as an equal copy
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    items = [(1, a), (2, a), (3, b), (4, a), (5, uuid.UUID(str(b))), (6, b), (7, c), (8, c)]
    # When their fence is built (the text of a lease is reused within a run of one lease)
    params = fence_params(items)
    # Then each fence is its own id and its own lease, in order
    assert params == {"ids": [1, 2, 3, 4, 5, 6, 7, 8], "fences": [f"{i}/{lease}" for i, lease in items]}
