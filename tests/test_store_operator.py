"""The operator's stores (store/admin.py, store/relay.py, store/spark.py): rows by column name."""

from __future__ import annotations

import datetime as dt
import pickle
import uuid
from typing import Any

import psycopg
import pytest

from dramatiq_pg_outbox.migrations import VERSION_TABLE
from dramatiq_pg_outbox.store.admin import AdminStore, FailedMessage, Gauge, QueueState, RetriedQueue
from dramatiq_pg_outbox.store.base import named_rows
from dramatiq_pg_outbox.store.messages import MessageStore
from dramatiq_pg_outbox.store.periodic import PeriodicStore
from dramatiq_pg_outbox.store.relay import RelayClaim, RelayStore
from dramatiq_pg_outbox.store.spark import IdRange, SparkStore


def _insert(db: psycopg.Connection[Any], queue: str) -> int:
    row = db.execute(
        "INSERT INTO dramatiq.messages (queue_name, actor_name, message_id, payload) "
        "VALUES (%s, 'act', gen_random_uuid()::text, '\\x7b7d') RETURNING id",
        (queue,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_every_admin_read_returns_its_row_type(db: psycopg.Connection[Any]) -> None:
    # Given a live message, a dead letter and a paused queue, and no schedule left by an earlier
    # test in this database (the db fixture keeps them)
    db.execute("DELETE FROM dramatiq.schedules")
    db.execute("DELETE FROM dramatiq.queue_pauses")  # (kept too: another test's pause would show)
    _insert(db, "mail")
    db.execute(
        "INSERT INTO dramatiq.history (id, queue_name, actor_name, message_id, state, attempts, enqueued_at,"
        " finished_at, error_type, error, payload) VALUES (900001, 'mail', 'act', 'm1', 'failed', 3, now(),"
        " now(), 'ValueError', 'boom', '\\x7b7d')"
    )
    store = AdminStore("dramatiq")
    assert store.pause_queues(db, queue_names=["mail", "mail.DQ"]) == ["mail", "mail.DQ"]
    try:
        # When each read runs, then its columns are its dataclass's fields, by name
        (queue,) = store.status_messages(db)
        assert isinstance(queue, QueueState)
        assert (queue.queue_name, queue.state, queue.messages) == ("mail", "pending", 1)
        (dead,) = store.status_failed(db)
        assert (dead.queue_name, dead.last_hour, dead.in_history) == ("mail", 1, 1)
        assert store.status_workers(db) == []
        assert [p.queue_name for p in store.paused_queues(db)] == ["mail", "mail.DQ"]
        (failed,) = store.failed_list(db, queue="mail", limit=5)
        assert isinstance(failed, FailedMessage) and (failed.id, failed.error_type) == (900001, "ValueError")
        with db.transaction(force_rollback=True):
            retried = store.retry_failed(
                db,
                ids=None,
                queue_name="mail",
                actor_name=None,
                error_type=None,
                search=None,
                limit=None,
                notify=False,
                channel="dramatiq",
            )
        assert retried == [RetriedQueue("mail", 1, [900001], None)]
        assert PeriodicStore("dramatiq").list_schedules(db) == []
        gauges = store.metrics_gauges(db, heartbeat_timeout_ms=20_000)
        assert Gauge("messages", "mail", "due", 1.0) in gauges
        assert Gauge("paused", "mail", None, 1.0) in gauges
        with db.cursor() as cur:
            assert MessageStore("dramatiq").schema_revision(cur).exists
        assert store.table_exists(db, table=VERSION_TABLE) and not store.table_exists(db, table="nope")
        assert store.applied_revisions(db, version_table=VERSION_TABLE)
        assert "history_default" in store.day_partitions(db)
        assert store.default_partition_rows(db) >= 0
        assert store.prune_cutoff(db, older_than=dt.timedelta(days=1)) < dt.datetime.now(dt.timezone.utc)
    finally:
        store.resume_queues(db, queue_names=["mail", "mail.DQ"], channel="dramatiq")
        db.execute("DELETE FROM dramatiq.history WHERE id = 900001")


def test_the_relay_claim_reads_its_rows_by_name_and_refuses_other_columns(
    db: psycopg.Connection[Any],
) -> None:
    row_id = _insert(db, "relayed")
    store = RelayStore("dramatiq")
    lease = uuid.uuid4()
    (claimed,) = store.claim(
        db, queues=["relayed"], limit=10, lease=lease, owner=uuid.uuid4(), from_at=None, from_id=None
    )
    # A tuple whose first item is the row id (what the runtime tracks), read by name
    assert isinstance(claimed, RelayClaim) and claimed[0] == claimed.id == row_id
    assert bytes(claimed.payload) == b"{}" and claimed.queue_name == "relayed"
    store.release(db, ids=[row_id], fences=[f"{row_id}/{lease}"])
    assert [(q.queue_name, q.due) for q in store.lag(db, queues=["relayed"])] == [("relayed", 1)]
    # A statement whose columns are not RelayClaim's fails loudly instead of shifting values
    with pytest.raises(TypeError, match="not those of RelayClaim"):
        with db.cursor(row_factory=named_rows(RelayClaim)) as cur:
            cur.execute("SELECT 1 AS id, 'q' AS queue_name, now() AS payload, 2 AS next_attempt_at")
            cur.fetchall()


def test_the_spark_store_pickles_as_its_schema_and_reads_the_id_range(db: psycopg.Connection[Any]) -> None:
    store = SparkStore("dramatiq")
    assert store.backlog_id_range(db) is None
    first, last = _insert(db, "q"), _insert(db, "q")
    assert store.backlog_id_range(db) == IdRange(first, last)
    # Shipped to the executors in a closure: the schema alone, the statements looked up there
    copy = pickle.loads(pickle.dumps(store))
    assert copy.schema == "dramatiq" and len(pickle.dumps(store)) < 200
    assert copy.backlog_id_range(db) == IdRange(first, last)
